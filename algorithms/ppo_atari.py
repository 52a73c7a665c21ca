"""PPO on Atari with a convolutional network (CleanRL's ``ppo_atari.py`` details).

The Nature-DQN encoder (Mnih et al., 2015: three convolutions, a 512-unit layer) shared by a
policy and a value head; 8 environments x 128 steps, 4 epochs of 4 minibatches, clip 0.1, the
learning rate annealed to 0, rewards clipped to [-1, 1] for learning. The game comes from
``ff.envs.atari`` (84x84 grayscale, 4 stacked frames, frame skip 4; the ``atari`` extra). Reported
returns are the game's scores. Written the way the README tells users to write theirs: an
``nn.Module`` and a ``torch.optim`` optimizer in versioned state, fragments for acting and learning::

    fragflow run algorithms/ppo_atari.py --set env_id=ALE/Breakout-v5
    fragflow run algorithms/ppo_atari.py --policy "actor_learner(actors=2)"
    fragflow run algorithms/ppo_atari.py --set device=cuda                 # the network on a GPU
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import fragflow as ff


@dataclass(frozen=True)
class Args:
    env_id: str = "ALE/Breakout-v5"
    seed: int = 1
    total_timesteps: int = 10_000_000
    """environment steps (agent decisions; each is 4 emulator frames)"""
    num_envs: int = 8
    num_steps: int = 128
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.1
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    device: str = "cpu"
    """torch device of the network ("cuda": learning and acting on a GPU; every process that acts
    holds its own copy there)"""

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // (self.num_envs * self.num_steps)


def layer(module: nn.Module, std: float = math.sqrt(2)) -> nn.Module:
    nn.init.orthogonal_(module.weight, std)  # type: ignore[arg-type]
    nn.init.constant_(module.bias, 0.0)  # type: ignore[arg-type]
    return module


class Agent(nn.Module):
    def __init__(self, frames: int, num_actions: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            layer(nn.Conv2d(frames, 32, 8, stride=4)), nn.ReLU(),
            layer(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            # the 512-unit layer over the 64 7x7 maps, Linear(64 * 7 * 7, 512) after a flatten, computed
            # as a 7x7 convolution: the same weights (their orthogonal initialisation draws the same
            # numbers in the same order), the same products, summed in another order. On this CPU torch's
            # Linear runs through MKL's matrix product (its AVX2 path here), its convolutions through
            # oneDNN's AVX-512 kernels: this layer's forward and backward on a minibatch of 256 frames
            # took 13.9 ms against 25.7 ms, a whole minibatch step 85 ms against 98
            layer(nn.Conv2d(64, 512, 7)), nn.ReLU(), nn.Flatten())
        self.pi = layer(nn.Linear(512, num_actions), std=0.01)
        self.vf = layer(nn.Linear(512, 1), std=1.0)
        # channels-last: the convolutions' kernels run without reordering their inputs (a minibatch's
        # forward, backward and Adam step of 256 frames: 107 ms against 160 ms, one CPU thread); the
        # same arithmetic, summed in another order (torch's type stubs omit `to`'s memory_format)
        self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of every action and the value, from uint8 frames."""
        # (a copy divided in place: the same quotients as `/ 255.0`, one frame-sized float tensor fewer)
        frames = obs.contiguous(memory_format=torch.channels_last).to(torch.float32, copy=True)
        hidden = self.encoder(frames.div_(255.0))
        return torch.log_softmax(self.pi(hidden), -1), self.vf(hidden).squeeze(-1)


@ff.fragment("actor")
def act(model, obs, key):
    with torch.no_grad():
        logp, value = model(torch.as_tensor(obs, device=model.vf.weight.device))
    logp_np = logp.cpu().numpy()
    action = (logp_np + ff.random.gumbel(key, (logp_np.shape[-1],))).argmax(-1)
    return action, np.take_along_axis(logp_np, action[:, None], -1)[:, 0], value.cpu().numpy()


