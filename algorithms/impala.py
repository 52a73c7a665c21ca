"""IMPALA (Espeholt et al., 2018, https://arxiv.org/abs/1802.01561): actor-critic with V-trace.

Actors act with the parameters they have, possibly several versions old, and send each step's
behaviour log-probability with the rollout; the learner corrects for the lag with V-trace
(truncated importance weights, rho-bar = c-bar = 1). The lag each rollout was consumed with is what
``ff.delivered()`` reports; it is logged (``lag_mean``).

Separate 64-64 tanh policy and value networks, Adam, entropy bonus, 20-step unrolls of 8
environments, gradient norm clipped to 40 (IMPALA's); a constant learning rate (``anneal_lr=True``
anneals it linearly to 0 over the run, as the IMPALA paper does: not better here on CartPole)::

    fragflow run algorithms/impala.py --policy "async_relaxed(actors=2, max_lag=4)"
    fragflow run algorithms/impala.py --policy single_process      # no lag: V-trace is n-step returns
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    total_timesteps: int = 2_000_000
    num_envs: int = 8
    num_steps: int = 20
    """unroll length"""
    learning_rate: float = 5e-4
    """Adam learning rate (annealed linearly to 0 when anneal_lr)"""
    anneal_lr: bool = False
    gamma: float = 0.99
    rho_bar: float = 1.0
    """truncation of the importance weights in the V-trace targets"""
    c_bar: float = 1.0
    """truncation of the traces"""
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 40.0
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


# ACT: sample an action and keep its log-probability under the acting (behaviour) policy
@ff.fragment("actor")
def act(model, obs, key):
    with torch.no_grad():
        logp = torch.log_softmax(model.pi(torch.as_tensor(obs, dtype=torch.float32)), -1).numpy()
    action = (logp + ff.random.gumbel(key, (logp.shape[-1],))).argmax(-1)
    return action, np.take_along_axis(logp, action[:, None], -1)[:, 0]


def vtrace(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, reward: torch.Tensor, value: torch.Tensor,
           next_value: torch.Tensor, terminated: torch.Tensor, done: torch.Tensor, gamma: float,
           rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets ``vs`` and policy-gradient advantages over a [T, N] rollout (no gradient).

    ``next_value[t]`` is the value of step t's true next observation: a terminated step does not
    bootstrap from it, and any episode end (terminated or truncated) cuts the traces.
    """
    with torch.no_grad():
        ratio = torch.exp(target_logp - behaviour_logp)
        rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)
        discount = gamma * (1.0 - terminated)
        delta = rho * (reward + discount * next_value - value)
        vs_minus_v = torch.zeros_like(value)
        acc = torch.zeros_like(value[0])
        for t in reversed(range(value.shape[0])):
            acc = delta[t] + gamma * (1.0 - done[t]) * c[t] * acc
            vs_minus_v[t] = acc
        vs = value + vs_minus_v
        # the target of the next state: its V-trace target within the rollout and the episode, else its value
        next_vs = next_value.clone()
        next_vs[:-1] = torch.where(done[:-1] > 0, next_value[:-1], vs[1:])
        advantage = rho * (reward + discount * next_vs - value)
    return vs, advantage


# LEARN: one step on a rollout, whatever parameters it was acted with
@ff.fragment("learner", writes="state")
def learn(state, rollout, lr, args: Args):
    model, optimizer = state["model"], state["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = lr
    obs = torch.as_tensor(rollout["obs"], dtype=torch.float32)             # [T, N, obs]
    final_obs = torch.as_tensor(rollout["final_obs"], dtype=torch.float32)
    action = torch.as_tensor(rollout["action"], dtype=torch.int64)
    behaviour_logp = torch.as_tensor(rollout["logprob"], dtype=torch.float32)
    reward = torch.as_tensor(rollout["reward"], dtype=torch.float32)
    terminated = torch.as_tensor(rollout["terminated"], dtype=torch.float32)
    done = torch.as_tensor(rollout["done"], dtype=torch.float32)
    value = model.vf(obs).squeeze(-1)
    logits = model.pi(obs)
    dist = torch.distributions.Categorical(logits=logits)
    target_logp = dist.log_prob(action)
    with torch.no_grad():
        next_value = model.vf(final_obs).squeeze(-1)
    vs, advantage = vtrace(behaviour_logp, target_logp.detach(), reward, value.detach(), next_value, terminated, done,
                           args.gamma, args.rho_bar, args.c_bar)
    pg_loss = -(advantage * target_logp).mean()
    v_loss = 0.5 * ((vs - value) ** 2).mean()
    entropy = dist.entropy().mean()
    loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    lags = [lag for _, lag in ff.delivered()]
    return state, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy.detach(),
                   "rho_mean": torch.exp(target_logp.detach() - behaviour_logp).mean(),
                   "lag_mean": float(sum(lags)) / len(lags)}


def train(args: Args):
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed)
    agents = getattr(env, "num_agents", None)   # (a PettingZoo env's: an agent axis after the env axis)
    for_agents = f" for each of its {agents} agents, a PettingZoo env's (mappo.py acts for every agent)" if agents else ""
    if agents is not None or not (isinstance(env.single_observation_space, gym.spaces.Box)
                                  and len(env.single_observation_space.shape) == 1
                                  and isinstance(env.single_action_space, gym.spaces.Discrete)):   # (what its networks take)
        raise ValueError(f"impala.py's policy chooses among Discrete actions from vector observations (a Box of one axis); {args.env_id} has "
                         f"{env.single_observation_space} observations and {env.single_action_space} actions{for_agents} "
                         "(ppo.py and sac.py act in continuous spaces)")
    torch.manual_seed(args.seed)
    obs_dim = int(np.prod(env.single_observation_space.shape or (1,)))
    model = ActorCritic(obs_dim, int(env.single_action_space.n), args.hidden)
    state = ff.versioned({"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=args.learning_rate)})
    buffer = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    for update in range(args.num_updates):
        lr = args.learning_rate * (1.0 - update / args.num_updates if args.anneal_lr else 1.0)
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action, logprob = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, info = env.step(action)
            buffer.add(obs=obs, action=action, logprob=logprob, reward=reward, final_obs=info["final_obs"],
                       terminated=terminated, done=terminated | truncated)
            obs = next_obs
        state, metrics = learn(state, buffer.collect(), lr, args)
        ff.log(metrics)
    return state
