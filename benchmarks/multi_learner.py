"""multi_learner: learner samples per second with K = 1 and 2 learners.

PPO on CartPole-v1 with a learner-heavy update (hidden=256, 10 epochs, 16 envs x 128 steps per
update) under ``multi_learner(learners=K, actors=1)``: K learners, each with one actor and half
(K=2) or all (K=1) of the environments, averaging gradients every minibatch. Every sample is
learned from exactly once, so learner samples/s is env steps over the run's wall time (after the
trace); the busy share says how much of the wall time learner 0 spent in its update. Fresh process
per run, runs alternate; the median over repetitions, K=2 / K=1.

    python benchmarks/multi_learner.py [--steps 65536] [--reps 3] [--learners 1 2] [--gloo] [--out multi_learner]

On a machine with more cores, ``--learners 1 2 4 8`` measures how far the learners scale (each
learner and its actor is a process: K=8 uses 16). ``--gloo`` also runs every K > 1 with gloo's
all-reduce in place of the shared-memory sum (the runs alternate). Besides the wall-clock rate, each
row has learner 0's samples per second of update time, and each run prints each learner's update
time in parts.
"""

from __future__ import annotations

import argparse
import os
import sys

from common import print_rows, row, run_json, save, stats

CODE = """
import json, torch
import fragflow as ff
from fragflow.algorithms import ppo
args = ppo.Args(total_timesteps={steps}, num_envs=16, num_steps=128, hidden={hidden}, update_epochs=10, seed=1)
r = ff.run(ppo.train, args, policy="multi_learner(learners={k}, actors=1)")
ch = r.summary["channels"]["trajectory"]
print(json.dumps({{"sps": r.summary["steps_per_second"], "wall": r.summary["wall_seconds"],
                  "busy": ch["learner_busy_s"], "updates": r.summary["updates"], "learners": ch.get("learners", [])}}))
"""


def _breakdown(r: dict) -> str:
    """Each learner's update time in parts (per update, ms): outside the user's call, its arithmetic,
    its all-reduces (transfer and the wait for the slowest learner)."""
    parts = []
    for t in r.get("learners", []):
        n = max(t["updates"], 1)
        parts.append(f"L{t['learner']}: {1e3 * (t['busy_s'] - t['call_s']) / n:.0f}+{1e3 * (t['call_s'] - t['sync_s']) / n:.0f}"
                     f"+{1e3 * t['sync_s'] / n:.0f} ms ({t['all_reduces'] / n:.0f} all-reduces, {t['threads']} thr)")
    return ("\n    per update (outside the call + arithmetic + all-reduce): " + "; ".join(parts)) if parts else ""


def _update_rate(r: dict) -> float:
    """Learner 0's samples per second of its update time (2,048 samples an update): the learner's
    own speed, without the run's start and the actors' first rollout in the wall time."""
    return 2048 * r["updates"] / max(r["busy"], 1e-9)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=65_536)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    p.add_argument("--hidden", type=int, default=256, help="width of the networks (a heavier update per sample)")
    p.add_argument("--gloo", action="store_true",
                   help="also run K > 1 with the learners' gradients all-reduced by gloo (FRAGFLOW_ALLREDUCE=gloo) "
                        "rather than summed in shared memory")
    p.add_argument("--out", default="multi_learner", help="results file name (another keeps the recorded run's)")
    a = p.parse_args(argv)
    variants = [(k, via) for k in a.learners for via in (("shm", "gloo") if a.gloo and k > 1 else ("shm",))]
    runs: dict[str, list[dict]] = {f"{k}/{via}": [] for k, via in variants}
    for _ in range(a.reps):
        for k, via in variants:
            env = {"FRAGFLOW_THREADS": "1", "FRAGFLOW_ALLREDUCE": "gloo" if via == "gloo" else ""}
            r = run_json(CODE.format(steps=a.steps, k=k, hidden=a.hidden), env)
            runs[f"{k}/{via}"].append(r)
            name = f"K={k}" + (f" ({via})" if k > 1 else "")
            print(f"{name}: {r['sps']:,.0f} samples/s, learner 0 busy {r['busy'] / r['wall']:.0%} of {r['wall']:.1f}s, "
                  f"{_update_rate(r):,.0f} samples/s of update time" + _breakdown(r), flush=True)
    base = min(a.learners)
    key0 = f"{base}/shm"
    rows = []
    for k, via in variants:
        if k == base:
            continue
        key = f"{k}/{via}"
        what = f"multi_learner K={k}" + (" (gloo)" if via == "gloo" else "") + f" / K={base}"
        rows.append(row(f"PPO hidden={a.hidden}, 10 epochs, 2048 samples/update: learner samples/s (wall), {what}",
                        stats([r["sps"] for r in runs[key]]), f"K={base}", stats([r["sps"] for r in runs[key0]]),
                        "samples/s", "-"))
        rows.append(row(f"the same, samples/s of learner 0's update time, {what}",
                        stats([_update_rate(r) for r in runs[key]]), f"K={base}",
                        stats([_update_rate(r) for r in runs[key0]]), "samples/s", "-"))
    print_rows(rows)
    result = {"command": "python benchmarks/multi_learner.py " + " ".join(argv or sys.argv[1:]), "steps": a.steps,
              "reps": a.reps, "hidden": a.hidden, "rows": rows, "runs": runs, "cpus": os.cpu_count(),
              "device": "cpu"}
    save(a.out, result)
    return result


if __name__ == "__main__":
    main()
