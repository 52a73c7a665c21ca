"""Steps/s of A2C, DQN and SAC against their Stable-Baselines3 counterparts, identical hyper-parameters.

For each algorithm, fragflow under ``single_process`` and under the default policy (``pipelined``)
and SB3 train the same configuration on the same env for the same number of steps; runs alternate,
each in a fresh process with one torch thread (``FRAGFLOW_THREADS=1`` for fragflow; ``--threads N``
another count, ``--threads default`` each as it runs unset: torch's thread per core for SB3, which
runs SAC's 256-256 networks faster with two than with one here, the placement's for fragflow), and the median
steps/s of each is compared; since the VM's speed drifts between reps, each rep's own ratio (its
three runs back to back) is recorded too, with their median. fragflow's steps/s is its run's
(``summary.json``), SB3's over ``learn``: under ``single_process`` the trace is the run's beginning
(a warm-up before the first update, as DQN's 10k steps, is run through while tracing, and counts),
under ``pipelined`` the run that follows the trace; fragflow's steps/s over the whole ``ff.run``
call, tracing, placing and lowering included, is recorded beside it.

=========  =============  ==========================================================================
algorithm  env            configuration (both sides)
=========  =============  ==========================================================================
a2c        CartPole-v1    8 envs x 5 steps, RMSprop lr 7e-4 annealed linearly to 0 (alpha 0.99, eps
                          1e-5), gamma 0.99, lambda 1, ent 0, vf 0.5, grad norm 0.5, separate 64-64
                          tanh nets
dqn        CartPole-v1    CleanRL's dqn.py: 120-84 ReLU, Adam 2.5e-4, replay 10k, warm-up 10k, batch
                          128, train every 10 steps, target every 500, epsilon 1 -> 0.05 over half
sac        Pendulum-v1    256-256 ReLU, lr 3e-4 for everything, replay 1M, warm-up 5k, batch 256,
                          tau 0.005, actor every step, automatic entropy tuning
=========  =============  ==========================================================================

    python benchmarks/throughput_algos.py [--algos a2c dqn sac] [--reps 3] [--threads 1|N|default]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import print_rows, row, run_json, save, stats

STEPS = {"a2c": 50_000, "dqn": 30_000, "sac": 7_000}

ARGS = {
    "a2c": "a2c.Args(total_timesteps={steps}, seed={seed})",
    "dqn": "dqn.Args(total_timesteps={steps}, seed={seed})",
    "sac": "sac.Args(total_timesteps={steps}, seed={seed}, q_lr=3e-4, policy_lr=3e-4, policy_frequency=1)",
}

FRAGFLOW = """
import json, time, torch
{threads}
import fragflow as ff
from fragflow.algorithms import {algo}
torch.optim.Adam([torch.zeros(1, requires_grad=True)])   # torch's one-time imports (SB3's happen as it builds its model)
t = time.perf_counter()
r = ff.run({algo}.train, {args}, policy={policy!r})
dt = time.perf_counter() - t
print(json.dumps({{"sps": r.summary["steps_per_second"], "e2e_sps": r.summary["env_steps"] / dt,
                  "ret": r.summary["final_return_mean"]}}))
"""

SB3_MODEL = {
    "a2c": """
from stable_baselines3 import A2C
env = make_vec_env("CartPole-v1", n_envs=8, seed={seed})
model = A2C("MlpPolicy", env, n_steps=5, learning_rate=lambda progress: 7e-4 * progress, gamma=0.99, gae_lambda=1.0, ent_coef=0.0, vf_coef=0.5,
            max_grad_norm=0.5, use_rms_prop=True, rms_prop_eps=1e-5, normalize_advantage=False, seed={seed},
            device="cpu", policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh))
""",
    "dqn": """
from stable_baselines3 import DQN
env = make_vec_env("CartPole-v1", n_envs=1, seed={seed})
model = DQN("MlpPolicy", env, learning_rate=2.5e-4, buffer_size=10_000, learning_starts=10_000, batch_size=128,
            tau=1.0, gamma=0.99, train_freq=10, gradient_steps=1, target_update_interval=500,
            exploration_fraction=0.5, exploration_initial_eps=1.0, exploration_final_eps=0.05,
            max_grad_norm=1e9, seed={seed}, device="cpu", policy_kwargs=dict(net_arch=[120, 84]))
""",
    "sac": """
