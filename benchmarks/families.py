"""PPO on the heavy env families: MuJoCo (continuous control) and Atari (a CNN), at short budgets.

``speed``: env steps/s of fragflow's PPO under ``single_process`` and the default policy
(``pipelined``) against Stable-Baselines3's PPO with the same hyper-parameters on the same env, one
torch thread each; and under ``actor_learner(actors=2)`` (the environments stepped in two worker
processes) against ``single_process`` with the same settings (MuJoCo: 2 envs x 1024 steps, since
one env cannot be split). Runs alternate in fresh processes (median of ``--reps``); steps/s is over
training only.

============  =================================================================================
mujoco        HalfCheetah-v5, CleanRL ``ppo_continuous_action.py``: 1 env x 2048 steps, 10 epochs of
              32 minibatches, lr 3e-4 annealed, ent 0, observation and reward normalisation
atari         Breakout-v5 (84x84 grayscale, 4 frames, skip 4), CleanRL ``ppo_atari.py``: 8 envs x 128
              steps, 4 epochs of 4 minibatches, lr 2.5e-4 annealed, clip 0.1, the Nature CNN
============  =================================================================================

``learn``: one run at a short budget under the default policy, the return every 10% of it
(learning visibly under way: CleanRL's HalfCheetah curve is near 900 at 200k steps; its Breakout
curve near 10 at 1M).

``random``: the game score (raw episode return) of uniform-random actions on the environments a
run with each seed steps, ``--episodes`` per seed: the floor ``learn`` is read against.

    python benchmarks/families.py speed mujoco [--steps 20000] [--reps 2]
    python benchmarks/families.py learn mujoco [--steps 200000] [--seeds 3]
    python benchmarks/families.py random atari [--seeds 3] [--episodes 100]
    python benchmarks/families.py speed atari --device cuda        # both sides' networks on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import print_rows, row, run_json, save, stats

ARGS = {
    "mujoco": ("ppo", "ppo.Args(env_id='HalfCheetah-v5', num_envs=1, num_steps=2048, learning_rate=3e-4, "
                      "num_minibatches=32, update_epochs=10, ent_coef=0.0, total_timesteps={steps}, seed={seed})"),
    "atari": ("ppo_atari", "ppo_atari.Args(env_id='ALE/Breakout-v5', total_timesteps={steps}, seed={seed}, "
                           "device={device!r})"),
}
# env workers need environments to split: MuJoCo's one env becomes 2 x 1024 steps (the same batch)
WORKER_ARGS = {"mujoco": ARGS["mujoco"][1].replace("num_envs=1, num_steps=2048", "num_envs=2, num_steps=1024"),
               "atari": ARGS["atari"][1]}

FRAGFLOW = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import {module}
r = ff.run({module}.train, {args}, policy={policy!r})
rets = r.episode_returns
print(json.dumps({{"sps": r.summary["steps_per_second"], "wall": r.summary["wall_seconds"], "returns": rets,
                  "episodes": r.summary["episodes"]}}))
"""

SB3 = {
    "mujoco": """
import json, time, torch
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize
env = VecNormalize(make_vec_env("HalfCheetah-v5", n_envs=1, seed={seed}), gamma=0.99)
model = PPO("MlpPolicy", env, n_steps=2048, batch_size=64, n_epochs=10, learning_rate=lambda f: 3e-4 * f,
            gamma=0.99, gae_lambda=0.95, clip_range=0.2, clip_range_vf=0.2, ent_coef=0.0, vf_coef=0.5,
            max_grad_norm=0.5, seed={seed}, device="cpu", verbose=0,
            policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh,
                               log_std_init=0.0, optimizer_kwargs=dict(eps=1e-5)))
t = time.perf_counter()
model.learn({steps})
print(json.dumps({{"sps": model.num_timesteps / (time.perf_counter() - t)}}))
""",
    "atari": """
import json, time, torch
torch.set_num_threads(1)
import ale_py, gymnasium as gym
gym.register_envs(ale_py)
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage
env = VecTransposeImage(VecFrameStack(make_atari_env("ALE/Breakout-v5", n_envs=8, seed={seed},
                                                     env_kwargs=dict(frameskip=1)), n_stack=4))
model = PPO("CnnPolicy", env, n_steps=128, batch_size=256, n_epochs=4, learning_rate=lambda f: 2.5e-4 * f,
            gamma=0.99, gae_lambda=0.95, clip_range=0.1, clip_range_vf=0.1, ent_coef=0.01, vf_coef=0.5,
            max_grad_norm=0.5, seed={seed}, device={device!r}, verbose=0, policy_kwargs=dict(optimizer_kwargs=dict(eps=1e-5)))
t = time.perf_counter()
model.learn({steps})
print(json.dumps({{"sps": model.num_timesteps / (time.perf_counter() - t)}}))
""",
}

DEFAULT_STEPS = {"speed": {"mujoco": 20_000, "atari": 8_192}, "learn": {"mujoco": 200_000, "atari": 300_000}}


def fragflow_run(family: str, steps: int, seed: int, policy: str, workers: bool = False, device: str = "cpu") -> dict:
    module, args = ARGS[family]
    args = WORKER_ARGS[family] if workers else args
    return run_json(FRAGFLOW.format(module=module, args=args.format(steps=steps, seed=seed, device=device), policy=policy),
                    env={"FRAGFLOW_THREADS": "1"})   # one torch thread per process, as SB3 gets


