"""Proximal Policy Optimization (Schulman et al., 2017, https://arxiv.org/abs/1707.06347).

With the implementation details of CleanRL's ``ppo.py`` / ``ppo_continuous_action.py``
(Huang et al., "The 37 Implementation Details of PPO", ICLR Blog Track 2022): vectorized envs,
orthogonal init, Adam with eps=1e-5 and annealed learning rate, GAE, minibatch updates over
several epochs, advantage normalisation, clipped surrogate and clipped value loss, entropy bonus,
global gradient clipping, optional early stop on approximate KL. Discrete actions (categorical)
and continuous actions (diagonal Gaussian with state-independent log-std, with observation and
reward normalisation as CleanRL does for continuous control).

Runs three ways, unchanged::

    train(Args())                                                  # eagerly, plain Python
    ff.run(train, Args(), policy="single_process")                 # through fragflow
    fragflow run algorithms/ppo.py --set num_envs=8                # from the CLI

Episode boundaries follow CleanRL: a step whose episode ended (terminated or truncated) cuts the
GAE recursion (``done``); the environments autoreset in gymnasium's same-step mode (see
``fragflow.api.envs``), so no stored transition ever pairs an action with an observation it did not
produce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F

import fragflow as ff


@dataclass(frozen=True)
class Args:
    env_id: str = "CartPole-v1"
    """gymnasium environment id"""
    seed: int = 1
    """seed of environments, network initialisation and sampling"""
    total_timesteps: int = 500_000
    """total environment steps of the run"""
    learning_rate: float = 2.5e-4
    """Adam learning rate (annealed linearly to 0 when anneal_lr)"""
    num_envs: int = 4
    """parallel environments"""
    num_steps: int = 128
    """steps per environment per rollout"""
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    """stop the epoch loop early when the approximate KL exceeds this (None: never)"""
    hidden: int = 64
    """width of the two hidden layers of actor and critic"""
    normalize: bool | None = None
    """normalise observations and rewards (None: only for continuous actions, as CleanRL)"""
    invariant_acting: bool = False
    """act with batch-size-invariant arithmetic, so a run is bit-identical however a policy splits
    the environments across actor processes (costs about a third of acting speed); off, a run is
    still deterministic for a given seed and number of actors"""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size


# NETWORK: parameters are a plain dict of tensors, so they can be versioned and shipped.
def layer(gen: torch.Generator, n_in: int, n_out: int, std: float) -> dict[str, torch.Tensor]:
    w = torch.empty(n_out, n_in)
    torch.nn.init.orthogonal_(w, std, generator=gen)
    return {"w": w, "b": torch.zeros(n_out)}


def init_params(obs_dim: int, act_dim: int, continuous: bool, hidden: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    s2 = math.sqrt(2)
    params: dict[str, Any] = {
        "critic": [layer(gen, obs_dim, hidden, s2), layer(gen, hidden, hidden, s2), layer(gen, hidden, 1, 1.0)],
        "actor": [layer(gen, obs_dim, hidden, s2), layer(gen, hidden, hidden, s2), layer(gen, hidden, act_dim, 0.01)],
    }
    if continuous:
        params["logstd"] = torch.zeros(1, act_dim)
    return params


class _Tanh(torch.autograd.Function):
    """tanh as ``2 * sigmoid(2x) - 1``, with the derivative ``1 - tanh(x)**2``.

    torch's CPU ``tanh`` kernel is not vectorised, while ``sigmoid`` is: on a 2048 x 64 minibatch
    this form is about three times faster, and the activations are most of a small MLP's
    elementwise work. The result differs from ``torch.tanh`` by at most a few float32 ulps of 1.
    Below about 64 rows the extra kernel calls cost more than they save.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = _tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2).mul_(2).sub_(1)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid form where gradients flow (learning: large minibatches, where it is faster);
    ``torch.tanh`` for inference (acting: a row per environment, where one kernel call is faster)."""
    return _Tanh.apply(x) if x.requires_grad else torch.tanh(x)


def mlp(layers: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for lyr in layers[:-1]:
        x = tanh(F.linear(x, lyr["w"], lyr["b"]))
    return F.linear(x, layers[-1]["w"], layers[-1]["b"])


def evaluate(params: dict, obs: torch.Tensor, action: torch.Tensor):
    """log-prob and entropy of ``action`` under the policy, and the state value."""
    value = mlp(params["critic"], obs).squeeze(-1)
    out = mlp(params["actor"], obs)
    if "logstd" in params:
        logstd = params["logstd"].expand_as(out)
        dist = torch.distributions.Normal(out, logstd.exp(), validate_args=False)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), value
    logp_all = F.log_softmax(out, dim=-1)
    logp = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, value


# ACT: one inference step for every environment, in numpy: a row per environment is a few thousand
# multiply-adds, where each torch call costs microseconds of its own (numpy's calls cost a fraction
# of that: HalfCheetah's act for one env takes 40 us, 60 us in torch). The same float32 arithmetic as
# ``evaluate`` up to rounding. Sampling noise comes from per-environment keys, so environment i draws
# the same numbers wherever a policy places it.
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def as_numpy(tree: Any) -> Any:
    """The parameters' arrays, shared with the tensors (no copy)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy()
    if isinstance(tree, np.ndarray):
        return tree
    if isinstance(tree, dict):
        return {k: as_numpy(v) for k, v in tree.items()}
    return [as_numpy(v) for v in tree]


