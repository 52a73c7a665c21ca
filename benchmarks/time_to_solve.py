"""PPO on CartPole-v1: wall time to solved, every fragflow policy vs Stable-Baselines3 (RL-Zoo).

"Solved" is the mean return of the last 20 training episodes reaching 475. Each run stops there.
fragflow's clock starts when the run starts (after the trace; worker start-up included); SB3's when
``learn`` starts (after building the model). Each policy runs the same seeds; the figure per policy
is the median over seeds, and the ratio is SB3's median divided by the policy's.

SB3 uses RL-Zoo's CartPole-v1 hyper-parameters: 8 envs, n_steps 32, batch 256, 20 epochs, gamma
0.98, GAE 0.8, lr 1e-3 and clip 0.2 both annealed, no entropy bonus. fragflow's PPO runs with the
settings in FAST below: RL-Zoo's, with 10 epochs at lr 3e-3 annealed over 80k steps and an unclipped
value loss (the best steps-to-solve of a small grid over envs x steps, epochs and lr, 3 seeds each;
``tune_time_to_solve.py`` re-checks it in wall time under the default policy on seeds 101-103,
disjoint from the seeds reported here).

    python benchmarks/time_to_solve.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import save, stats  # noqa: E402

FAST = dict(num_envs=8, num_steps=32, num_minibatches=1, update_epochs=10, learning_rate=3e-3, gamma=0.98,
            gae_lambda=0.8, ent_coef=0.0, clip_vloss=False, total_timesteps=80_000)
POLICIES = ["single_process", "pipelined(actors=1)", "pipelined(actors=2)", "actor_learner(actors=1, max_lag=1)",
            "actor_learner(actors=2, max_lag=1)", "async_relaxed(actors=1, max_lag=1)",
            "async_relaxed(actors=2, max_lag=2)"]

FRAGFLOW = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(seed={seed}, **{fast}), policy={policy!r}, target_return=475, stop_on_target=True)
print(json.dumps({{"seconds": r.summary["solved_at_seconds"], "steps": r.summary["solved_at_steps"],
                   "sps": r.summary["steps_per_second"]}}))
"""

SB3 = """
import json, time, numpy as np, torch
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env

class Solved(BaseCallback):
    def _on_training_start(self):
        self.t0, self.solved = time.perf_counter(), None
    def _on_step(self):
        rets = [e["r"] for e in self.model.ep_info_buffer]
        if len(rets) >= 20 and np.mean(rets[-20:]) >= 475:
            self.solved = (time.perf_counter() - self.t0, self.num_timesteps)
            return False
        return True

env = make_vec_env("CartPole-v1", n_envs=8, seed={seed})
model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
            learning_rate=lambda f: f * 1e-3, clip_range=lambda f: f * 0.2, seed={seed}, device="cpu", verbose=0)
cb = Solved()
model.learn(150_000, callback=cb)
seconds, steps = cb.solved or (None, None)
print(json.dumps({{"seconds": seconds, "steps": steps, "sps": model.num_timesteps / (time.perf_counter() - cb.t0)}}))
"""


def once(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=POLICIES, help="fragflow policies to time (default: all)")
    a = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"sb3 (RL-Zoo)": []}
    runs.update({pol: [] for pol in a.policies})
    for seed in range(1, a.seeds + 1):          # interleave: each seed runs every contender in turn
        runs["sb3 (RL-Zoo)"].append(once(SB3.format(seed=seed)))
        for pol in a.policies:
            runs[pol].append(once(FRAGFLOW.format(seed=seed, fast=FAST, policy=pol)))
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]['seconds']}" for k, v in runs.items()), flush=True)

    def seconds(name: str) -> list[float]:
        return [r["seconds"] if r["seconds"] is not None else float("inf") for r in runs[name]]

    base = statistics.median(seconds("sb3 (RL-Zoo)"))
    table = []
    print(f"{'contender':<40} {'solved in s (min/med/max)':<28} {'steps (median)':>14} {'SB3 / this':>10}")
    for name in runs:
        s = seconds(name)
        steps = statistics.median([r["steps"] or float("inf") for r in runs[name]])
        ratio = base / statistics.median(s)
        table.append({"contender": name, "seconds": stats(s), "steps_median": steps, "speedup_vs_sb3": ratio,
                      "runs": runs[name]})
        print(f"{name:<40} {min(s):.2f}/{statistics.median(s):.2f}/{max(s):.2f}{'':<12} {steps:>14,.0f} {ratio:>10.2f}")
    result = {"command": "python benchmarks/time_to_solve.py " + " ".join(argv or sys.argv[1:]), "fast_args": FAST,
              "table": table, "target": "default policy >= 3x faster than SB3 (RL-Zoo)"}
    save("time_to_solve" if a.policies == POLICIES else "time_to_solve_" + "_".join(
        p.split("(")[0] for p in a.policies), result)
    return result


if __name__ == "__main__":
    main()