def speed(family: str, steps: int, reps: int, device: str = "cpu") -> dict:
    """Steps/s vs SB3 (same settings), and with env worker processes vs without (same settings)."""
    sps: dict[str, list[float]] = {p: [] for p in ("single_process", "pipelined", "sb3", "workers: single_process",
                                                   "workers: actor_learner(actors=2)")}
    for rep in range(reps):
        for policy in ("single_process", "pipelined"):
            sps[policy].append(fragflow_run(family, steps, rep + 1, policy, device=device)["sps"])
        sps["sb3"].append(run_json(SB3[family].format(steps=steps, seed=rep + 1, device=device))["sps"])
        for policy in ("single_process", "actor_learner(actors=2)"):
            same = family != "mujoco" and policy == "single_process"   # the settings are the same: reuse
            sps[f"workers: {policy}"].append(sps["single_process"][-1] if same else
                                             fragflow_run(family, steps, rep + 1, policy, workers=True,
                                                          device=device)["sps"])
        print(f"rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in sps.items()) + " steps/s", flush=True)
    rows = [row(f"PPO {family} steps/s, {policy} vs SB3", stats(sps[policy]), "sb3", stats(sps["sb3"]), "steps/s",
                ">= 1.5" if policy == "single_process" else ">= 2")
            for policy in ("single_process", "pipelined")]
    rows.append(row(f"PPO {family} steps/s, envs in 2 worker processes (actor_learner(actors=2)) vs in one process "
                    f"(single_process), {WORKER_ARGS[family].split('(', 1)[1].split(', total')[0]}",
                    stats(sps["workers: actor_learner(actors=2)"]), "single_process", stats(sps["workers: single_process"]),
                    "steps/s", "-"))
    print_rows(rows)
    return {"steps": steps, "reps": reps, "device": device, "rows": rows, "sps": sps}


def learn(family: str, steps: int, seeds: int = 1) -> dict:
    runs = []
    for seed in range(1, seeds + 1):
        r = fragflow_run(family, steps, seed, "pipelined")
        rets, n = r["returns"], max(len(r["returns"]), 1)
        tenth = [statistics.mean(rets[max(0, int(n * k / 10) - 20):max(1, int(n * k / 10))]) if rets else float("nan")
                 for k in range(1, 11)]
        print(f"{family} seed {seed}: {steps:,} steps in {r['wall']:.0f} s ({r['sps']:,.0f} steps/s), "
              f"{r['episodes']:.0f} episodes; mean of the 20 episodes before each tenth of the episodes: "
              + ", ".join(f"{x:.1f}" for x in tenth), flush=True)
        runs.append({"seed": seed, "sps": r["sps"], "wall_seconds": r["wall"], "episodes": r["episodes"],
                     "return_by_tenth": tenth, "final_return": tenth[-1], "returns": rets})
    finals = [run["final_return"] for run in runs]
    out = {"steps": steps, "policy": "pipelined", "seeds": seeds, "final_returns": finals,
           "final_mean": statistics.mean(finals), "final_std": statistics.stdev(finals) if seeds > 1 else 0.0,
           "first_tenth": [run["return_by_tenth"][0] for run in runs], "runs": runs}
    print(f"{family}: final return over {seeds} seed(s) {out['final_mean']:.1f} +- {out['final_std']:.1f} "
          f"(first tenth {', '.join(f'{x:.1f}' for x in out['first_tenth'])})")
    return out


def random_score(family: str, seeds: int, episodes: int) -> dict:
    import numpy as np

    import fragflow as ff

    per_seed = []
    for seed in range(1, seeds + 1):
        if family == "atari":
            env = ff.envs.atari("ALE/Breakout-v5", num_envs=8, seed=seed)
        else:
            env = ff.envs.make("HalfCheetah-v5", num_envs=1, seed=seed)
        space = env.single_action_space
        space.seed(seed)
        env.reset()
        returns: list[float] = []
        while len(returns) < episodes:
            env.step(np.stack([space.sample() for _ in range(env.num_envs)]))
            returns.extend(ret for ret, _ in env.pop_finished())
        env.close()
        per_seed.append(statistics.mean(returns[:episodes]))
        print(f"{family} seed {seed}: uniform-random actions score {per_seed[-1]:.2f} over {episodes} episodes", flush=True)
    return {"seeds": seeds, "episodes": episodes, "per_seed": per_seed, "mean": statistics.mean(per_seed),
            "std": statistics.stdev(per_seed) if seeds > 1 else 0.0}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("speed", "learn", "random"))
    p.add_argument("family", choices=tuple(ARGS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seeds", type=int, default=1, help="learn, random: seeds 1..N, one after another")
    p.add_argument("--episodes", type=int, default=100, help="random: episodes per seed")
    p.add_argument("--device", default="cpu", help="speed, atari: the torch device of both sides' networks (cuda: a GPU)")
    p.add_argument("--out", default=None, help="results file name (default FAMILY_MODE; another keeps that one)")
    a = p.parse_args(argv)
    if a.mode == "random":
        result = random_score(a.family, a.seeds, a.episodes)
    else:
        steps = a.steps or DEFAULT_STEPS[a.mode][a.family]
        if a.device != "cpu" and (a.family != "atari" or a.mode != "speed"):
            p.error("--device applies to speed atari (the MuJoCo PPO's network is small: it runs on the CPU)")
        result = speed(a.family, steps, a.reps, a.device) if a.mode == "speed" else learn(a.family, steps, a.seeds)
    result["command"] = "python benchmarks/families.py " + " ".join(argv if argv is not None else sys.argv[1:])
    save(a.out or f"{a.family}_{a.mode}", result)
    return result


if __name__ == "__main__":
    main()
