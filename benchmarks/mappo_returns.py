"""Multi-agent PPO on MPE simple_spread_v3 (3 agents, 25-step episodes): MAPPO (centralised critic)
against IPPO (independent critics) and a uniform-random policy, at one budget, several seeds.

There is no published figure at this budget: the band is measured here. The return is an agent's
episode return (simple_spread gives every agent the shared coverage reward plus its own collision
penalty); the final return is the mean over the last 300 agent-episodes of a run (100 episodes of
each of 3 agents). The random policy is scored on the same environments and seeds in this run.
Each learning run is its own process under ``single_process``, one at a time, MAPPO and IPPO
alternating; the learning curves (the mean return of each 20k-step window) are plotted to
``benchmarks/results/mappo_curve.png``.

    python benchmarks/mappo_returns.py [--seeds 3] [--steps 300000]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from common import RESULTS, run_json, save

CODE = """
import csv, json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import mappo
r = ff.run(mappo.train, mappo.Args(total_timesteps={steps}, seed={seed}, critic={critic!r}, value_norm={value_norm}),
           policy="single_process")
last = r.episode_returns[-300:]
print(json.dumps(dict(final_return=sum(last) / len(last), wall_seconds=r.summary["wall_seconds"],
                      steps_per_second=r.summary["steps_per_second"], episodes=r.summary["episodes"],
                      returns=r.episode_returns)))
"""

WINDOW = 20_000


def random_policy(seed: int, episodes: int = 100) -> float:
    """Mean agent-episode return of uniform-random actions on the environments a run with ``seed`` uses."""
    import fragflow as ff

    env = ff.envs.make("mpe2:simple_spread_v3", num_envs=8, seed=seed, max_cycles=25)
    rng = np.random.default_rng(seed)
    env.reset()
    returns: list[float] = []
    while len(returns) < episodes * 3:
        env.step(rng.integers(0, 5, size=(8, 3)))
        returns.extend(ret for ret, _ in env.pop_finished())
    env.close()
    return float(np.mean(returns))


def curve(returns: list[float], window: int = WINDOW) -> list[tuple[float, float]]:
    """(env steps, mean agent-episode return) per ``window`` env steps. Every simple_spread episode
    lasts 25 steps and 3 agents finish it together, so agent-episode k ends near env step
    (k // 3 + 1) * 25."""
    points: list[tuple[float, float]] = []
    chunk = window // 25 * 3
    for start in range(0, len(returns) - chunk + 1, chunk):
        points.append(((start + chunk) // 3 * 25, float(np.mean(returns[start:start + chunk]))))
    return points


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--no-value-norm", action="store_true", help="critics learn raw returns (results under *_no_value_norm)")
    a = p.parse_args(argv)
    suffix = "_no_value_norm" if a.no_value_norm else ""
    runs: dict[str, list[dict]] = {"central": [], "independent": []}
    curves: dict[str, list[list[tuple[float, float]]]] = {"central": [], "independent": []}
    for seed in range(1, a.seeds + 1):
        for critic in runs:
            r = run_json(CODE.format(steps=a.steps, seed=seed, critic=critic, value_norm=not a.no_value_norm))
            curves[critic].append(curve(r.pop("returns")))
            runs[critic].append(r)
            print(f"seed {seed} {critic}: final return {r['final_return']:.2f} ({r['steps_per_second']:,.0f} steps/s)",
                  flush=True)
    rand = [random_policy(seed) for seed in range(1, a.seeds + 1)]
    summary = {}
    for name, finals in [("MAPPO (central critic)", [r["final_return"] for r in runs["central"]]),
                         ("IPPO (independent critics)", [r["final_return"] for r in runs["independent"]]),
                         ("uniform random", rand)]:
        mean, std = statistics.mean(finals), statistics.pstdev(finals)
        summary[name] = {"final_returns": finals, "mean": mean, "std": std}
        print(f"{name}: {mean:.2f} +- {std:.2f}  (per seed {', '.join(f'{x:.2f}' for x in finals)})")
    plot(curves, statistics.mean(rand), a.steps, suffix)
    result = {"command": "python benchmarks/mappo_returns.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "env": "mpe2:simple_spread_v3 (3 agents, max_cycles=25)", "steps": a.steps, "summary": summary,
              "runs": runs, "curves": curves}
    result["value_norm"] = not a.no_value_norm
    save("mappo_returns" + suffix, result)
    return result


def plot(curves: dict[str, list[list[tuple[float, float]]]], random_mean: float, steps: int, suffix: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for critic, label in (("central", "MAPPO (central critic)"), ("independent", "IPPO")):
        for i, points in enumerate(curves[critic]):
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, color="C0" if critic == "central" else "C1", alpha=0.8, label=label if i == 0 else None)
    ax.axhline(random_mean, color="grey", linestyle="--", label="uniform random")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("agent episode return")
    ax.set_title(f"simple_spread_v3, {len(curves['central'])} seeds, {steps:,} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"mappo_curve{suffix}.png", dpi=100)


if __name__ == "__main__":
    main()