def linear_np(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return x @ w.T + b


def rowwise_linear_np(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x @ w.T + b`` with every row computed the same way whatever the batch size.

    Matrix-multiply kernels block differently for different batch sizes, which changes float
    rounding: one process acting for 8 environments would act slightly differently from two
    processes acting for 4 each. A stack of one-row products runs the same one-row product for
    every environment, so a run does not depend on how a policy splits the environments (tests
    check it).
    """
    return np.matmul(x[:, None, :], w.T)[:, 0] + b


def mlp_np(layers: list[dict[str, np.ndarray]], x: np.ndarray, linear=linear_np) -> np.ndarray:
    for lyr in layers[:-1]:
        x = np.tanh(linear(x, lyr["w"], lyr["b"]))
    return linear(x, layers[-1]["w"], layers[-1]["b"])


@ff.fragment("actor")
def act(params, obs, key, invariant: bool = False):
    linear = rowwise_linear_np if invariant else linear_np
    p = as_numpy(params)
    x = np.asarray(obs, dtype=np.float32)
    value = mlp_np(p["critic"], x, linear)[:, 0]
    out = mlp_np(p["actor"], x, linear)
    if "logstd" in p:
        logstd = np.broadcast_to(p["logstd"], out.shape)
        std = np.exp(logstd)
        action = out + std * ff.random.normal(key, (out.shape[-1],)).astype(np.float32)
        # the Normal's log-density, as torch.distributions.Normal computes it
        logprob = (-((action - out) ** 2) / (2 * std**2) - logstd - LOG_SQRT_2PI).sum(-1)
    else:
        # Gumbel-max: argmax(logits + Gumbel noise) is a sample of the categorical
        action = np.argmax(out + ff.random.gumbel(key, (out.shape[-1],)).astype(np.float32), axis=-1)
        shifted = out - out.max(-1, keepdims=True)
        logp_all = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        logprob = np.take_along_axis(logp_all, action[:, None], -1)[:, 0]
    return action, logprob, value


# LEARN: GAE, then update_epochs passes of minibatch Adam steps on the clipped PPO objective.
def adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
              betas=(0.9, 0.999), eps=1e-5) -> None:
    """In-place Adam (Kingma & Ba, 2015), the same arithmetic as torch.optim.Adam."""
    b1, b2 = betas
    c1, c2 = 1 - b1**step, 1 - b2**step
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = v.sqrt().div_(math.sqrt(c2)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / c1)


@ff.fragment("learner", writes="state")
def learn(state, batch, lr, args: Args):
    # parameters and Adam moments each live in one flat tensor (the tree's leaves are views of it),
    # so gradient clipping and Adam are a handful of operations, not a handful per tensor
    params, flat_params = flat_clone(state["params"])
    (m, flat_m), (v, flat_v) = flat_clone(state["m"]), flat_clone(state["v"])
    step = int(state["step"])
    leaves = tree_leaves(params)
    offsets = flat_layout(leaves)
    gamma, lam = float(args.gamma), float(args.gae_lambda)
    clip_coef = float(args.clip_coef)

    obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
    actions = torch.as_tensor(batch["action"])
    logprobs, values = torch.as_tensor(batch["logprob"]), torch.as_tensor(batch["value"])
    num_steps = obs.shape[0]

    # Generalized Advantage Estimation (Schulman et al., 2016, https://arxiv.org/abs/1506.02438)
    with torch.no_grad():
        next_obs = torch.as_tensor(batch["next_obs"], dtype=torch.float32)
        next_value = mlp(params["critic"], next_obs).squeeze(-1).numpy()
    v_np = np.asarray(values, dtype=np.float32)
    r_np = np.asarray(batch["reward"], dtype=np.float32)
    nonterminal = 1.0 - np.asarray(batch["done"], dtype=np.float32)
    next_nonterminal = 1.0 - np.asarray(batch["next_done"], dtype=np.float32)
    adv_np = np.zeros_like(r_np)
    lastgaelam = np.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal, nextvalues = next_nonterminal, next_value
        else:
            nextnonterminal, nextvalues = nonterminal[t + 1], v_np[t + 1]
        delta = r_np[t] + gamma * nextvalues * nextnonterminal - v_np[t]
        lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        adv_np[t] = lastgaelam
    advantages = torch.from_numpy(adv_np)
    returns = advantages + values

    b_obs = obs.reshape((-1,) + obs.shape[2:])
    b_actions = actions.reshape((-1,) + actions.shape[2:])
    b_logprobs, b_advantages = logprobs.reshape(-1), advantages.reshape(-1)
    b_returns, b_values = returns.reshape(-1), values.reshape(-1)
    batch_size = b_obs.shape[0]
    minibatch_size = batch_size // int(args.num_minibatches)

    key = state["key"]
    clipfracs = torch.zeros(())
    minibatches = 0
    for p in leaves:
        p.requires_grad_(True)      # updated in place under no_grad; the state we return has them off
    for _epoch in range(int(args.update_epochs)):
        key, sub = ff.random.split(key)
        b_inds = torch.from_numpy(np.argsort(ff.random.uniform(sub, (batch_size,))[0]))
        for start in range(0, batch_size, minibatch_size):
            mb = b_inds[start:start + minibatch_size]
            newlogprob, entropy, newvalue = evaluate(params, b_obs[mb], b_actions[mb])
            logratio = newlogprob - b_logprobs[mb]
            ratio = logratio.exp()
            with torch.no_grad():
                # http://joschu.net/blog/kl-approx.html
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs += ((ratio - 1.0).abs() > clip_coef).float().mean()
                minibatches += 1

            mb_adv = b_advantages[mb]
            if args.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)

            # clipped surrogate objective
            pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()

            # value loss, clipped around the old values
            newvalue = newvalue.view(-1)
            if args.clip_vloss:
                v_unclipped = (newvalue - b_returns[mb]) ** 2
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -clip_coef, clip_coef)
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
            else:
                v_loss = 0.5 * ((newvalue - b_returns[mb]) ** 2).mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - float(args.ent_coef) * entropy_loss + v_loss * float(args.vf_coef)

            grads = torch.autograd.grad(loss, leaves)
            with torch.no_grad():
                grad = flat_cat(list(grads), offsets)
                # global gradient clipping, as torch.nn.utils.clip_grad_norm_
                scale = torch.clamp(float(args.max_grad_norm) / (torch.linalg.vector_norm(grad) + 1e-6), max=1.0)
                grad.mul_(scale)
                step += 1
                adam_step(flat_params, grad, flat_m, flat_v, step, float(lr))

        if args.target_kl is not None:
            kl = approx_kl.clone()
            if ff.learners() > 1:   # several learners (multi_learner): all stop on their mean
                torch.distributed.all_reduce(kl)
                kl /= ff.learners()
            if kl > float(args.target_kl):
                break

    for p in leaves:
        p.requires_grad_(False)
    y_pred, y_true = b_values.numpy(), b_returns.numpy()
    var_y = np.var(y_true)
    explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
    new_state = {"params": params, "m": m, "v": v, "step": np.int64(step), "key": key}
    metrics = {
        "learning_rate": float(lr), "value_loss": v_loss.item(), "policy_loss": pg_loss.item(),
        "entropy": entropy_loss.item(), "old_approx_kl": old_approx_kl.item(), "approx_kl": approx_kl.item(),
        "clipfrac": clipfracs.item() / max(minibatches, 1), "explained_variance": float(explained_var),
    }
    return new_state, metrics


ALIGN = 16   # floats: each view starts on a 64-byte boundary, as a tensor of its own would


def flat_layout(leaves: list[torch.Tensor]) -> list[int]:
    """Offsets of ``leaves`` in a flat tensor, each aligned to ``ALIGN`` elements; the total last.

    Matrix kernels may round differently for differently aligned operands, so views at arbitrary
    offsets would act slightly differently from the same weights held anywhere else.
    """
    offsets, pos = [], 0
    for x in leaves:
        offsets.append(pos)
        pos += -(-x.numel() // ALIGN) * ALIGN
    return offsets + [pos]


def flat_clone(tree):
    """A copy of a tree of tensors whose leaves are views of one new flat tensor, and that tensor."""
    leaves = tree_leaves(tree)
    offsets = flat_layout(leaves)
    flat = torch.zeros(offsets[-1], dtype=leaves[0].dtype)
    views = [flat[o:o + x.numel()].view_as(x) for o, x in zip(offsets, leaves)]
    for view, x in zip(views, leaves):
        view.copy_(x)
    it = iter(views)
    return _map(lambda _: next(it), tree), flat


def flat_cat(tensors: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
    """``tensors`` laid out as :func:`flat_layout` says, zeros in the gaps, in one ``torch.cat``."""
    parts: list[torch.Tensor] = []
    for x, start, end in zip(tensors, offsets, offsets[1:]):
        parts.append(x.reshape(-1))
        if end - start > x.numel():
            parts.append(_GAP.to(x.dtype)[:end - start - x.numel()])   # a view: nothing allocated
    return torch.cat(parts)


_GAP = torch.zeros(ALIGN)


def tree_leaves(tree) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in tree_leaves(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in tree_leaves(v)]
    return [tree]


LEARNER_KEY_ID = 1 << 40   # an id no environment has: the learner's minibatch shuffling key


def init_state(env, args: Args) -> dict:
    obs_dim = int(np.prod(env.single_observation_space.shape))
    continuous = not hasattr(env.single_action_space, "n")
    act_dim = int(np.prod(env.single_action_space.shape)) if continuous else int(env.single_action_space.n)
    params = init_params(obs_dim, act_dim, continuous, args.hidden, args.seed)
    zeros = lambda t: torch.zeros_like(t)  # noqa: E731
    return {
        "params": params,
        "m": {k: _map(zeros, v) for k, v in params.items()},
        "v": {k: _map(zeros, v) for k, v in params.items()},
        "step": np.int64(0),
        "key": ff.random.keys(args.seed, np.array([LEARNER_KEY_ID])),
    }


def _map(fn, tree):
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(fn, v) for v in tree]
    return fn(tree)


def is_continuous(env_id: str) -> bool:
    try:   # (gymnasium imports a "module:Env-v0" id's module itself)
        probe = gym.make(env_id)
    except (gym.error.Error, ImportError):
        return False   # ff.envs.make reports the unknown id with the caller's line
    try:
        return isinstance(probe.action_space, gym.spaces.Box)
    finally:
        probe.close()


def train(args: Args):
    continuous = is_continuous(args.env_id)
    normalize = continuous if args.normalize is None else args.normalize
    env = ff.envs.make(args.env_id, num_envs=args.num_envs, seed=args.seed, clip_actions=continuous,
                       normalize_obs=normalize, normalize_reward=normalize, reward_gamma=args.gamma)
    agents = getattr(env, "num_agents", None)   # (a PettingZoo env's: an agent axis after the env axis)
    for_agents = f" for each of its {agents} agents, a PettingZoo env's (mappo.py acts for every agent)" if agents else ""
    if agents is not None or not (isinstance(env.single_observation_space, gym.spaces.Box)
                                  and len(env.single_observation_space.shape) == 1
                                  and isinstance(env.single_action_space, (gym.spaces.Discrete, gym.spaces.Box))):   # (what its networks take)
        raise ValueError(f"ppo.py acts on vector observations (a Box of one axis) in a Discrete or Box action space; "
                         f"{args.env_id} has {env.single_observation_space} observations and "
                         f"{env.single_action_space} actions{for_agents} (ppo_atari.py acts on Atari's frames)")
    state = ff.versioned(init_state(env, args))
    buffer = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)

    obs = env.reset()
    done = np.zeros(env.num_envs, dtype=bool)
    for update in range(args.num_updates):
        lr = args.learning_rate * (1.0 - update / args.num_updates if args.anneal_lr else 1.0)

        # ROLLOUT
        for _step in range(args.num_steps):
            key, sub = ff.random.split(key)
            action, logprob, value = act(state["params"], obs, sub, args.invariant_acting)
            next_obs, reward, terminated, truncated, _info = env.step(action)
            buffer.add(obs=obs, done=done, action=action, logprob=logprob, value=value, reward=reward)
            obs, done = next_obs, terminated | truncated

        # LEARN
        batch = buffer.collect(next_obs=obs, next_done=done)
        state, metrics = learn(state, batch, lr, args)   # args: configuration, sent once
        ff.log(metrics)
    return state
