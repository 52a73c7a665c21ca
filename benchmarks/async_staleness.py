"""async_relaxed in steady state: drops, learner waiting, lag histogram.

PPO on CartPole-v1 (CleanRL hyper-parameters, 8 environments) under async_relaxed with several
actor counts and staleness bounds. Reported per configuration: samples dropped as a share of all
samples produced, the share of the learner's time spent waiting for data, and the histogram of
the lag (learner version minus sample version) of every consumed sample.

    python benchmarks/async_staleness.py [--steps 200000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import save  # noqa: E402

# (policy, PPO update_epochs): 4 epochs (CleanRL) leaves the learner faster than the actors on 2
# cores, so it must wait however the channel is run; 12 epochs makes it the bottleneck, the regime
# the balance controller is for (producers throttled, learner always fed).
CONFIGS = [(p, e) for e in (4, 12) for p in ("async_relaxed(actors=1, max_lag=1)", "async_relaxed(actors=1, max_lag=2)",
                                            "async_relaxed(actors=2, max_lag=2)", "async_relaxed(actors=2, max_lag=4)")]

CODE = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(num_envs=8, total_timesteps={steps}, update_epochs={epochs}), policy={policy!r})
print(json.dumps(dict(r.summary["channels"]["trajectory"], sps=r.summary["steps_per_second"],
                      final_return=r.summary["final_return_mean"])))
"""


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200_000)
    a = p.parse_args(argv)
    results = []
    print(f"{'policy':<38} {'epochs':>6} {'drops':>8} {'learner waits':>14} {'steps/s':>8}  lag histogram (0, 1, 2, ...)")
    for pol, epochs in CONFIGS:
        out = subprocess.run([sys.executable, "-c", CODE.format(steps=a.steps, policy=pol, epochs=epochs)], check=True,
                             capture_output=True, text=True).stdout
        s = json.loads(out.strip().splitlines()[-1])
        produced = s["items"]
        s["drop_share"] = s["drops"] / produced if produced else 0.0
        s["learner_wait_share"] = s["learner_wait_s"] / max(1e-9, s["learner_wait_s"] + s["learner_busy_s"])
        s["policy"], s["update_epochs"] = pol, epochs
        results.append(s)
        hist = s["lag_histogram"]
        last = max((i for i, v in enumerate(hist) if v), default=0)
        print(f"{pol:<38} {epochs:>6} {s['drop_share']:>7.2%} {s['learner_wait_share']:>13.1%} {s['sps']:>8,.0f}  {hist[:last + 1]}",
              flush=True)
    save("async_staleness", {"command": "python benchmarks/async_staleness.py " + " ".join(argv or sys.argv[1:]),
                             "results": results, "target": "drops <= 1% of samples, learner never waiting"})
    return results


if __name__ == "__main__":
    main()
