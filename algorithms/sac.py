"""Soft Actor-Critic (Haarnoja et al., 2018, https://arxiv.org/abs/1812.05905), continuous actions.

With the details of CleanRL's ``sac_continuous_action.py``: twin soft Q-networks and their
target copies (Polyak averaging, tau=0.005, every step), a tanh-squashed Gaussian actor with
log-std bounded to [-5, 2], automatic entropy tuning towards ``-dim(A)``, the actor and the
temperature updated every ``policy_frequency`` steps (that many times, to keep the ratio of
updates), a replay buffer, and uniform random actions for ``learning_starts`` steps of warm-up.

Written as CleanRL writes it, ``nn.Module``s, ``torch.optim.Adam``, a replay buffer and target
networks in the loop. The learner's own noise (the reparameterised action samples) comes from a
``torch.Generator`` whose state is part of the learner's state, so a run is the same wherever the
learner runs::

    fragflow run algorithms/sac.py --policy single_process
    fragflow run algorithms/sac.py --policy learner_replay          # the buffer with the learner
    fragflow run algorithms/sac.py --policy "actor_learner(max_lag=1)"
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fragflow as ff

LOG_STD_MAX = 2.0
LOG_STD_MIN = -5.0


@dataclass(frozen=True)
class Args:
    env_id: str = "Pendulum-v1"
    """gymnasium environment id (continuous actions)"""
    seed: int = 1
    total_timesteps: int = 20_000
    """total environment steps of the run"""
    num_envs: int = 1
    buffer_size: int = 1_000_000
    gamma: float = 0.99
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    learning_starts: int = 5_000
    """steps of uniform random actions before learning"""
    policy_lr: float = 3e-4
    q_lr: float = 1e-3
    policy_frequency: int = 2
    """steps between actor updates (each time, that many updates: TD3's delayed update)"""
    target_network_frequency: int = 1
    """steps between target updates"""
    alpha: float = 0.2
    """entropy coefficient when autotune is off (its initial value is 1 when on)"""
    autotune: bool = True
    """tune the entropy coefficient towards a target entropy of -dim(A)"""
    hidden: int = 256

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.num_envs


# NETWORKS
class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + act_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.cat([x, a], 1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    action_scale: torch.Tensor
    action_bias: torch.Tensor

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: np.ndarray, high: np.ndarray) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc_mean = nn.Linear(hidden, act_dim)
        self.fc_logstd = nn.Linear(hidden, act_dim)
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)   # bounded to [min, max]
        return mean, log_std

    def sample(self, x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action for standard-normal ``noise``, and its log-probability."""
        mean, log_std = self(x)
        std = log_std.exp()
        x_t = mean + std * noise
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        # (validate_args=False: the same numbers without checking the arguments each call, ~10 us)
        log_prob = torch.distributions.Normal(mean, std, validate_args=False).log_prob(x_t)
        log_prob = log_prob - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)   # the tanh squashing
        return action, log_prob.sum(1, keepdim=True)


class Temperature(nn.Module):
    """The entropy coefficient, learned in log space."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor([float(np.log(alpha))]))


# ACT: a sample of the squashed Gaussian; the noise comes from per-environment keys
@ff.fragment("actor")
def act(actor, obs, key):
    noise = ff.random.normal(key, (actor.fc_mean.out_features,))
    with torch.no_grad():
        action, _ = actor.sample(torch.as_tensor(obs, dtype=torch.float32), torch.as_tensor(noise, dtype=torch.float32))
    return action.numpy()


# LEARN: the soft Q step, every step
@ff.fragment("learner", writes="state")
def learn_q(state, target, batch, args: Args):
    actor, qf1, qf2 = state["actor"], state["qf1"], state["qf2"]
    gen = torch.Generator()
    gen.set_state(state["rng"])
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
    next_obs = torch.as_tensor(batch["next_obs"], dtype=torch.float32)
    action = torch.as_tensor(batch["action"], dtype=torch.float32)
    reward = torch.as_tensor(batch["reward"], dtype=torch.float32)
    done = torch.as_tensor(batch["done"], dtype=torch.float32)
    alpha = state["temperature"].log_alpha.exp().detach() if args.autotune else args.alpha
    with torch.no_grad():
        next_action, next_log_pi = actor.sample(next_obs, torch.randn(action.shape, generator=gen))
        q1_next = target["qf1"](next_obs, next_action)
        q2_next = target["qf2"](next_obs, next_action)
        min_q_next = torch.min(q1_next, q2_next) - alpha * next_log_pi
        next_q = reward + (1 - done) * args.gamma * min_q_next.view(-1)
    q1 = qf1(obs, action).view(-1)
    q2 = qf2(obs, action).view(-1)
    qf_loss = F.mse_loss(q1, next_q) + F.mse_loss(q2, next_q)
    state["q_optimizer"].zero_grad()
    qf_loss.backward()
    state["q_optimizer"].step()
    return dict(state, rng=gen.get_state()), {"qf_loss": qf_loss.detach() / 2.0, "qf1_values": q1.mean().detach()}


# LEARN: the actor and the temperature, every policy_frequency steps (that many updates, to keep
# the ratio of actor to critic updates, as TD3's delayed update does)
@ff.fragment("learner", writes="state")
def learn_actor(state, batch, args: Args):
    actor, qf1, qf2, temp = state["actor"], state["qf1"], state["qf2"], state["temperature"]
    gen = torch.Generator()
    gen.set_state(state["rng"])
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
    shape = (obs.shape[0], actor.fc_mean.out_features)
    target_entropy = -float(shape[1])
    alpha = temp.log_alpha.exp().detach() if args.autotune else torch.tensor(args.alpha)
    critics = [p for q in (qf1, qf2) for p in q.parameters()]
    for _ in range(args.policy_frequency):
        pi, log_pi = actor.sample(obs, torch.randn(shape, generator=gen))
        # the critics' own gradients would be thrown away (their next step starts from zero): not computed
        for p in critics:
            p.requires_grad_(False)
        try:
            min_q_pi = torch.min(qf1(obs, pi), qf2(obs, pi))
        finally:
            for p in critics:
                p.requires_grad_(True)
        actor_loss = (alpha * log_pi - min_q_pi).mean()
        state["actor_optimizer"].zero_grad()
        actor_loss.backward()
        state["actor_optimizer"].step()
        if args.autotune:
            with torch.no_grad():
                _, log_pi = actor.sample(obs, torch.randn(shape, generator=gen))
            alpha_loss = (-temp.log_alpha.exp() * (log_pi + target_entropy)).mean()
            state["a_optimizer"].zero_grad()
            alpha_loss.backward()
            state["a_optimizer"].step()
            alpha = temp.log_alpha.exp().detach()
    return dict(state, rng=gen.get_state()), {"actor_loss": actor_loss.detach(), "alpha": alpha.reshape(())}


# TARGET: Polyak averaging of both Q-networks
@ff.fragment("learner", writes="target")
def sync_target(target, state, tau):
    with torch.no_grad():
        for name in ("qf1", "qf2"):
            for t, p in zip(target[name].parameters(), state[name].parameters()):
                t.mul_(1.0 - tau).add_(tau * p)
    return target


def init_state(obs_dim: int, act_dim: int, low: np.ndarray, high: np.ndarray, args: Args) -> dict:
    actor = Actor(obs_dim, act_dim, args.hidden, low, high)
    qf1, qf2 = SoftQNetwork(obs_dim, act_dim, args.hidden), SoftQNetwork(obs_dim, act_dim, args.hidden)
    temp = Temperature(1.0 if args.autotune else args.alpha)
    return {
        "actor": actor, "qf1": qf1, "qf2": qf2, "temperature": temp,
        # fused=True: Adam's update in one kernel for all the parameters (the critics': 136 us a step, against
        # 376 us with foreach=True and 468 us for the default loop; equal to float rounding, not bit for bit)
        "q_optimizer": torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr, fused=True),
        "actor_optimizer": torch.optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True),
        "a_optimizer": torch.optim.Adam(temp.parameters(), lr=args.q_lr, fused=True),
        "rng": torch.Generator().manual_seed(args.seed).get_state(),
    }


