"""Write your own algorithm: fragments with roles, versioned state, an ordinary loop.

A tiny REINFORCE-style learner on CartPole, to show the fragment contract.

    fragflow graph examples/custom_algorithm.py
    fragflow run examples/custom_algorithm.py --set updates=50
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fragflow as ff


@dataclass(frozen=True)
class Args:
    num_envs: int = 8
    num_steps: int = 64
    updates: int = 30
    lr: float = 0.01
    seed: int = 0


@ff.fragment("actor")
def act(w, obs, key):
    logits = obs @ w
    return np.argmax(logits + ff.random.gumbel(key, (logits.shape[-1],)), axis=-1)


@ff.fragment("learner")
def learn(state, batch, lr):
    obs, action, reward = batch["obs"], batch["action"], batch["reward"]
    ret = np.cumsum(reward[::-1], axis=0)[::-1]                  # undiscounted reward-to-go
    adv = (ret - ret.mean()) / (ret.std() + 1e-8)
    logits = obs @ state["w"]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    grad_logits = np.eye(p.shape[-1])[action] - p               # d log pi(a|s) / d logits
    grad = np.einsum("tei,tej,te->ij", obs, grad_logits, adv) / adv.size
    return {"w": state["w"] + lr * grad}, {"mean_reward": reward.mean()}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=args.num_envs, seed=args.seed)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action = act(state["w"], obs, sub)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward)
            obs = next_obs
        state, metrics = learn(state, buf.collect(), args.lr)
        ff.log(metrics)
    return state
