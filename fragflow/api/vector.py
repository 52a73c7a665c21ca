"""The vector environment under ``ff.envs.make``: gymnasium's synchronous vector env in same-step
autoreset mode, each environment seeded by its global index, and the raw episode statistics kept
innermost (see ``fragflow.api.envs``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from fragflow.api import envcheck
from fragflow.errors import ConfigError
from fragflow.source import user_callsite


class EpisodeStats(gym.vector.VectorWrapper):
    """Accumulates raw episode returns and lengths; innermost, so reward wrappers do not touch them."""

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env)
        self.returns = np.zeros(env.num_envs, dtype=np.float64)
        self.lengths = np.zeros(env.num_envs, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []
        # SameStepVectorEnv's lean step returns an empty info exactly where no episode ended
        self._ended_in_info = isinstance(env, SameStepVectorEnv) and env._lean

    def reset(self, **kwargs: Any) -> Any:
        self.returns[:] = 0.0
        self.lengths[:] = 0
        return self.env.reset(**kwargs)

    def step(self, actions: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self.returns += reward
        self.lengths += 1
        if self._ended_in_info and not info:
            return obs, reward, terminated, truncated, info
        done = terminated | truncated
        if done.any():
            for i in np.flatnonzero(done):
                self.finished.append((float(self.returns[i]), int(self.lengths[i])))
            self.returns[done] = 0.0
            self.lengths[done] = 0
        return obs, reward, terminated, truncated, info


ARRAY_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


class SameStepVectorEnv(gym.vector.SyncVectorEnv):
    """gymnasium's synchronous vector env in same-step autoreset mode, with a leaner ``step`` for
    array spaces: the transitions it returns are the same, without the per-step bookkeeping of
    the general one (space iteration, copies, merged infos), which costs several times a
    CartPole step. ``info`` holds ``final_obs`` and its mask ``_final_obs`` when an episode ended."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], ids: Any) -> None:
        try:
            super().__init__(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)
        except RuntimeError:   # (gymnasium's, naming an option of its own)
            envs = getattr(self, "envs", [])
            odd = next(((i, kind) for kind in ("observation_space", "action_space") for i, env in enumerate(envs)
                        if getattr(env, kind) != getattr(envs[0], kind)), None)
            if odd is None:
                raise
            for env in envs:
                env.close()
            i, kind = odd
            raise ConfigError(f"the environments made have different spaces: environment {int(ids[i])}'s "
                              f"{kind} is {getattr(envs[i], kind)}, environment {int(ids[0])}'s "
                              f"{getattr(envs[0], kind)}", where=user_callsite(),
                              fix="give every copy the same observation and action spaces (from the constructor's "
                                  "arguments, not a random draw), or make environments of other spaces with an "
                                  "ff.envs.make call of their own") from None
        self.ids = [int(i) for i in ids]   # each environment's index in the whole run (what messages name)
        self._lean = isinstance(self.single_observation_space, ARRAY_SPACES) and \
            isinstance(self.single_action_space, ARRAY_SPACES)
        if not self._lean:   # (gymnasium's step batches these: what the lean step checks, checked per env)
            self.envs = [_Checked(env, self, i) for i, env in enumerate(self.envs)]

    def reset(self, **kwargs: Any) -> Any:
        try:
            out = super().reset(**kwargs)
            if self._lean:   # (gymnasium's batching stores integers out of the dtype's range wrapped)
                for i, o in enumerate(self._env_obs):
                    self._fits(i, o, self._observations.dtype, self._observations.shape[1:])
            return out
        except (ValueError, TypeError, AssertionError, KeyError, IndexError) as exc:
            misfit = self._misfit(exc, "reset")
            if misfit is exc:
                raise
            raise misfit from None

    def step(self, actions: Any) -> Any:
        if not self._lean:
            try:
                return super().step(actions)
            except (ValueError, TypeError, AssertionError, KeyError, IndexError) as exc:
                misfit = self._misfit(exc, "step")
                if misfit is exc:
                    raise
                raise misfit from None
        n = self.num_envs
        obs = np.empty_like(self._observations)
        rewards = np.empty(n, np.float64)
        terminated = np.empty(n, np.bool_)
        truncated = np.empty(n, np.bool_)
        info: dict[str, Any] = {}
        target, shape = obs.dtype, obs.shape[1:]
        for i, env in enumerate(self.envs):
            o, r, te, tr, _ = env.step(actions[i])
            if te or tr:
                dtype = getattr(o, "dtype", None)   # (the episode's last: final_obs)
                if dtype is None or dtype != target or np.shape(o) != shape:
                    self._fits(i, o, target, shape)
                if not info:
                    info = {"final_obs": np.full(n, None, dtype=object), "_final_obs": np.zeros(n, np.bool_)}
                info["final_obs"][i] = o
                info["_final_obs"][i] = True
                o, _ = env.reset()
            dtype = getattr(o, "dtype", None)
            if dtype is None or dtype != target or np.shape(o) != shape:
                self._fits(i, o, target, shape)
            obs[i] = o
            try:
                rewards[i], terminated[i], truncated[i] = r, te, tr
            except (TypeError, ValueError):   # (numpy 2 stores no array of one number as an element)
                rewards[i], terminated[i], truncated[i] = (envcheck.one_number(env, x, what) for x, what in
                                                           ((r, "reward"), (te, "terminated flag"), (tr, "truncated flag")))
        return obs, rewards, terminated, truncated, info

    def _fits(self, i: int, o: Any, target: np.dtype, shape: tuple[int, ...]) -> None:
        """Refuse an observation the batch cannot store as it is: of another shape (assigning would
        broadcast it), of a dtype storing would truncate (1.5 in a Discrete space was stored as 1),
        or integers out of the space's dtype's range (300 in an int8 space wrapped to 44)."""
        dtype = getattr(o, "dtype", None)
        if not isinstance(dtype, np.dtype):   # (a list, a number, a tensor)
            dtype = np.asarray(o).dtype
        wraps = False
        if dtype != target and dtype.kind in "iu" and target.kind in "iu":
            limits, values = np.iinfo(target), np.asarray(o)
            wraps = values.size > 0 and (values.min() < limits.min or values.max() > limits.max)
        if wraps or (dtype != target and not np.can_cast(dtype, target, "same_kind")):
            raise ConfigError(f"environment {self.ids[i]} returned an observation of dtype {dtype}"
                              + (f" with values out of {target}'s range" if wraps else "") + ", but its observation "
                              f"space {self.single_observation_space} holds {target}: storing it would truncate or "
                              "wrap its values", where=user_callsite(),
                              fix="return observations of the space's dtype, or declare the space the env returns")
        if np.shape(o) != shape:   # (assigning would broadcast it silently)
            raise ConfigError(f"environment {self.ids[i]} returned an observation of shape {np.shape(o)}, but its "
                              f"observation space {self.single_observation_space} has shape {shape}",
                              where=user_callsite(),
                              fix="return observations of the space's shape, or declare the space the env returns")

    def _parts_fit(self, i: int, o: Any, space: Any, path: str) -> None:
        """Refuse an integer part of a Dict or Tuple observation whose values its dtype would wrap."""
        if isinstance(space, gym.spaces.Dict) and isinstance(o, dict):
            for key, sub in space.spaces.items():
                if key in o:
                    self._parts_fit(i, o[key], sub, f"{path}[{key!r}]")
        elif isinstance(space, gym.spaces.Tuple) and isinstance(o, (tuple, list)):
            for k, (sub, part) in enumerate(zip(space.spaces, o)):
                self._parts_fit(i, part, sub, f"{path}[{k}]")
        elif isinstance(space, (gym.spaces.Box, gym.spaces.MultiBinary, gym.spaces.MultiDiscrete)) and \
                space.dtype is not None and space.dtype.kind in "iu":
            values = np.asarray(o)
            if values.dtype.kind in "iu" and values.dtype != space.dtype and values.size:
                limits = np.iinfo(space.dtype)
                if values.min() < limits.min or values.max() > limits.max:
                    raise ConfigError(f"environment {self.ids[i]} returned an observation whose part {path} holds "
                                      f"values out of {space.dtype}'s range ({values.min()} .. {values.max()}), but "
                                      f"its subspace {space} holds {space.dtype}: storing it would wrap them",
                                      where=user_callsite(),
                                      fix="return observations within the space's dtype, or declare the space the env "
                                          "returns")

    def _misfit(self, exc: BaseException, call: str) -> BaseException:
        """The error an observation that does not fit the space raised where gymnasium batches the
        environments' observations (its own step and reset): what it means and how to fix it. Any
        other error (the environment's own) is returned as it is, to be raised."""
        tb, batching = exc.__traceback__, False
        while tb is not None:
            batching = batching or tb.tb_frame.f_code.co_filename.endswith(_BATCHING)
            tb = tb.tb_next
        if not batching:
            return exc
        why = f"it lacks the key {exc}" if isinstance(exc, KeyError) else \
            "it has fewer parts than the Tuple" if isinstance(exc, IndexError) else f"{type(exc).__name__}: {exc}"
        return ConfigError(f"an environment's {call} returned an observation that does not fit its observation "
                           f"space {self.single_observation_space} ({why})",
                           where=user_callsite(),
                           fix="return observations of the space's shape (for a Dict or Tuple space, each part of "
                               "its own subspace's), or declare the space the env returns")


