"""Multi-agent PPO on MPE (25-step episodes): MAPPO (centralised critic) against IPPO (independent
critics) and a uniform-random policy, at one budget, several seeds.

There is no published figure at this budget: the band is measured here. The return is an agent's
episode return (simple_spread_v3, 3 alike agents: the shared coverage reward plus each agent's own
collision penalty; simple_speaker_listener_v4, a speaker with 3 actions and 3 observations and a
listener with 5 and 11, padded to one network: the shared reward); the final return is the mean over
the last 100 episodes of each agent of a run. The random policy (uniform over each agent's own
actions) is scored on the same environments and seeds in this run. Each learning run is its own
process under ``single_process``, one at a time, MAPPO and IPPO alternating; the learning curves
(the mean return of each 20k-step window) are plotted to ``benchmarks/results/mappo_curve*.png``.

    python benchmarks/mappo_returns.py [--seeds 3] [--steps 300000]
    python benchmarks/mappo_returns.py --env mpe2:simple_speaker_listener_v4   # mappo_returns_speaker_listener
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
r = ff.run(mappo.train, mappo.Args(env_id={env!r}, total_timesteps={steps}, seed={seed}, critic={critic!r},
                                   value_norm={value_norm}), policy="single_process")
last = r.episode_returns[-100 * {agents}:]
print(json.dumps(dict(final_return=sum(last) / len(last), wall_seconds=r.summary["wall_seconds"],
                      steps_per_second=r.summary["steps_per_second"], episodes=r.summary["episodes"],
                      returns=r.episode_returns)))
"""

WINDOW = 20_000


def num_agents(env_id: str) -> int:
    import fragflow as ff

    env = ff.envs.make(env_id, num_envs=1, max_cycles=25)
    env.close()
    return env.num_agents  # type: ignore[attr-defined]


def random_policy(env_id: str, seed: int, episodes: int = 100) -> float:
    """Mean agent-episode return of uniform-random actions (each agent's own) on the environments a
    run with ``seed`` uses."""
    import fragflow as ff

    env = ff.envs.make(env_id, num_envs=8, seed=seed, max_cycles=25)
    mask = env.action_mask  # type: ignore[attr-defined]
    rng = np.random.default_rng(seed)
    env.reset()
    returns: list[float] = []
    while len(returns) < episodes * len(mask):
        env.step(np.stack([[rng.choice(np.flatnonzero(m)) for m in mask] for _ in range(8)]))
        returns.extend(ret for ret, _ in env.pop_finished())
    env.close()
    return float(np.mean(returns))


def curve(returns: list[float], agents: int, window: int = WINDOW) -> list[tuple[float, float]]:
    """(env steps, mean agent-episode return) per ``window`` env steps. Every MPE episode lasts 25
    steps and all agents finish it together, so agent-episode k ends near env step
    (k // agents + 1) * 25."""
    points: list[tuple[float, float]] = []
    chunk = window // 25 * agents
    for start in range(0, len(returns) - chunk + 1, chunk):
        points.append(((start + chunk) // agents * 25, float(np.mean(returns[start:start + chunk]))))
    return points


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--no-value-norm", action="store_true", help="critics learn raw returns (results under *_no_value_norm)")
    p.add_argument("--env", default="mpe2:simple_spread_v3",
                   help="an MPE parallel env (results of another than simple_spread under *_<name without _vN>)")
    a = p.parse_args(argv)
    env_name = a.env.split(":")[-1]
    suffix = ("" if env_name == "simple_spread_v3" else "_" + env_name.removeprefix("simple_").rsplit("_v", 1)[0]) + \
        ("_no_value_norm" if a.no_value_norm else "")
    agents = num_agents(a.env)
    runs: dict[str, list[dict]] = {"central": [], "independent": []}
    curves: dict[str, list[list[tuple[float, float]]]] = {"central": [], "independent": []}
    for seed in range(1, a.seeds + 1):
        for critic in runs:
            r = run_json(CODE.format(env=a.env, steps=a.steps, seed=seed, critic=critic, value_norm=not a.no_value_norm,
                                     agents=agents))
            curves[critic].append(curve(r.pop("returns"), agents))
            runs[critic].append(r)
            print(f"seed {seed} {critic}: final return {r['final_return']:.2f} ({r['steps_per_second']:,.0f} steps/s)",
                  flush=True)
    rand = [random_policy(a.env, seed) for seed in range(1, a.seeds + 1)]
    summary = {}
    for name, finals in [("MAPPO (central critic)", [r["final_return"] for r in runs["central"]]),
                         ("IPPO (independent critics)", [r["final_return"] for r in runs["independent"]]),
                         ("uniform random", rand)]:
        mean, std = statistics.mean(finals), statistics.pstdev(finals)
        summary[name] = {"final_returns": finals, "mean": mean, "std": std}
        print(f"{name}: {mean:.2f} +- {std:.2f}  (per seed {', '.join(f'{x:.2f}' for x in finals)})")
    plot(curves, statistics.mean(rand), a.steps, env_name, suffix)
    result = {"command": "python benchmarks/mappo_returns.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "env": f"{a.env} ({agents} agents, max_cycles=25)", "steps": a.steps, "summary": summary,
              "runs": runs, "curves": curves}
    result["value_norm"] = not a.no_value_norm
    save("mappo_returns" + suffix, result)
    return result


def plot(curves: dict[str, list[list[tuple[float, float]]]], random_mean: float, steps: int, env_name: str,
         suffix: str = "") -> None:
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
    ax.set_title(f"{env_name}, {len(curves['central'])} seeds, {steps:,} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"mappo_curve{suffix}.png", dpi=100)


if __name__ == "__main__":
    main()
