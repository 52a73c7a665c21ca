"""A tiny numpy-only algorithm: the subject of golden-text tests. Edit it and the golden changes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fragflow as ff


@dataclass(frozen=True)
class Args:
    num_envs: int = 2
    num_steps: int = 4
    updates: int = 3
    seed: int = 0


@ff.fragment("actor")
def act(params, obs):
    return np.argmax(obs @ params["w"], axis=-1)


@ff.fragment("learner")
def learn(state, batch):
    w = state["params"]["w"] + 0.01 * batch["obs"].mean(axis=(0, 1))[:, None]
    return {"params": {"w": w}}, {"reward": batch["reward"].mean()}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=args.num_envs, seed=args.seed)
    state = ff.versioned({"params": {"w": np.zeros((4, 2), np.float32)}})
    buf = ff.RolloutBuffer(args.num_steps)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(args.num_steps):
            action = act(state["params"], obs)
            obs, reward, terminated, truncated, info = env.step(action)
            buf.add(obs=obs, reward=reward)
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    return state