class _Checked(gym.Wrapper):
    """Around each environment of a vector env whose spaces gymnasium batches itself (a Dict or a
    Tuple): a step's reward or flag given as an array of one number is that number, as the lean
    step takes it (numpy refused it as "setting an array element with a sequence"), and integers
    out of an integer part's dtype are refused (the batch stored 300 in an int8 part as 44)."""

    _fragflow_own = True   # (not one of the user's wrappers: their checkpoint keys count theirs only)

    def __init__(self, env: gym.Env, vec: SameStepVectorEnv, i: int) -> None:
        super().__init__(env)
        self._vec, self._i = vec, i

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self._vec._parts_fit(self._i, obs, self.env.observation_space, "")
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        if not isinstance(reward, (int, float)):
            reward = envcheck.one_number(self.env, reward, "reward")
        if not isinstance(terminated, bool):
            terminated = bool(envcheck.one_number(self.env, terminated, "terminated flag"))
        if not isinstance(truncated, bool):
            truncated = bool(envcheck.one_number(self.env, truncated, "truncated flag"))
        self._vec._parts_fit(self._i, obs, self.env.observation_space, "")
        return obs, reward, terminated, truncated, info


# where gymnasium's vector env puts the environments' observations into one batch
_BATCHING = (os.path.join("gymnasium", "vector", "utils", "space_utils.py"),)