def train(args: Args):
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed)
    agents = getattr(env, "num_agents", None)   # (a PettingZoo env's: an agent axis after the env axis)
    for_agents = f" for each of its {agents} agents, a PettingZoo env's (mappo.py acts for every agent)" if agents else ""
    if agents is not None or not (isinstance(env.single_observation_space, gym.spaces.Box)
                                  and len(env.single_observation_space.shape) == 1
                                  and isinstance(env.single_action_space, gym.spaces.Box)):   # (what its networks take)
        raise ValueError(f"sac.py's policy acts in a continuous (Box) action space from vector observations (a Box of one axis); {args.env_id} has "
                         f"{env.single_observation_space} observations and {env.single_action_space} actions{for_agents} "
                         "(dqn.py and ppo.py choose among Discrete actions)")
    torch.manual_seed(args.seed)
    space = env.single_action_space
    low, high = np.asarray(space.low, np.float32), np.asarray(space.high, np.float32)
    obs_dim = int(np.prod(env.single_observation_space.shape or (1,)))
    nets = init_state(obs_dim, int(np.prod(low.shape)), low, high, args)
    target = ff.versioned({"qf1": copy.deepcopy(nets["qf1"]), "qf2": copy.deepcopy(nets["qf2"])}, name="target")
    state = ff.versioned(nets)
    rb = ff.ReplayBuffer(args.buffer_size, seed=args.seed)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    for step in range(args.num_iterations):
        global_step = step * args.num_envs
        key, sub = ff.random.split(key)
        if global_step < args.learning_starts:   # warm-up: uniform random actions
            action = (low + (high - low) * ff.random.uniform(sub, low.shape)).astype(np.float32)
        else:
            action = act(state["actor"], obs, sub)
        next_obs, reward, terminated, truncated, info = env.step(action)
        rb.add(obs=obs, next_obs=info["final_obs"], action=action, reward=reward, done=terminated)
        obs = next_obs

        # LEARN
        if global_step > args.learning_starts:
            batch = rb.sample(args.batch_size)
            state, metrics = learn_q(state, target, batch, args)
            ff.log(metrics)
            if step % args.policy_frequency == 0:
                state, metrics = learn_actor(state, batch, args)
                ff.log(metrics)
            if step % args.target_network_frequency == 0:
                target = sync_target(target, state, args.tau)
    return state
