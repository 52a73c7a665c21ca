"""Observation and reward normalisation for ``ff.envs.make(normalize_obs=, normalize_reward=)``:
running statistics kept per environment, saved with the env's ``state_dict``; and the clipping of
continuous actions for ``clip_actions=True``."""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np


class RunningMeanStd:
    """Running mean and variance of each environment's own values, one new value per environment
    per update (Chan et al.'s parallel update for a batch of one), as a gymnasium normalisation
    wrapper on each environment keeps them."""

    def __init__(self, num_envs: int, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros((num_envs, *shape), np.float64)
        self.var = np.ones((num_envs, *shape), np.float64)
        self.count = np.full(num_envs, 1e-4)

    def update(self, x: np.ndarray, rows: Any = slice(None)) -> None:
        """One new value of each environment in ``rows`` (all of them by default)."""
        mean, var = self.mean[rows], self.var[rows]
        count = self.count[rows].reshape(-1, *([1] * (self.mean.ndim - 1)))
        delta, total = x - mean, count + 1.0
        self.mean[rows] = mean + delta / total
        self.var[rows] = (var * count + delta**2 * count / total) / total
        self.count[rows] = self.count[rows] + 1.0


class ClipActions(gym.vector.VectorActionWrapper):
    """gymnasium's ``ClipAction`` on a vector env, in one numpy call for the batch: each action clipped
    to the Box's bounds, the wrapped space unbounded (as gymnasium's). gymnasium's vector form clips
    each environment's action apart and joins them again (HalfCheetah's one action: 5.0 us against
    1.9 us); the clipped actions are the same."""

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env)
        space = env.single_action_space
        assert isinstance(space, gym.spaces.Box)   # (make refuses another space with the fix)
        self._low, self._high, self._dtype = space.low, space.high, space.dtype
        self.single_action_space = gym.spaces.Box(-np.inf, np.inf, space.shape, space.dtype)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, env.num_envs)

    def actions(self, actions: Any) -> Any:
        a, shape = np.asarray(actions), (self.num_envs, *self._low.shape)
        if a.shape != shape and a.size == math.prod(shape):
            a = a.reshape(shape)   # (as gymnasium's: Pendulum's [n] actions for [n, 1])
        return np.clip(a, self._low, self._high).astype(self._dtype, copy=False)


class Normalize(gym.vector.VectorWrapper):
    """Observation and reward normalisation as CleanRL's continuous PPO applies it: running
    statistics of each environment's own observations and discounted returns (its gymnasium
    wrappers wrap each environment), clipped to +-10, so that where the environments are stepped
    changes nothing. Written for same-step autoreset: gymnasium's own normalisation wrappers refuse
    that mode because they would leave ``final_obs`` unnormalised; here an environment's final
    observation updates its statistics and is normalised with them, then its reset observation, as a
    wrapper on the environment does."""

    def __init__(self, env: gym.vector.VectorEnv, obs: bool, reward: bool, gamma: float, clip: float = 10.0) -> None:
        super().__init__(env)
        n = env.num_envs
        self.obs_rms = RunningMeanStd(n, env.single_observation_space.shape or ()) if obs else None
        self.ret_rms = RunningMeanStd(n, ()) if reward else None
        self.returns = np.zeros(n)
        self.gamma, self.clip = gamma, clip
        # the last reset's raw observations and what it returned, until the next step (see restated)
        self._reset: tuple[np.ndarray, np.ndarray] | None = None
        space = env.single_observation_space
        # z-scores of integer observations (images, counts) are floats: as gymnasium's NormalizeObservation
        floating = isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating)
        dtype: Any = space.dtype if floating else np.dtype(np.float32)
        self._dtype = dtype
        if obs and isinstance(space, gym.spaces.Box):   # (another space is refused by make)
            self.single_observation_space = gym.spaces.Box(-clip, clip, space.shape, dtype)
            self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, n)

    def _obs(self, obs: np.ndarray, update: bool, rows: Any = slice(None)) -> np.ndarray:
        if self.obs_rms is None:
            return obs
        if update:
            self.obs_rms.update(obs, rows)
        z = (obs - self.obs_rms.mean[rows]) / np.sqrt(self.obs_rms.var[rows] + 1e-8)
        return np.clip(z, -self.clip, self.clip).astype(self._dtype)

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)   # (the discounted returns run on, as gymnasium's NormalizeReward's)
        out = self._obs(obs, True)
        self._reset = (np.array(obs, copy=True), out) if self.obs_rms is not None else None
        return out, info

    def restated(self) -> None:
        """Statistics loaded (a resumed run's, from its checkpoint) after a reset and before any step:
        the observations that reset returned, which the loop holds, normalised again with them, in
        place (they were normalised with the fresh statistics of a run's first lines)."""
        if self._reset is not None and self.obs_rms is not None:
            raw, out = self._reset
            z = (raw - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + 1e-8)
            out[...] = np.clip(z, -self.clip, self.clip).astype(self._dtype)

    def step(self, actions: Any) -> Any:
        self._reset = None
        obs, reward, terminated, truncated, info = self.env.step(actions)
        if "final_obs" in info and self.obs_rms is not None:   # (rewards alone: any observation space)
            mask = info["_final_obs"]
            info = dict(info, final_obs=info["final_obs"].copy())
            for i in np.flatnonzero(mask):   # as a wrapper on the env: its step's observation, then its reset's
                info["final_obs"][i] = self._obs(info["final_obs"][i][None], True, slice(i, i + 1))[0]
        obs = self._obs(obs, True)
        if self.ret_rms is not None:
            self.returns = self.returns * self.gamma * (1 - terminated) + reward
            self.ret_rms.update(self.returns)
            reward = np.clip(reward / np.sqrt(self.ret_rms.var + 1e-8), -self.clip, self.clip)
        return obs, reward, terminated, truncated, info
