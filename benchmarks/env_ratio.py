"""PPO end-to-end env steps/s divided by raw env steps/s, for the same environment configuration.

Raw: gymnasium's synchronous vector env of CartPole-v1 (same-step autoreset, as fragflow uses)
stepped with random actions in a loop, one process. PPO: fragflow's PPO (CleanRL hyper-parameters
except num_envs) under each policy, learning included, over the whole run. Medians of repetitions;
the raw env is timed right before every PPO run, and its median over all of them is the baseline.

    python benchmarks/env_ratio.py [--envs 4 16 64] [--steps 200000] [--reps 3] [--no-invariant]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_rows, row, save, stats  # noqa: E402

POLICIES = ["single_process", "pipelined(actors=1)", "pipelined(actors=2)", "actor_learner(actors=1, max_lag=1)"]
# (policy, invariant_acting): batch-size-invariant acting costs throughput with many envs
CONTENDERS = [(p, False) for p in POLICIES] + [("pipelined(actors=1)", True), ("pipelined(actors=2)", True)]

RAW = """
import json, time, numpy as np, gymnasium as gym
from gymnasium.vector import AutoresetMode
env = gym.make_vec("CartPole-v1", num_envs={n}, vectorization_mode="sync",
                   vector_kwargs={{"autoreset_mode": AutoresetMode.SAME_STEP}})
env.reset(seed=0)
rng = np.random.default_rng(0)
steps = max(2000, {steps} // {n} // 4)
actions = rng.integers(0, 2, size=(steps, {n}))
t = time.perf_counter()
for a in actions:
    env.step(a)
print(json.dumps({{"sps": steps * {n} / (time.perf_counter() - t)}}))
"""

PPO = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(num_envs={n}, total_timesteps={steps}, invariant_acting={invariant}), policy={policy!r})
print(json.dumps({{"sps": r.summary["steps_per_second"]}}))
"""


def once(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["sps"])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-invariant", action="store_true", help="skip the batch-invariant acting variants")
    a = p.parse_args(argv)
    contenders = [(pol, inv) for pol, inv in CONTENDERS if not (inv and a.no_invariant)]
    rows, raw_runs = [], {}
    for n in a.envs:
        raw: list[float] = []
        ours: dict[str, list[float]] = {f"{pol}{', invariant_acting=true' if inv else ''}": [] for pol, inv in contenders}
        for _ in range(a.reps):
            for (pol, inv), name in zip(contenders, ours):
                # the raw env is cheap to time: time it before every PPO run, so it sees the
                # same machine conditions (a shared VM drifts by tens of percent within minutes)
                raw.append(once(RAW.format(n=n, steps=a.steps)))
                ours[name].append(once(PPO.format(n=n, steps=a.steps, policy=pol, invariant=inv)))
        raw_runs[n] = {"raw": raw, **ours}
        for name, values in ours.items():
            rows.append(row(f"PPO {n} envs, {name}: steps/s / raw env", stats(values), "raw env", stats(raw),
                            "steps/s", ">= 0.5"))
        print(f"{n} envs: raw {statistics.median(raw):,.0f} steps/s; " + ", ".join(
            f"{pol} {statistics.median(v):,.0f}" for pol, v in ours.items()), flush=True)
    save("env_ratio_" + "_".join(map(str, a.envs)), {"command": "python benchmarks/env_ratio.py " + " ".join(argv or sys.argv[1:]), "rows": rows,
                       "raw": {str(k): v for k, v in raw_runs.items()}})
    print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