from stable_baselines3 import SAC
env = make_vec_env("Pendulum-v1", n_envs=1, seed={seed})
model = SAC("MlpPolicy", env, learning_rate=3e-4, buffer_size=1_000_000, learning_starts=5000, batch_size=256,
            tau=0.005, gamma=0.99, train_freq=1, gradient_steps=1, ent_coef="auto", target_update_interval=1,
            seed={seed}, device="cpu", policy_kwargs=dict(net_arch=[256, 256]))
""",
}

SB3 = """
import json, time, torch
{threads}
from stable_baselines3.common.env_util import make_vec_env
{model}
t = time.perf_counter()
model.learn({steps})
dt = time.perf_counter() - t
rets = [e["r"] for e in model.ep_info_buffer]
print(json.dumps({{"sps": model.num_timesteps / dt, "ret": sum(rets[-20:]) / max(1, len(rets[-20:]))}}))
"""


def once(code: str, threads: str) -> dict:
    return run_json(code, env={"FRAGFLOW_THREADS": threads} if threads != "default" else None)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algos", nargs="+", default=["a2c", "dqn", "sac"], choices=sorted(STEPS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="throughput_algos", help="results file name (another keeps the full run's)")
    p.add_argument("--threads", default="1",
                   help="torch threads of every process, both sides (FRAGFLOW_THREADS for fragflow), or 'default': "
                        "each as it runs unset (torch's count per core for SB3, the placement's for fragflow)")
    a = p.parse_args(argv)
    if a.threads != "default" and not (a.threads.isdigit() and int(a.threads) >= 1):
        p.error(f"--threads takes a whole number of at least 1 or 'default', not {a.threads!r}")
    threads = "" if a.threads == "default" else f"torch.set_num_threads({int(a.threads)})"
    rows, raw = [], {}
    for algo in a.algos:
        steps = STEPS[algo]
        ours, piped, theirs, ours_e2e, piped_e2e = [], [], [], [], []
        for rep in range(a.reps):
            args = ARGS[algo].format(steps=steps, seed=rep + 1)
            for runs, whole, policy in ((ours, ours_e2e, "single_process"), (piped, piped_e2e, "pipelined")):
                result = once(FRAGFLOW.format(algo=algo, args=args, policy=policy, threads=threads), a.threads)
                runs.append(result["sps"])
                whole.append(result["e2e_sps"])
            theirs.append(once(SB3.format(model=SB3_MODEL[algo].format(seed=rep + 1, steps=steps), steps=steps,
                                          threads=threads), a.threads)["sps"])
            print(f"{algo} rep {rep + 1}/{a.reps}: single_process {ours[-1]:,.0f} steps/s ({ours_e2e[-1]:,.0f} with its "
                  f"trace), pipelined {piped[-1]:,.0f} ({piped_e2e[-1]:,.0f}), sb3 {theirs[-1]:,.0f}", flush=True)
        rows.append(row(f"{algo} steps/s, single_process vs SB3", stats(ours), "sb3", stats(theirs), "steps/s", ">= 1.5"))
        rows.append(row(f"{algo} steps/s, pipelined vs SB3", stats(piped), "sb3", stats(theirs), "steps/s", ">= 2"))
        # the whole call, the trace that compiles the program included (SB3: its learn)
        rows.append(row(f"{algo} steps/s with the trace, single_process vs SB3", stats(ours_e2e), "sb3", stats(theirs),
                        "steps/s", ">= 1.5"))
        rows.append(row(f"{algo} steps/s with the trace, pipelined vs SB3", stats(piped_e2e), "sb3", stats(theirs),
                        "steps/s", ">= 2"))
        # the VM's speed drifts between reps: each rep's own ratio (its runs were back to back) too
        for r, mine in zip(rows[-4:], (ours, piped, ours_e2e, piped_e2e)):
            r["paired_ratios"] = [m / t for m, t in zip(mine, theirs)]
            r["paired_ratio_median"] = statistics.median(r["paired_ratios"])
        raw[algo] = {"steps": steps, "single_process_sps": ours, "pipelined_sps": piped, "sb3_sps": theirs,
                     "single_process_with_trace_sps": ours_e2e, "pipelined_with_trace_sps": piped_e2e}
    save(a.out, {"command": "python benchmarks/throughput_algos.py " + " ".join(argv or sys.argv[1:]),
                              "rows": rows, "runs": raw})
    print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
