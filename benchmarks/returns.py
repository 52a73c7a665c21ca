"""Learning bands of the algorithm set: the final return of an algorithm at a fixed budget, over
several seeds, under one or more policies, against a published band.

=========  ============  ========  ===================  ==============================================
algorithm  env           budget    target (mean)        published
=========  ============  ========  ===================  ==============================================
sac        Pendulum-v1   20k       >= -250              SB3 RL-Zoo -157 +- 89; RLlib's threshold -250
a2c        CartPole-v1   500k      >= 450               SB3 RL-Zoo 500 +- 0
impala     CartPole-v1   2M        >= 450               RLlib's IMPALA CartPole example threshold
ppo        CartPole-v1   500k      >= 450               CleanRL 490 +- 6 (IMPALA's comparison)
=========  ============  ========  ===================  ==============================================

Each run is its own process (one at a time unless ``--jobs``); the final return is the mean return
of the last 20 training episodes (for A2C and IMPALA also the final policy's deterministic return
over 10 episodes of an env of its own: RL-Zoo's protocol for its published figures); "reached" is whether that mean reached the target at any point
within the budget (the stop criterion of RLlib's examples), with the step and second it did. Results go to ``benchmarks/results/returns_<algo>.json``.

    python benchmarks/returns.py sac [--seeds 3] [--steps 20000] [--policies single_process learner_replay]
    python benchmarks/returns.py a2c --seeds 10 --out returns_a2c_10_seeds   # more seeds, the band's file kept
    python benchmarks/returns.py a2c --seeds 10 --policies sb3 --out returns_a2c_sb3   # SB3's own A2C, same measures
    python benchmarks/returns.py a2c --lr-schedule constant --out returns_a2c_constant_lr   # SB3's constant rate
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

from common import run_json, save

BANDS = {
    "sac": {"steps": 20_000, "target": -250.0, "published": "SB3 RL-Zoo -157 +- 89 (Pendulum-v1, 20k)",
            "policies": ["single_process", "learner_replay", "actor_learner(actors=1)"]},
    "a2c": {"steps": 500_000, "target": 450.0, "published": "SB3 RL-Zoo 500 +- 0 (CartPole-v1, 500k)",
            "policies": ["single_process"]},
    "ppo": {"steps": 500_000, "target": 450.0, "published": "CleanRL 490.04 +- 6.12 (CartPole-v1, 500k)",
            "policies": ["async_relaxed(actors=2, max_lag=4)"]},
    "impala": {"steps": 2_000_000, "target": 450.0, "published": "RLlib IMPALA CartPole example: 450",
               "policies": ["async_relaxed(actors=2, max_lag=4)"]},
}

CODE = """
import json, torch
torch.set_num_threads(1)
import fragflow as ff
from fragflow.algorithms import {algo} as algo
r = ff.run(algo.train, algo.Args(total_timesteps={steps}, seed={seed}{extra}), policy={policy!r}, target_return={target})
summary = dict(r.summary)
{evaluate}
print(json.dumps(summary))
"""

# RL-Zoo's protocol for its published figures: the final policy, deterministic actions, 10 episodes
# on an environment of its own (not the training ones)
GREEDY = """
import numpy as np
env = ff.envs.make(algo.Args().env_id, num_envs=1, seed=10_000 + {seed})
obs, returns = env.reset(), []
while len(returns) < 10:
    with torch.no_grad():
        action = r.value["model"].pi(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()
    obs, *_ = env.step(action)
    returns.extend(ret for ret, _ in env.pop_finished())
summary["greedy_eval_return"] = float(np.mean(returns))
"""
EVALUATE = {"a2c": GREEDY, "impala": GREEDY}

# the reference implementation itself, same configuration and measures, for ``--policies sb3``: whether
# a seed that falls short is fragflow's or the algorithm's
SB3 = {"a2c": """
import json, time, numpy as np, torch
torch.set_num_threads(1)
import gymnasium as gym
from stable_baselines3 import A2C
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env

class Solved(BaseCallback):
    def __init__(self):
        super().__init__()
        self.at, self.t0, self.episodes = None, time.perf_counter(), []
    def _on_step(self):
        for info in self.locals["infos"]:
            if "episode" in info:
                self.episodes.append(info["episode"]["r"])
                last = self.episodes[-20:]
                if self.at is None and len(last) == 20 and sum(last) / 20 >= {target}:
                    self.at = (self.num_timesteps, round(time.perf_counter() - self.t0, 3))
        return True

env = make_vec_env("CartPole-v1", n_envs=8, seed={seed})
model = A2C("MlpPolicy", env, n_steps=5, learning_rate={learning_rate}, gamma=0.99, gae_lambda=1.0, ent_coef=0.0, vf_coef=0.5,
            max_grad_norm=0.5, use_rms_prop=True, rms_prop_eps=1e-5, normalize_advantage=False, seed={seed},
            device="cpu", policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh))
cb = Solved()
t = time.perf_counter()
model.learn({steps}, callback=cb)
wall = time.perf_counter() - t
last = cb.episodes[-20:]
ev, returns = gym.make("CartPole-v1"), []
for i in range(10):
    obs, _ = ev.reset(seed=10_000 + {seed} + i)
    total, done = 0.0, False
    while not done:
        obs, r, te, tr, _ = ev.step(int(model.predict(obs, deterministic=True)[0]))
        total, done = total + float(r), te or tr
    returns.append(total)
