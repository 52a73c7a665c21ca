"""central_inference vs actor_learner: PPO on CartPole-v1 with 64 environments, a narrow and a wide network.

Both policies run two acting processes over 32 environments each and one learner. Under
actor_learner each actor runs inference for its own environments with parameters broadcast one
version behind; under central_inference the env workers send every inference request to the
learner's process, which acts once on all 64 environments with the newest parameters (with
max_lag=1 and a 2 ms bounded wait, on what arrived in that time). Runs
alternate, each in a fresh process; the figure is env steps/s over training (after the trace), the
median over repetitions, and the ratio central_inference / actor_learner in the same run.

    python benchmarks/central_inference.py [--steps 200000] [--reps 3] [--hidden 64 512]
    python benchmarks/central_inference.py --unequal --steps 20000 --reps 2   # workers slow at random
"""

from __future__ import annotations

import argparse
import sys

from common import print_rows, row, run_json, save, stats

CODE = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
args = ppo.Args(total_timesteps={steps}, num_envs=64, num_steps=128, hidden={hidden}, seed=1)
r = ff.run(ppo.train, args, policy={policy!r})
print(json.dumps({{"sps": r.summary["steps_per_second"], "busy": r.summary["channels"]["trajectory"]["learner_busy_s"],
                  "wall": r.summary["wall_seconds"]}}))
"""

POLICIES = {"actor_learner": "actor_learner(actors=2, max_lag=1)", "central_inference": "central_inference(env_workers=2)",
            "central_inference_wait": "central_inference(env_workers=2, max_lag=1, wait_ms=2)"}


def one(policy: str, steps: int, hidden: int) -> dict:
    return run_json(CODE.format(steps=steps, hidden=hidden, policy=policy))


# Unequal workers: each worker's step is 8 ms slower half the time, at random (its first env
# sleeps; a busy machine, a level that loads). Both workers run the same loop, so a worker that is
# always slower sets the wall time whatever the policy; what max_lag=0 costs is the lockstep: every
# step waits for the slower of the two, while the bounded wait lets each go at its own average.
UNEQUAL = """
import json, time, torch
torch.set_num_threads(1)
import numpy as np
import gymnasium as gym
import fragflow as ff
from fragflow.algorithms import ppo

class JitteryCartPole(gym.Wrapper):
    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))
        self.rng = None
    def reset(self, *, seed=None, options=None):
        if self.rng is None and seed is not None and (seed - 1) % ({envs} // 2) == 0:   # seeded 1 + i
            self.rng = np.random.default_rng(seed)                                      # a worker's first env
        return self.env.reset(seed=seed, options=options)
    def step(self, action):
        if self.rng is not None and self.rng.random() < 0.5:
            time.sleep(0.008)
        return self.env.step(action)

gym.register("JitteryCartPole-v1", entry_point=JitteryCartPole)
args = ppo.Args(env_id="JitteryCartPole-v1", total_timesteps={steps}, num_envs={envs}, num_steps=32, seed=1)
r = ff.run(ppo.train, args, policy={policy!r})
print(json.dumps({{"sps": r.summary["steps_per_second"], "wall": r.summary["wall_seconds"],
                  "lags": r.summary["channels"]["trajectory"]["lag_histogram"]}}))
"""


def unequal(steps: int, reps: int) -> dict:
    policies = {"exact": "central_inference(env_workers=2)",
                "bounded": "central_inference(env_workers=2, max_lag=1, wait_ms=2)",
                "bounded_nowait": "central_inference(env_workers=2, max_lag=1, wait_ms=0)"}
    sps: dict[str, list[float]] = {k: [] for k in policies}
    for _ in range(reps):
        for name, policy in policies.items():
            sps[name].append(run_json(UNEQUAL.format(steps=steps, envs=8, policy=policy))["sps"])
        print(", ".join(f"{k} {v[-1]:,.0f}" for k, v in sps.items()) + " steps/s", flush=True)
    return {"rows": [row("PPO, 8 envs, each worker's step 8 ms slower half the time at random: central_inference "
                         "bounded wait (max_lag=1, wait_ms=2) / exact (max_lag=0)", stats(sps["bounded"]), "max_lag=0",
                         stats(sps["exact"]), "env steps/s", "-"),
                     row("the same with wait_ms=0 (answer what has arrived) / exact (max_lag=0)",
                         stats(sps["bounded_nowait"]), "max_lag=0", stats(sps["exact"]), "env steps/s", "-")],
            "sps": sps}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 512])
    p.add_argument("--unequal", action="store_true", help="the bounded wait against max_lag=0 with unequal workers")
    a = p.parse_args(argv)
    if a.unequal:
        out = unequal(a.steps, a.reps)
        print_rows(out["rows"])
        out["command"] = "python benchmarks/central_inference.py " + " ".join(argv or sys.argv[1:])
        save("central_inference_unequal", out)
        return out
    rows, raw = [], {}
    for hidden in a.hidden:
        runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
        for _ in range(a.reps):
            for name, policy in POLICIES.items():
                runs[name].append(one(policy, a.steps, hidden))
                print(f"hidden={hidden} {name}: {runs[name][-1]['sps']:,.0f} steps/s", flush=True)
        sps = {name: stats([r["sps"] for r in rs]) for name, rs in runs.items()}
        rows.append(row(f"PPO 64 envs hidden={hidden}: central_inference(2) / actor_learner(2)",
                        sps["central_inference"], "actor_learner", sps["actor_learner"], "env steps/s", "-"))
        rows.append(row(f"PPO 64 envs hidden={hidden}: central_inference(2, max_lag=1, wait_ms=2) / actor_learner(2)",
                        sps["central_inference_wait"], "actor_learner", sps["actor_learner"], "env steps/s", "-"))
        raw[str(hidden)] = runs
    print_rows(rows)
    result = {"command": "python benchmarks/central_inference.py " + " ".join(argv or sys.argv[1:]),
              "steps": a.steps, "reps": a.reps, "rows": rows, "runs": raw}
    save("central_inference", result)
    return result


if __name__ == "__main__":
    main()