@ff.fragment("learner", writes="state")
def learn(state, batch, lr, args: Args):
    model, optimizer = state["model"], state["optimizer"]
    device = model.vf.weight.device
    for group in optimizer.param_groups:
        group["lr"] = float(lr)
    reward = np.asarray(batch["reward"], np.float32)
    value = np.asarray(batch["value"], np.float32)
    done = np.asarray(batch["done"], np.float32)
    with torch.no_grad():
        next_value = model(torch.as_tensor(batch["next_obs"], device=device))[1].cpu().numpy()
    adv = np.zeros_like(reward)
    last = np.zeros_like(next_value)
    for t in reversed(range(reward.shape[0])):   # GAE; done[t]: step t began a new episode
        nonterminal = 1.0 - (np.asarray(batch["next_done"], np.float32) if t == reward.shape[0] - 1 else done[t + 1])
        following = next_value if t == reward.shape[0] - 1 else value[t + 1]
        last = reward[t] + args.gamma * following * nonterminal - value[t] + args.gamma * args.gae_lambda * nonterminal * last
        adv[t] = last
    # the frames reordered channels-last once, not once a minibatch (a minibatch gathered from them keeps the order)
    obs = torch.as_tensor(batch["obs"], device=device).flatten(0, 1).contiguous(memory_format=torch.channels_last)
    b_action = torch.as_tensor(batch["action"], dtype=torch.int64, device=device).flatten()
    b_logp = torch.as_tensor(batch["logprob"], dtype=torch.float32, device=device).flatten()
    b_adv = torch.from_numpy(adv).to(device).flatten()
    b_value = torch.from_numpy(value).to(device).flatten()
    b_ret = b_adv + b_value
    n = obs.shape[0]
    size = n // args.num_minibatches
    key = state["key"]
    clipfrac = []
    for _ in range(args.update_epochs):
        key, sub = ff.random.split(key)
        order = torch.from_numpy(np.argsort(ff.random.uniform(sub, (n,))[0])).to(device)
        for start in range(0, n, size):
            mb = order[start:start + size]
            logp_all, newvalue = model(obs[mb])
            newlogp = logp_all.gather(-1, b_action[mb, None])[:, 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
            ratio = (newlogp - b_logp[mb]).exp()
            clipfrac.append(((ratio - 1).abs() > args.clip_coef).float().mean().item())
            mb_adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
            pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            v_clipped = b_value[mb] + (newvalue - b_value[mb]).clamp(-args.clip_coef, args.clip_coef)
            v_loss = 0.5 * torch.max((newvalue - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
            loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
    new_state = {"model": model, "optimizer": optimizer, "key": key}
    return new_state, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy.detach(),
                       "clipfrac": float(np.mean(clipfrac)), "learning_rate": float(lr)}


LEARNER_KEY_ID = 1 << 40   # an id no environment has: the learner's minibatch shuffling key


def train(args: Args):
    env = ff.envs.atari(args.env_id, num_envs=args.num_envs, seed=args.seed)
    torch.manual_seed(args.seed)
    model = Agent(env.single_observation_space.shape[0], int(env.single_action_space.n)).to(args.device)  # type: ignore[attr-defined,index]
    # fused=True: Adam's update in one kernel for all the parameters (0.8 ms a minibatch here, against 3.5 ms
    # for the default loop over them; equal to float rounding, not bit for bit)
    state = ff.versioned({"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=args.learning_rate,
                                                                        eps=1e-5, fused=True),
                          "key": ff.random.keys(args.seed, np.array([LEARNER_KEY_ID]))})
    buffer = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    done = np.zeros(env.num_envs, dtype=np.bool_)
    for update in range(args.num_updates):
        lr = args.learning_rate * (1.0 - update / args.num_updates if args.anneal_lr else 1.0)
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action, logprob, value = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, _info = env.step(action)
            buffer.add(obs=obs, done=done, action=action, logprob=logprob, value=value, reward=reward)
            obs, done = next_obs, terminated | truncated
        state, metrics = learn(state, buffer.collect(next_obs=obs, next_done=done), lr, args)
        ff.log(metrics)
    return state
