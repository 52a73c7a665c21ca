"""DQN with CleanRL's dqn.py hyper-parameters, 500k steps on CartPole-v1, several seeds, under
single_process (the replay buffer in the loop) and learner_replay (the buffer with the learner,
actors sending transitions: the Ape-X shape).

CleanRL publishes 488.7 +- 16.1 for this configuration; the target here is a mean of at least 450
over 3 seeds under both placements. Each run is its own process; the final return is the mean
return of the last 20 training episodes.

    python benchmarks/dqn_returns.py [--seeds 3] [--steps 500000] [--policies single_process learner_replay] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from common import save

CLEANRL_MEAN, CLEANRL_STD = 488.7, 16.1
TARGET = 450.0

CODE = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import dqn
r = ff.run(dqn.train, dqn.Args(total_timesteps={steps}, seed={seed}, prioritized={per}), policy={policy!r},
           target_return=475)
last100 = r.episode_returns[-100:]
print(json.dumps(dict(r.summary, final_return_last100=sum(last100) / len(last100))))
"""


def one(policy: str, seed: int, steps: int, per: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE.format(seed=seed, steps=steps, policy=policy, per=per)],
                         check=True, capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    print(f"{policy} seed {seed}: final return {summary['final_return_mean']:.2f} (last 100: "
          f"{summary['final_return_last100']:.2f}), {summary['steps_per_second']:,.0f} steps/s", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=500_000)
    p.add_argument("--policies", nargs="+", default=["single_process", "learner_replay"])
    p.add_argument("--prioritized", action="store_true", help="prioritized replay (--set prioritized=true)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default=None, help="results file name (default dqn_returns[_prioritized])")
    a = p.parse_args(argv)
    runs = [(policy, seed) for policy in a.policies for seed in range(1, a.seeds + 1)]
    with ThreadPoolExecutor(a.jobs) as pool:
        summaries = list(pool.map(lambda ps: one(ps[0], ps[1], a.steps, a.prioritized), runs))
    result: dict = {"command": "python benchmarks/dqn_returns.py " + " ".join(argv or sys.argv[1:]),
                    "steps": a.steps, "prioritized": a.prioritized, "target": TARGET,
                    "cleanrl": {"mean": CLEANRL_MEAN, "std": CLEANRL_STD}, "policies": {}}
    for policy in a.policies:
        mine = [s for (pol, _), s in zip(runs, summaries) if pol == policy]
        finals = [s["final_return_mean"] for s in mine]
        mean = statistics.mean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"{policy}: final return over {len(finals)} seeds {mean:.2f} +- {std:.2f} "
              f"({'meets' if mean >= TARGET else 'below'} the {TARGET:.0f} target; CleanRL {CLEANRL_MEAN} +- {CLEANRL_STD})")
        result["policies"][policy] = {"final_returns": finals, "mean": mean, "std": std, "meets_target": mean >= TARGET,
                                      "per_seed": mine}
    save(a.out or "dqn_returns" + ("_prioritized" if a.prioritized else ""), result)
    return result


if __name__ == "__main__":
    main()
