"""Advantage Actor-Critic (Mnih et al., 2016, https://arxiv.org/abs/1602.01783), synchronous, n-step.

With Stable-Baselines3's A2C defaults (the RL-Zoo's CartPole-v1 entry: 8 environments, no entropy
bonus): 5-step rollouts, n-step returns (GAE with lambda = 1), separate 64-64 tanh policy and value
networks with orthogonal initialisation, RMSprop (lr 7e-4, alpha 0.99, eps 1e-5), value loss
weight 0.5, gradient norm clipped to 0.5; and, as in OpenAI Baselines' A2C (``lrschedule='linear'``),
the learning rate annealed linearly to 0 over the run (``anneal_lr=False``: SB3's constant rate).

An episode cut by a time limit is bootstrapped from the value of its true last observation
(``info["final_obs"]``); a terminated one is not.

Under ``async_relaxed`` the actors act with parameters up to ``max_lag`` versions old while the
learner steps: asynchronous advantage actor-critic in the spirit of A3C (one learner applying the
actors' gradients' data, rather than Hogwild updates to shared weights)::

    fragflow run algorithms/a2c.py --policy single_process
    fragflow run algorithms/a2c.py --policy "async_relaxed(actors=2, max_lag=1)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import fragflow as ff


@dataclass(frozen=True)
class Args:
    env_id: str = "CartPole-v1"
    """gymnasium environment id (discrete actions)"""
    seed: int = 1
    total_timesteps: int = 500_000
    num_envs: int = 8
    num_steps: int = 5
    """steps per environment per update (the n of n-step returns)"""
    learning_rate: float = 7e-4
    """RMSprop learning rate (annealed linearly to 0 when anneal_lr)"""
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 1.0
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // (self.num_envs * self.num_steps)


def layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
    lin = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.constant_(lin.bias, 0.0)
    return lin


class ActorCritic(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.pi = nn.Sequential(layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(),
                                layer(hidden, n_actions, std=0.01))
        self.vf = nn.Sequential(layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(),
                                layer(hidden, 1, std=1.0))


# ACT: sample from the policy (Gumbel-max with per-environment keys); the policy network's forward
# pass in numpy (ff.numpy_forward: 9.7 us against torch's 21.5 us for 8 rows)
@ff.fragment("actor")
def act(model, obs, key):
    logits = ff.numpy_forward(model.pi, obs)
    return (logits + ff.random.gumbel(key, (logits.shape[-1],))).argmax(-1)


def advantages(reward: Any, value: Any, next_value: Any, terminated: Any, done: Any, gamma: float,
               lam: float) -> torch.Tensor:
    """GAE over a [T, N] rollout. ``next_value[t]`` is the value of step t's true next observation; a
    terminated step does not bootstrap from it, and any episode end cuts the recursion. Computed in
    numpy (arrays or CPU tensors in; float32, as torch computes it), a few small operations per step
    costing a fraction of torch's per-operation overhead."""
    reward, value, next_value = (np.asarray(x, np.float32) for x in (reward, value, next_value))
    bootstrap = gamma * (1.0 - np.asarray(terminated, np.float32))
    carry = gamma * lam * (1.0 - np.asarray(done, np.float32))
    adv = np.zeros_like(reward)
    last = np.zeros_like(reward[0])
    for t in reversed(range(reward.shape[0])):
        last = reward[t] + bootstrap[t] * next_value[t] - value[t] + carry[t] * last
        adv[t] = last
    return torch.from_numpy(adv)


# LEARN: one gradient step on the rollout
@ff.fragment("learner", writes="state")
def learn(state, rollout, lr, args: Args):
    model, optimizer = state["model"], state["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = lr
    obs = torch.as_tensor(rollout["obs"], dtype=torch.float32)             # [T, N, obs]
    final_obs = torch.as_tensor(rollout["final_obs"], dtype=torch.float32)
    action = torch.as_tensor(rollout["action"], dtype=torch.int64)
    value = model.vf(obs).squeeze(-1)
    with torch.no_grad():
        next_value = model.vf(final_obs).squeeze(-1)
        adv = advantages(rollout["reward"], value.detach(), next_value, rollout["terminated"], rollout["done"],
                         args.gamma, args.gae_lambda)
        returns = adv + value.detach()
    # the log-probabilities as Categorical(logits=...) computes them, in a few operations fewer (80 us an update)
    logp = torch.log_softmax(model.pi(obs), dim=-1)
    pg_loss = -(adv * logp.gather(-1, action.unsqueeze(-1)).squeeze(-1)).mean()
    v_loss = ((returns - value) ** 2).mean()
    loss = pg_loss + args.vf_coef * v_loss
    if args.ent_coef:
        entropy = -(logp.exp() * logp).sum(-1).mean()
        loss = loss - args.ent_coef * entropy
    else:   # (logged only: no gradient to take through it)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1).mean()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    return state, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy.detach()}


def train(args: Args):
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed)
    agents = getattr(env, "num_agents", None)   # (a PettingZoo env's: an agent axis after the env axis)
    for_agents = f" for each of its {agents} agents, a PettingZoo env's (mappo.py acts for every agent)" if agents else ""
    if agents is not None or not (isinstance(env.single_observation_space, gym.spaces.Box)
                                  and len(env.single_observation_space.shape) == 1
                                  and isinstance(env.single_action_space, gym.spaces.Discrete)):   # (what its networks take)
        raise ValueError(f"a2c.py's policy chooses among Discrete actions from vector observations (a Box of one axis); {args.env_id} has "
                         f"{env.single_observation_space} observations and {env.single_action_space} actions{for_agents} "
                         "(ppo.py and sac.py act in continuous spaces)")
    torch.manual_seed(args.seed)
    obs_dim = int(np.prod(env.single_observation_space.shape or (1,)))
    model = ActorCritic(obs_dim, int(env.single_action_space.n), args.hidden)
    # foreach=True: the default update, bit for bit, in a few vectorised operations rather than a few per tensor
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.learning_rate, alpha=0.99, eps=1e-5, foreach=True)
    state = ff.versioned({"model": model, "optimizer": optimizer})
    buffer = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    for update in range(args.num_updates):
        # the fraction of the run left after this rollout (SB3's progress_remaining when it trains)
        lr = args.learning_rate * (1.0 - (update + 1) / args.num_updates if args.anneal_lr else 1.0)
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, info = env.step(action)
            buffer.add(obs=obs, action=action, reward=reward, final_obs=info["final_obs"], terminated=terminated,
                       done=terminated | truncated)
            obs = next_obs
        state, metrics = learn(state, buffer.collect(), lr, args)
        ff.log(metrics)
    return state
