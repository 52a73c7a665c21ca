"""Multi-agent PPO (MAPPO: Yu et al., 2022, https://arxiv.org/abs/2103.01955) on PettingZoo.

Every agent acts with one shared policy network (parameter sharing) over its own observation and
a one-hot of its index; the critic is **centralised**: it sees all agents' observations (and which
agent it values), as MAPPO's does. ``critic="independent"`` gives each agent a critic over its own
observation only: IPPO (de Witt et al., 2020), the same networks otherwise. The critic learns
returns normalised by their running mean and variance (MAPPO's ValueNorm; ``value_norm=false``
turns it off).

The env is a PettingZoo parallel env made by ``ff.envs.make``: observations are
``[num_envs, num_agents, obs_dim]``, rewards and done flags ``[num_envs, num_agents]``, so the
rollout buffer holds ``[num_steps, num_envs, num_agents, ...]`` and a policy that splits the
environments across actors splits along ``env`` and keeps every environment's agents together.
Each agent's advantages come from its own rewards (GAE), and the PPO loss treats every agent-step
as a sample, except the steps of an agent that has left its episode while others play on (MAPPO's
active masks: the env ignores its actions there; the loop marks which agents are still in). Agents of different kinds (``mpe2:simple_speaker_listener_v4``: a speaker with 3
actions that sees 3 numbers, a listener with 5 that sees 11) share the network through padding:
``ff.envs.make`` zero-pads their observations to the longest and gives the largest action space
with ``env.action_mask``; the policy never picks an action that is not the agent's. Needs the ``multiagent`` extra (``pip install "fragflow[multiagent]"``)::

    fragflow run algorithms/mappo.py
    fragflow run algorithms/mappo.py --set critic=independent --policy "actor_learner(actors=2)"
    fragflow run algorithms/mappo.py --set env_id=mpe2:simple_speaker_listener_v4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

import fragflow as ff


@dataclass(frozen=True)
class Args:
    env_id: str = "mpe2:simple_spread_v3"
    """a PettingZoo parallel env with Discrete actions (agents of different kinds are padded to one)"""
    seed: int = 1
    total_timesteps: int = 1_000_000
    """environment steps (each steps every agent)"""
    num_envs: int = 8
    num_steps: int = 100
    """steps per environment per rollout (four 25-step simple_spread episodes)"""
    max_cycles: int = 25
    """episode length of MPE environments"""
    critic: Literal["central", "independent"] = "central"
    """'central': the critic sees every agent's observation (MAPPO); 'independent': only its own (IPPO)"""
    learning_rate: float = 7e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    update_epochs: int = 10
    num_minibatches: int = 2
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 10.0
    hidden: int = 64
    value_norm: bool = True
    """the critic learns normalised returns (running mean and variance, MAPPO's ValueNorm)"""

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // (self.num_envs * self.num_steps)


def layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
    lin = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.constant_(lin.bias, 0.0)
    return lin


