"""Where a ``single_process`` step goes: the algorithm's own work against fragflow's, and the ratio to
Stable-Baselines3 that a runtime costing nothing would reach.

The algorithm's own work is the time inside its fragments (acting, learning, target updates),
the environments' steps and the buffers' adds and samples: what any implementation of it runs,
SB3's included. The rest of the step is fragflow's (dispatch, versioned state, checks, logging)
and the loop's own Python. Dividing the env steps of training by the work alone gives the steps/s
of a runtime that costs nothing, and so the highest ratio to SB3 any runtime could reach with these
networks, hyper-parameters and one torch thread; the measured ratio is set beside it. Under
``single_process`` the trace is the run's beginning (DQN's and SAC's warm-ups run traced), so its
calls are timed too, and its recording is fragflow's share. Same configurations as ``throughput_algos.py`` (A2C, DQN, SAC)
and ``families.py speed`` (PPO on HalfCheetah and on Breakout); fragflow and SB3 alternate, each run
in a fresh process with one torch thread, medians of ``--reps``.

    python benchmarks/work_share.py [--algos a2c dqn sac ppo_mujoco ppo_atari] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import families
import throughput_algos as algos
from common import run_json, save


def _sb3_algo(name: str) -> Callable[[int, int], str]:
    return lambda seed, steps: algos.SB3.format(model=algos.SB3_MODEL[name].format(seed=seed, steps=steps), steps=steps)


def _sb3_family(name: str) -> Callable[[int, int], str]:
    return lambda seed, steps: families.SB3[name].format(seed=seed, steps=steps, device="cpu")


# name: (algorithm module, its Args, env steps per run, SB3's program for the same run (seed, steps))
CASES: dict[str, tuple[str, str, int, Callable[[int, int], str]]] = {
    **{name: (name, algos.ARGS[name], steps, _sb3_algo(name)) for name, steps in algos.STEPS.items()},
    "ppo_mujoco": (*families.ARGS["mujoco"], families.DEFAULT_STEPS["speed"]["mujoco"], _sb3_family("mujoco")),
    "ppo_atari": (*families.ARGS["atari"], families.DEFAULT_STEPS["speed"]["atari"], _sb3_family("atari")),
}

TIMED = """
import json, time, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.api import buffer, envs, replay
from fragflow.api.fragment import Fragment
from fragflow.algorithms import {module}
algo = {module}

spent = {{"work": 0.0, "steps": 0}}

def timed(fn, env=False):
    def run(*args, **kwargs):   # (the trace counts too: under single_process it is the run's beginning)
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        spent["work"] += time.perf_counter() - t
        if env:
            spent["steps"] += len(out[1])
        return out
    return run

for value in vars(algo).values():
    if isinstance(value, Fragment):
        value.fn = timed(value.fn)
envs.VectorEnv._step = timed(envs.VectorEnv._step, env=True)
for cls in (replay.ReplayBuffer, buffer.RolloutBuffer):
    for name in ("_add", "_sample", "_collect"):
        if hasattr(cls, name):
            setattr(cls, name, timed(getattr(cls, name)))
r = ff.run(algo.train, {args}, policy="single_process")
assert spent["steps"] == r.summary["env_steps"], (spent["steps"], r.summary["env_steps"])
train_wall = r.summary["env_steps"] / r.summary["steps_per_second"]
print(json.dumps(dict(sps=r.summary["steps_per_second"], work_sps=spent["steps"] / spent["work"],
                      work_share=spent["work"] / train_wall)))
"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algos", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    out: dict = {"command": "python benchmarks/work_share.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "algorithms": {}}
    for algo in a.algos:
        module, args, steps, sb3_code = CASES[algo]
        ours, theirs = [], []
        for rep in range(a.reps):
            ours.append(run_json(TIMED.format(module=module, args=args.format(steps=steps, seed=rep + 1, device="cpu")),
                                 env={"FRAGFLOW_THREADS": "1"}))
            theirs.append(run_json(sb3_code(rep + 1, steps))["sps"])
        sps = statistics.median(r["sps"] for r in ours)
        work_sps = statistics.median(r["work_sps"] for r in ours)
        share = statistics.median(r["work_share"] for r in ours)
        sb3 = statistics.median(theirs)
        out["algorithms"][algo] = {"steps": steps, "single_process_sps": sps, "work_only_sps": work_sps,
                                   "work_share": share, "sb3_sps": sb3, "ratio": sps / sb3,
                                   "ratio_at_zero_runtime_cost": work_sps / sb3, "runs": ours, "sb3_runs": theirs}
        print(f"{algo}: the algorithm's own work is {100 * share:.0f}% of a single_process step; "
              f"{sps:,.0f} steps/s (work alone {work_sps:,.0f}) vs SB3 {sb3:,.0f}: ratio {sps / sb3:.2f}, "
              f"at most {work_sps / sb3:.2f} with a runtime costing nothing", flush=True)
    save("work_share", out)
    return out


if __name__ == "__main__":
    main()
