"""Deep Q-Network (Mnih et al., 2015, https://www.nature.com/articles/nature14236).

With the details of CleanRL's ``dqn.py``: a 120-84 MLP Q-network, ``torch.optim.Adam``, a replay
buffer of 10k transitions, 10k warm-up steps, a gradient step every 10 steps on a batch of 128, a
target network synced every 500 steps, epsilon annealed from 1 to 0.05 over half the run.
``--set prioritized=true`` samples in proportion to the TD errors (Schaul et al., 2016,
https://arxiv.org/abs/1511.05952) and writes them back after each step; its importance-sampling
exponent beta is annealed linearly from 0.4 to 1 over the run, as in the paper.

Written the way CleanRL writes it: an ``nn.Module``, an optimizer, a replay buffer object and a
target network in the loop. Where the buffer lives is the policy's choice::

    fragflow run algorithms/dqn.py --policy single_process
    fragflow run algorithms/dqn.py --policy "actor_learner(actors=2)" --set num_envs=2   # a buffer per actor
    fragflow run algorithms/dqn.py --policy learner_replay                              # the buffer with the learner
    fragflow run algorithms/dqn.py --set device=cuda                                    # the networks on a GPU
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


@dataclass(frozen=True)
class Args:
    env_id: str = "CartPole-v1"
    """gymnasium environment id"""
    seed: int = 1
    total_timesteps: int = 500_000
    """total environment steps of the run"""
    num_envs: int = 1
    learning_rate: float = 2.5e-4
    buffer_size: int = 10_000
    gamma: float = 0.99
    tau: float = 1.0
    """target network update rate (1: copy)"""
    target_network_frequency: int = 500
    """steps between target network updates"""
    batch_size: int = 128
    start_e: float = 1.0
    end_e: float = 0.05
    exploration_fraction: float = 0.5
    """fraction of the run over which epsilon falls from start_e to end_e"""
    learning_starts: int = 10_000
    """steps of warm-up before learning"""
    train_frequency: int = 10
    """steps between gradient steps"""
    prioritized: bool = False
    """prioritized replay: sample by TD error and write the new errors back"""
    beta_start: float = 0.4
    """prioritized replay's importance-sampling exponent at the start, annealed to 1 over the run"""
    device: str = "cpu"
    """torch device of the networks ("cuda": a GPU)"""

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.num_envs


# NETWORK
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


# ACT: epsilon-greedy; the exploration noise comes from per-environment keys
@ff.fragment("actor")
def act(q, obs, key, epsilon):
    head = q.network[-1]
    u = ff.random.uniform(key, (2,))
    explore = u[:, 0] < epsilon
    random_action = (u[:, 1] * head.out_features).astype(np.int64)
    if explore.all():   # as CleanRL: no forward pass where no environment acts greedily
        return random_action
    if head.weight.device.type == "cpu":   # the forward pass in numpy: 8.6 us against torch's 19.1 for a row
        q_values = ff.numpy_forward(q.network, obs)
    else:
        with torch.no_grad():
            q_values = q(torch.as_tensor(obs, dtype=torch.float32, device=head.weight.device)).cpu().numpy()
    return np.where(explore, random_action, q_values.argmax(axis=-1))


# LEARN: one gradient step on the TD error against the target network
@ff.fragment("learner", writes="state")
def learn(state, target, batch, args: Args):
    q, optimizer = state["q"], state["optimizer"]
    device = q.network[-1].weight.device
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32, device=device)
    next_obs = torch.as_tensor(batch["next_obs"], dtype=torch.float32, device=device)
    action = torch.as_tensor(batch["action"], dtype=torch.int64, device=device)
    reward = torch.as_tensor(batch["reward"], dtype=torch.float32, device=device)
    done = torch.as_tensor(batch["done"], dtype=torch.float32, device=device)
    with torch.no_grad():
        target_max = target["q"](next_obs).max(dim=1).values
        td_target = reward + args.gamma * target_max * (1 - done)
    old_val = q(obs).gather(1, action[:, None]).squeeze(1)
    if args.prioritized:   # the squared TD errors weighted by importance sampling; their sizes are the new priorities
        td_error = td_target - old_val
        loss = (torch.as_tensor(batch["weight"], dtype=torch.float32, device=device) * td_error**2).mean()
    else:
        loss = F.mse_loss(td_target, old_val)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    metrics = {"td_loss": loss.detach(), "q_values": old_val.mean().detach()}
    return state, metrics, td_error.detach().abs().cpu() if args.prioritized else None


# TARGET: soft update (tau=1 copies the Q-network)
@ff.fragment("learner", writes="target")
def sync_target(target, state, tau):
    with torch.no_grad():
        for t, p in zip(target["q"].parameters(), state["q"].parameters()):
            t.copy_(tau * p + (1.0 - tau) * t)
    return target


def train(args: Args):
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed)
    agents = getattr(env, "num_agents", None)   # (a PettingZoo env's: an agent axis after the env axis)
    for_agents = f" for each of its {agents} agents, a PettingZoo env's (mappo.py acts for every agent)" if agents else ""
    if agents is not None or not (isinstance(env.single_observation_space, gym.spaces.Box)
                                  and len(env.single_observation_space.shape) == 1
                                  and isinstance(env.single_action_space, gym.spaces.Discrete)):   # (what its networks take)
        raise ValueError(f"dqn.py learns Q-values of Discrete actions from vector observations (a Box of one axis); {args.env_id} has "
                         f"{env.single_observation_space} observations and {env.single_action_space} actions{for_agents} "
                         "(sac.py and ppo.py act in continuous spaces)")
    torch.manual_seed(args.seed)
    obs_dim = int(np.prod(env.single_observation_space.shape or (1,)))
    q = QNetwork(obs_dim, int(env.single_action_space.n)).to(args.device)
    # fused=True: Adam's update in one kernel for all the parameters (88 us a step here, against 241 us
    # with foreach=True and 284 us for the default loop over them; equal to float rounding, not bit for bit)
    state = ff.versioned({"q": q, "optimizer": torch.optim.Adam(q.parameters(), lr=args.learning_rate, fused=True)})
    target = ff.versioned({"q": copy.deepcopy(q)}, name="target")
    rb = ff.ReplayBuffer(args.buffer_size, seed=args.seed, prioritized=args.prioritized)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    for step in range(args.num_iterations):
        global_step = step * args.num_envs
        epsilon = linear_schedule(args.start_e, args.end_e, int(args.exploration_fraction * args.total_timesteps),
                                  global_step)
        key, sub = ff.random.split(key)
        action = act(state["q"], obs, sub, epsilon)
        next_obs, reward, terminated, truncated, info = env.step(action)
        # the real next observation of an episode that ended is in final_obs (same-step autoreset)
        rb.add(obs=obs, next_obs=info["final_obs"], action=action, reward=reward, done=terminated)
        obs = next_obs

        # LEARN
        if global_step > args.learning_starts:
            if step % args.train_frequency == 0:
                # (prioritized replay's importance-sampling correction grows to the full one by the run's end)
                beta = min(1.0, args.beta_start + (1.0 - args.beta_start) * global_step / args.total_timesteps)
                batch = rb.sample(args.batch_size, beta=beta)
                state, metrics, td_error = learn(state, target, batch, args)
                if args.prioritized:
                    rb.update_priorities(batch["index"], td_error)
                ff.log(metrics)
            if step % args.target_network_frequency == 0:
                target = sync_target(target, state, args.tau)
    return state