class Agents(nn.Module):
    """The shared policy and the critic, with the inputs each sees built from ``[..., agents, obs]``."""

    def __init__(self, obs_dim: int, num_agents: int, num_actions: int, hidden: int, central: bool,
                 value_norm: bool = False, action_mask: np.ndarray | None = None, obs_ndim: int = 1) -> None:
        super().__init__()
        self.central = central
        self.obs_ndim = obs_ndim   # an agent's observation's axes (KAZ's [27, 5]; a Discrete one's none): made flat
        self.value_norm = value_norm
        self.ids: torch.Tensor
        self.register_buffer("ids", torch.eye(num_agents))
        # the actions each agent has (agents of different kinds share the largest action space)
        self.action_mask: torch.Tensor
        self.register_buffer("action_mask", torch.ones(num_agents, num_actions, dtype=torch.bool) if action_mask is None
                             else torch.as_tensor(action_mask, dtype=torch.bool))
        # ValueNorm (MAPPO): exponential running moments of the returns with a debiasing term; the
        # critic's head predicts returns in their units; these buffers travel with the weights
        self.ret_mean: torch.Tensor
        self.ret_mean_sq: torch.Tensor
        self.ret_debias: torch.Tensor
        for name in ("ret_mean", "ret_mean_sq", "ret_debias"):
            self.register_buffer(name, torch.zeros(()))
        critic_in = (num_agents * obs_dim if central else obs_dim) + num_agents
        self.pi = nn.Sequential(layer(obs_dim + num_agents, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(),
                                layer(hidden, num_actions, std=0.01))
        self.vf = nn.Sequential(layer(critic_in, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(),
                                layer(hidden, 1, std=1.0))

    def _with_ids(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.ids.expand(*x.shape[:-1], -1)], -1)

    def _flat(self, obs: torch.Tensor) -> torch.Tensor:
        """``[..., agents, obs_dim]`` from ``[..., agents, *observation's shape]``."""
        return obs.unsqueeze(-1) if self.obs_ndim == 0 else obs.flatten(-self.obs_ndim) if self.obs_ndim > 1 else obs

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """Per agent; an action that is not the agent's gets a logit of -1e9 (probability 0)."""
        return self.pi(self._with_ids(self._flat(obs))).masked_fill(~self.action_mask, -1e9)

    def head(self, obs: torch.Tensor) -> torch.Tensor:
        """The critic's output: normalised returns with ``value_norm``, else returns."""
        obs = self._flat(obs)
        if self.central:   # every agent's critic input: all observations of its environment
            obs = obs.flatten(-2).unsqueeze(-2).expand(*obs.shape[:-1], -1)
        return self.vf(self._with_ids(obs)).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """The value estimate in returns' units."""
        raw = self.head(obs)
        if not self.value_norm:
            return raw
        mean, std = self.return_moments()
        return raw * std + mean

    def return_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        debias = self.ret_debias.clamp(min=1e-5)
        mean = self.ret_mean / debias
        var = (self.ret_mean_sq / debias - mean**2).clamp(min=1e-2)
        return mean, var.sqrt()

    @torch.no_grad()
    def observe_returns(self, returns: torch.Tensor, beta: float = 0.99999) -> None:
        mean, mean_sq = returns.mean(), (returns**2).mean()
        if ff.learners() > 1:   # several learners (multi_learner), each on its share: the whole's
            moments = torch.stack([returns.sum(), (returns**2).sum(), returns.new_tensor(float(returns.numel()))])
            torch.distributed.all_reduce(moments)
            mean, mean_sq = moments[0] / moments[2], moments[1] / moments[2]
        self.ret_mean.mul_(beta).add_((1 - beta) * mean)
        self.ret_mean_sq.mul_(beta).add_((1 - beta) * mean_sq)
        self.ret_debias.mul_(beta).add_(1 - beta)


# ACT: every agent of every environment at once, one shared network
@ff.fragment("actor")
def act(model, obs, key):
    with torch.no_grad():
        obs_t = torch.as_tensor(obs, dtype=torch.float32)
        logp = torch.log_softmax(model.logits(obs_t), -1).numpy()      # [envs, agents, actions]
        value = model.value(obs_t).numpy()
    action = (logp + ff.random.gumbel(key, logp.shape[1:])).argmax(-1)
    return action, np.take_along_axis(logp, action[..., None], -1)[..., 0], value


def gae(reward: np.ndarray, value: np.ndarray, done: np.ndarray, next_value: np.ndarray, next_done: np.ndarray,
        gamma: float, lam: float) -> np.ndarray:
    """Generalized advantage estimates over ``[T, ...]`` arrays; ``done[t]``: step t began an episode."""
    adv = np.zeros_like(reward)
    last = np.zeros_like(next_value)
    for t in reversed(range(reward.shape[0])):
        nonterminal = 1.0 - (next_done if t == reward.shape[0] - 1 else done[t + 1])
        following = next_value if t == reward.shape[0] - 1 else value[t + 1]
        delta = reward[t] + gamma * following * nonterminal - value[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv


# LEARN: clipped PPO on every agent-step of the rollout
@ff.fragment("learner", writes="state")
def learn(state, batch, lr, args: Args):
    model, optimizer = state["model"], state["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = float(lr)
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32)               # [T, E, A, obs]
    with torch.no_grad():
        next_value = model.value(torch.as_tensor(batch["next_obs"], dtype=torch.float32)).numpy()
    value = np.asarray(batch["value"], np.float32)
    adv = gae(np.asarray(batch["reward"], np.float32), value, np.asarray(batch["done"], np.float32), next_value,
              np.asarray(batch["next_done"], np.float32), args.gamma, args.gae_lambda)
    # samples: one per agent-step; a centralised critic still needs each sample's whole environment
    b_obs = obs.reshape(-1, *obs.shape[2:])                                  # [T*E, A, obs]
    b_action = torch.as_tensor(batch["action"], dtype=torch.int64).reshape(-1, obs.shape[2])
    b_logp = torch.as_tensor(batch["logprob"], dtype=torch.float32).reshape(-1, obs.shape[2])
    b_adv = torch.from_numpy(adv).reshape(-1, obs.shape[2])
    b_ret = b_adv + torch.from_numpy(value).reshape(-1, obs.shape[2])
    b_active = torch.as_tensor(batch["active"], dtype=torch.bool).reshape(-1, obs.shape[2])
    if model.value_norm:   # the critic learns the returns normalised with the moments seen so far
        model.observe_returns(b_ret[b_active])
        mean, std = model.return_moments()
        b_target = (b_ret - mean) / std
    else:
        b_target = b_ret
    n = b_obs.shape[0]
    size = max(n // args.num_minibatches, 1)
    key = state["key"]
    for _ in range(args.update_epochs):
        key, sub = ff.random.split(key)
        order = torch.from_numpy(np.argsort(ff.random.uniform(sub, (n,))[0]))
        for start in range(0, n, size):
            mb = order[start:start + size]
            active = b_active[mb]   # the agent-steps that are samples: [minibatch, agents]
            logp_all = torch.log_softmax(model.logits(b_obs[mb]), -1)
            newlogp = logp_all.gather(-1, b_action[mb, :, None])[..., 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)[active].mean()
            ratio = (newlogp - b_logp[mb])[active].exp()
            mb_adv = b_adv[mb][active]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            v_loss = 0.5 * ((model.head(b_obs[mb]) - b_target[mb])[active] ** 2).mean()
            loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
    new_state = {"model": model, "optimizer": optimizer, "key": key}
    return new_state, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy.detach(),
                       "learning_rate": float(lr)}


LEARNER_KEY_ID = 1 << 40   # an id no environment has: the learner's minibatch shuffling key


def train(args: Args):
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed, max_cycles=args.max_cycles)
    torch.manual_seed(args.seed)
    obs_dim = int(np.prod(env.single_observation_space.shape or (1,)))
    model = Agents(obs_dim, env.num_agents, int(env.single_action_space.n), args.hidden,  # type: ignore[attr-defined]
                   central=args.critic == "central", value_norm=args.value_norm,
                   action_mask=env.action_mask,  # type: ignore[attr-defined]
                   obs_ndim=len(env.single_observation_space.shape or ()))
    state = ff.versioned({"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=args.learning_rate,
                                                                        eps=1e-5),
                          "key": ff.random.keys(args.seed, np.array([LEARNER_KEY_ID]))})
    buffer = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    num_agents: int = env.num_agents  # type: ignore[attr-defined]
    done = np.zeros((env.num_envs, num_agents), dtype=np.bool_)
    active = np.ones((env.num_envs, num_agents), dtype=np.bool_)   # the agents still in their episode
    for update in range(args.num_updates):
        lr = args.learning_rate * (1.0 - update / args.num_updates if args.anneal_lr else 1.0)
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action, logprob, value = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, _info = env.step(action)
            buffer.add(obs=obs, done=done, action=action, logprob=logprob, value=value, reward=reward,
                       active=active)
            obs, done = next_obs, terminated | truncated
            # an agent that left is out until its environment starts again, when all its agents are done
            active = active & ~done
            active[~active.any(axis=1)] = True
        state, metrics = learn(state, buffer.collect(next_obs=obs, next_done=done), lr, args)
        ff.log(metrics)
    return state
