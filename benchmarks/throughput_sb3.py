"""single_process (and pipelined) PPO steps/s vs Stable-Baselines3 PPO, identical hyper-parameters.

Both train PPO on CartPole-v1 with CleanRL's ppo.py hyper-parameters (4 envs x 128 steps,
4 minibatches, 4 epochs, lr 2.5e-4 annealed, clip 0.2 with clipped value loss, ent 0.01, vf 0.5,
grad-norm 0.5, Adam eps 1e-5, 64x64 tanh actor and critic) for the same number of steps; runs
alternate, each in a fresh process, and the median steps/s of each is compared. Both use one
torch thread. Steps/s is measured over training only (after set-up and fragflow's trace).

    python benchmarks/throughput_sb3.py [--steps 50000] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys

from common import print_rows, row, run_json, save, stats

FRAGFLOW = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(total_timesteps={steps}, seed={seed}), policy={policy!r})
print(json.dumps({{"sps": r.summary["steps_per_second"], "ret": r.summary["final_return_mean"]}}))
"""

SB3 = """
import json, time, torch
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
env = make_vec_env("CartPole-v1", n_envs=4, seed={seed})
model = PPO("MlpPolicy", env, n_steps=128, batch_size=128, n_epochs=4, learning_rate=lambda f: 2.5e-4 * f,
            gamma=0.99, gae_lambda=0.95, clip_range=0.2, clip_range_vf=0.2, ent_coef=0.01, vf_coef=0.5,
            max_grad_norm=0.5, normalize_advantage=True, seed={seed}, device="cpu", verbose=0,
            policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh,
                               ortho_init=True, optimizer_kwargs=dict(eps=1e-5)))
t = time.perf_counter()
model.learn({steps})
dt = time.perf_counter() - t
rets = [e["r"] for e in model.ep_info_buffer]
print(json.dumps({{"sps": model.num_timesteps / dt, "ret": sum(rets[-20:]) / max(1, len(rets[-20:]))}}))
"""


def once(code: str) -> dict:
    return run_json(code)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    ours, piped, theirs = [], [], []
    for rep in range(a.reps):
        ours.append(once(FRAGFLOW.format(steps=a.steps, seed=rep + 1, policy="single_process"))["sps"])
        piped.append(once(FRAGFLOW.format(steps=a.steps, seed=rep + 1, policy="pipelined"))["sps"])
        theirs.append(once(SB3.format(steps=a.steps, seed=rep + 1))["sps"])
        print(f"rep {rep + 1}/{a.reps}: single_process {ours[-1]:,.0f} steps/s, pipelined {piped[-1]:,.0f}, "
              f"sb3 {theirs[-1]:,.0f} steps/s", flush=True)
    rows = [row("PPO CartPole steps/s, single_process vs SB3", stats(ours), "sb3", stats(theirs), "steps/s", ">= 1.5"),
            row("PPO CartPole steps/s, pipelined vs SB3", stats(piped), "sb3", stats(theirs), "steps/s", "-")]
    save("throughput_sb3", {"command": "python benchmarks/throughput_sb3.py " + " ".join(argv or sys.argv[1:]),
                            "steps": a.steps, "rows": rows, "single_process_sps": ours, "pipelined_sps": piped,
                            "sb3_sps": theirs})
    print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
