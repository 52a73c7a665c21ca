"""What Ray costs: the same PPO run under the same policy on the local backend and on Ray.

PPO on CartPole-v1 under ``actor_learner(actors=2)`` (the acting side crosses processes once per
update) and ``central_inference(env_workers=2)`` (once per env step), each on the local backend
(processes, shared memory) and on Ray (one local Ray instance on this machine, started once
before the timed runs; every run's actors are created inside its timing). Each run is a fresh
process for the local backend; the Ray runs share the interpreter that holds the Ray instance.
The figure is env steps/s over the run (after the trace); the median over repetitions, Ray / local.

    python benchmarks/ray_backend.py [--steps 100000] [--reps 3] [--policies actor_learner central_inference]
"""

from __future__ import annotations

import argparse
import os
import sys

from common import print_rows, row, run_json, save, stats

LOCAL = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(total_timesteps={steps}, num_envs={envs}, seed=1), policy={policy!r})
print(json.dumps({{"sps": r.summary["steps_per_second"], "wall": r.summary["wall_seconds"]}}))
"""

RAY = """
import json, os, torch
torch.set_num_threads(1)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray
ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
import fragflow as ff
from fragflow.algorithms import ppo
out = []
for _ in range({reps}):
    r = ff.run(ppo.train, ppo.Args(total_timesteps={steps}, num_envs={envs}, seed=1), policy={policy!r}, backend="ray")
    out.append(r.summary["steps_per_second"])
print(json.dumps({{"sps": out}}))
"""

POLICIES = {"actor_learner(actors=2)": 8, "central_inference(env_workers=2)": 8}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["actor_learner", "central_inference"])
    p.add_argument("--name", default="ray_backend", help="results file name")
    a = p.parse_args(argv)
    env = {"FRAGFLOW_THREADS": "1"}
    rows, raw = [], {}
    for policy, envs in POLICIES.items():
        if policy.split("(")[0] not in a.policies:
            continue
        local = [run_json(LOCAL.format(steps=a.steps, envs=envs, policy=policy), env)["sps"] for _ in range(a.reps)]
        print(f"{policy} local: {', '.join(f'{x:,.0f}' for x in local)} steps/s", flush=True)
        on_ray = run_json(RAY.format(steps=a.steps, envs=envs, policy=policy, reps=a.reps), env)["sps"]
        print(f"{policy} ray:   {', '.join(f'{x:,.0f}' for x in on_ray)} steps/s", flush=True)
        rows.append(row(f"PPO CartPole {envs} envs, {policy}: Ray backend / local backend", stats(on_ray), "local",
                        stats(local), "env steps/s", "-"))
        raw[policy] = {"local": local, "ray": on_ray}
    print_rows(rows)
    result = {"command": "python benchmarks/ray_backend.py " + " ".join(argv or sys.argv[1:]), "steps": a.steps,
              "reps": a.reps, "rows": rows, "runs": raw, "cpus": os.cpu_count()}
    save(a.name, result)
    return result


if __name__ == "__main__":
    main()