print(json.dumps(dict(policy="sb3", final_return_mean=float(sum(last) / len(last)), greedy_eval_return=float(np.mean(returns)),
                      solved_at_steps=cb.at and cb.at[0], solved_at_seconds=cb.at and cb.at[1], wall_seconds=wall,
                      steps_per_second=model.num_timesteps / wall, episodes=len(cb.episodes))))
"""}


# SB3's schedules take the fraction of the run left, as fragflow's A2C anneals (from 1 to 0, read when it trains)
LR_SCHEDULE = {"default": "", "constant": ", anneal_lr=False", "linear": ", anneal_lr=True"}
SB3_LEARNING_RATE = {"a2c": ("lambda progress: 7e-4 * progress", "7e-4")}


def one(algo: str, policy: str, seed: int, steps: int, schedule: str = "default") -> dict:
    if policy == "sb3":
        if algo not in SB3:
            raise SystemExit(f"--policies sb3: only for {', '.join(SB3)}")
        summary = run_json(SB3[algo].format(seed=seed, steps=steps, target=BANDS[algo]["target"],
                                            learning_rate=SB3_LEARNING_RATE[algo][schedule == "constant"]))
        print(f"{algo} sb3 seed {seed}: final return {summary['final_return_mean']:.2f}, deterministic evaluation "
              f"{summary['greedy_eval_return']:.2f}, target reached at {summary['solved_at_steps']} steps", flush=True)
        return summary
    evaluate = EVALUATE.get(algo, "").format(seed=seed)
    summary = run_json(CODE.format(algo=algo, seed=seed, steps=steps, policy=policy, target=BANDS[algo]["target"],
                                   evaluate=evaluate, extra=LR_SCHEDULE[schedule]))
    greedy = f", deterministic evaluation {summary['greedy_eval_return']:.2f}" if "greedy_eval_return" in summary else ""
    print(f"{algo} {policy} seed {seed}: final return {summary['final_return_mean']:.2f}{greedy}, "
          f"target reached at {summary.get('solved_at_steps')} steps / {summary.get('solved_at_seconds')} s, "
          f"{summary['steps_per_second']:,.0f} steps/s, {summary['wall_seconds']:.0f}s", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("algo", choices=sorted(BANDS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="environment steps per run (default: the band's budget)")
    p.add_argument("--policies", nargs="+", default=None)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--lr-schedule", choices=sorted(LR_SCHEDULE), default="default",
                   help="a2c, impala: a constant learning rate or one annealed linearly to 0 (default: the algorithm's; "
                        "a2c anneals, impala does not; SB3's side follows with --policies sb3)")
    p.add_argument("--out", default=None, help="results file name (default: returns_ALGO; another keeps the band's)")
    a = p.parse_args(argv)
    if a.lr_schedule != "default" and a.algo not in ("a2c", "impala"):
        p.error("--lr-schedule: only for a2c and impala (the others' schedules are fixed)")
    band = BANDS[a.algo]
    steps = a.steps or band["steps"]
    policies = a.policies or band["policies"]
    runs = [(policy, seed) for policy in policies for seed in range(1, a.seeds + 1)]
    with ThreadPoolExecutor(a.jobs) as pool:
        summaries = list(pool.map(lambda ps: one(a.algo, ps[0], ps[1], steps, a.lr_schedule), runs))
    result: dict = {"command": "python benchmarks/returns.py " + " ".join(argv or sys.argv[1:]), "algorithm": a.algo,
                    "steps": steps, "lr_schedule": a.lr_schedule, "target": band["target"], "published": band["published"], "policies": {}}
    for policy in policies:
        mine = [s for (pol, _), s in zip(runs, summaries) if pol == policy]
        finals = [s["final_return_mean"] for s in mine]
        mean = statistics.mean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        meets = mean >= band["target"]
        reached = sum(s.get("solved_at_steps") is not None for s in mine)
        print(f"{a.algo} {policy}: final return over {len(finals)} seeds {mean:.2f} +- {std:.2f} "
              f"({'meets' if meets else 'below'} the {band['target']:.0f} target; {band['published']}); "
              f"the mean of 20 episodes reached the target within the budget in {reached} of {len(mine)} seeds")
        greedy = [s["greedy_eval_return"] for s in mine if "greedy_eval_return" in s]
        if greedy:
            print(f"{a.algo} {policy}: deterministic evaluation of the final policy (10 episodes, RL-Zoo's protocol): "
                  f"{statistics.mean(greedy):.2f} +- {statistics.stdev(greedy) if len(greedy) > 1 else 0.0:.2f}")
        result["policies"][policy] = {"final_returns": finals, "mean": mean, "std": std, "meets_target": meets,
                                      "greedy_eval_returns": greedy,
                                      "seeds_reaching_target": reached,
                                      "wall_seconds": [s["wall_seconds"] for s in mine],
                                      "solved_at_steps": [s.get("solved_at_steps") for s in mine],
                                      "solved_at_seconds": [s.get("solved_at_seconds") for s in mine],
                                      "steps_per_second": [s["steps_per_second"] for s in mine], "per_seed": mine}
    save(a.out or f"returns_{a.algo}", result)
    return result


if __name__ == "__main__":
    main()
