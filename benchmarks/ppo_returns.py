"""PPO with CleanRL's ppo.py hyper-parameters, 500k steps on CartPole-v1, several seeds.

CleanRL publishes 490.04 +- 6.12 for this configuration (mean +- std over seeds of the final
episodic return). Each seed runs in its own process under single_process; the final return is
the mean return of the last 20 training episodes.

    python benchmarks/ppo_returns.py [--seeds 3] [--steps 500000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from common import save

CLEANRL_MEAN, CLEANRL_STD = 490.04, 6.12

CODE = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import ppo
r = ff.run(ppo.train, ppo.Args(total_timesteps={steps}, seed={seed}), policy="single_process", target_return=475)
last100 = r.episode_returns[-100:]
print(json.dumps(dict(r.summary, final_return_last100=sum(last100) / len(last100))))
"""


def one(seed: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE.format(seed=seed, steps=steps)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=500_000)
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    with ThreadPoolExecutor(a.jobs) as pool:
        summaries = list(pool.map(lambda s: one(s, a.steps), range(1, a.seeds + 1)))
    finals = [s["final_return_mean"] for s in summaries]
    finals100 = [s["final_return_last100"] for s in summaries]
    mean = statistics.mean(finals)
    std = statistics.stdev(finals) if len(finals) > 1 else 0.0
    within = abs(mean - CLEANRL_MEAN) <= CLEANRL_STD
    mean100 = statistics.mean(finals100)
    within100 = abs(mean100 - CLEANRL_MEAN) <= CLEANRL_STD
    for seed, s in enumerate(summaries, 1):
        print(f"seed {seed}: final return {s['final_return_mean']:.2f} (last 100 episodes: {s['final_return_last100']:.2f}), solved (475) at {s['solved_at_steps']} steps "
              f"/ {s['solved_at_seconds']} s, {s['steps_per_second']:,.0f} steps/s")
    at_least = mean >= CLEANRL_MEAN - CLEANRL_STD
    print(f"final return (last 20 episodes) over {a.seeds} seeds: {mean:.2f} +- {std:.2f}; last 100 episodes: "
          f"{mean100:.2f}; CleanRL: {CLEANRL_MEAN} +- {CLEANRL_STD}. Last-20 mean {'within' if within else 'outside'} "
          f"the band, last-100 mean {'within' if within100 else 'outside'} it; "
          f"{'' if at_least else 'not '}at least its lower edge")
    result = {"command": "python benchmarks/ppo_returns.py " + " ".join(argv or sys.argv[1:]),
              "steps": a.steps, "final_returns": finals, "mean": mean, "std": std,
              "final_returns_last100": finals100, "cleanrl": {"mean": CLEANRL_MEAN, "std": CLEANRL_STD},
              "within_cleanrl_band": within, "within_cleanrl_band_last100": within100, "at_least_cleanrl_lower_edge": at_least,
              "per_seed": summaries}
    save("ppo_returns", result)
    return result


if __name__ == "__main__":
    main()
