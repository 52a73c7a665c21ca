"""Environments as fragments: gymnasium vector environments with role ``env``.

``ff.envs.make(env_id, num_envs, seed)`` returns a :class:`VectorEnv` whose ``reset`` and
``step`` are fragments. Under a policy that replicates the acting side, each process steps a
slice of the environments (``env.ids`` holds their global indices); environment ``i`` is always
seeded with ``seed + i``, wherever it runs.

Autoreset: gymnasium's **same-step** mode. When an episode ends at step ``t`` the observation
returned by ``step`` is already the first observation of the next episode, and the last
observation of the finished episode is in ``info["final_obs"]`` (equal to ``obs`` for
environments that did not finish). No transition is ever made of an action the environment
ignored, unlike gymnasium's default next-step mode, where the step after an episode's end
ignores its action and a naive buffer stores that phantom transition.

Episode returns and lengths are measured on the environment's rewards before ``clip_rewards`` and
``normalize_reward``; wrappers passed in ``wrappers=`` are part of the environment (a TimeLimit
there ends its episodes, a reward wrapper there changes the returns reported).

PettingZoo parallel environments (``ff.envs.make("mpe2:simple_spread_v3", num_envs=8)``, the
``multiagent`` extra) become a :class:`~fragflow.api.multiagent.MultiAgentVectorEnv`: the same fragments, with an ``agent``
axis after the ``env`` axis (``obs`` is ``[num_envs, num_agents, ...]``, ``reward`` and the done
flags ``[num_envs, num_agents]``). An env step is one step of one environment (all its agents);
every agent's episode is an episode, with that agent's return.

>>> env = make("CartPole-v1", num_envs=2, seed=0)
>>> obs = env.reset()
>>> obs.shape
(2, 4)
>>> obs, reward, terminated, truncated, info = env.step(np.zeros(2, dtype=np.int64))
>>> sorted(info)
['final_obs']
>>> env.close()
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from fragflow import context
from fragflow.api import envcheck
from fragflow.api import fragment as fragment_module
from fragflow.api.envids import EXTRA_HINT, aec_refused, atari_game, parallel_factory, registered
from fragflow.api.fragment import Fragment, rows
from fragflow.api.normalize import ClipActions, Normalize
from fragflow.api.vector import ARRAY_SPACES, EpisodeStats, SameStepVectorEnv
from fragflow.compiler.pytree import to_numpy
from fragflow.errors import ConfigError, TraceError, UnknownEnvError
from fragflow.source import user_callsite


class EnvCount(int):
    """A training env's ``num_envs``: the environments this process steps. Given to a fragment that
    a policy serves with several processes' environments merged (an actor under
    ``central_inference``), it is their sum there, as the merged rows are."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return EnvCount, (int(self),)


def _statistics(rms: Any) -> dict[str, np.ndarray]:
    """A running mean and variance's numbers as a checkpoint keeps them."""
    return {"mean": np.asarray(rms.mean), "var": np.asarray(rms.var), "count": np.asarray(rms.count)}


class VectorEnv:
    """A batch of gymnasium environments stepped as one fragment call.

    ``step(actions)`` returns ``(obs, reward, terminated, truncated, info)`` with numpy arrays of
    leading dimension ``num_envs`` and ``info = {"final_obs": ...}`` (see the module docstring).
    """

    slices_itself = True   # it steps only this process's environments (``ids``)

    def __init__(self, env_id: str | Callable[..., gym.Env], num_envs: int, seed: int, *, ids: np.ndarray, name: str,
                 clip_actions: bool = False, normalize_obs: bool = False,
                 normalize_reward: bool = False, reward_gamma: float = 0.99, evaluation: bool = False,
                 env_kwargs: dict[str, Any] | None = None, wrappers: tuple[Callable[[gym.Env], gym.Env], ...] = (),
                 clip_rewards: bool = False) -> None:
        self._identify(env_id if isinstance(env_id, str) else getattr(env_id, "__qualname__", repr(env_id)),
                       num_envs, seed, ids, name)
        kwargs = dict(env_kwargs or {})
        factory: Callable[..., gym.Env] = functools.partial(gym.make, env_id) if isinstance(env_id, str) else env_id
        base = SameStepVectorEnv([functools.partial(envcheck.wrapped, factory, kwargs, wrappers)] * self.num_envs, self.ids)
        odd = _unbatched_part(base.single_observation_space)
        if odd is not None:
            base.close()
            raise ConfigError(f"the environment's observation space holds a {type(odd).__name__} space ({odd}), whose "
                              "observations are not arrays of a fixed shape: they cannot be batched, split across "
                              "processes or stored", where=user_callsite(),
                              fix="encode the observation as a Box, Discrete, MultiDiscrete or MultiBinary (or a Dict "
                                  "or Tuple of them) in a wrapper of your env (wrappers=[...]): pad or flatten it")
        self._stats = EpisodeStats(base)
        self._structured_actions = isinstance(base.single_action_space, (gym.spaces.Dict, gym.spaces.Tuple))
        env: gym.vector.VectorEnv = self._stats
        if clip_rewards:   # outside the episode statistics: returns are reported on the raw rewards
            env = gym.wrappers.vector.ClipReward(env, -1.0, 1.0)
        if clip_actions:
            if not isinstance(env.single_action_space, gym.spaces.Box):
                base.close()
                raise ConfigError(f"clip_actions clips continuous actions to the bounds of a Box action space, but "
                                  f"this environment's action space is {env.single_action_space}",
                                  where=user_callsite(),
                                  fix="leave clip_actions out, or clip the actions your actor returns yourself")
            env = ClipActions(env)
        # (what clip_actions clips against: numpy would broadcast an action of another shape to the Box's)
        self._clipped: tuple[int, ...] | None = env.single_action_space.shape if clip_actions else None
        if normalize_obs or normalize_reward:
            env = Normalize(env, normalize_obs, normalize_reward, reward_gamma)
        self._env = env
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        # (gymnasium's batched spaces, of this process's environments: `env.action_space.sample()`)
        self.observation_space = env.observation_space
        self.action_space = env.action_space
        self._action_dtype = self.single_action_space.dtype
        # (the shape each environment's action must have where nothing reshapes it: a discrete space's)
        space = self.single_action_space
        self._action_shape: tuple[int, ...] | None = tuple(space.shape or ()) if not clip_actions and isinstance(
            space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)) else None
        self._fragments(evaluation)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the environments: the running statistics of observation and
        reward normalisation, fragflow's (``normalize_obs``, ``normalize_reward``) and those of each
        environment's own wrappers (gymnasium's ``NormalizeObservation``, ``NormalizeReward``, given in
        ``wrappers=``); the environments themselves are reset on resume."""
        norm = getattr(self, "_env", None)
        out: dict[str, Any] = {}
        if isinstance(norm, Normalize):
            for key, rms in (("obs_rms", norm.obs_rms), ("ret_rms", norm.ret_rms)):
                if rms is not None:
                    out[key] = _statistics(rms)
        wrapped = {key: _statistics(rms) for key, rms in self._wrappers_statistics().items()}
        if wrapped:
            out["wrappers"] = wrapped
        return out

    def _wrappers_statistics(self) -> dict[str, Any]:
        """The running statistics (gymnasium's ``RunningMeanStd``) the wrappers of each of this
        process's environments hold, by environment, wrapper depth and attribute."""
        from gymnasium.wrappers.utils import RunningMeanStd

        found: dict[str, Any] = {}
        base = getattr(getattr(self, "_stats", None), "env", None)
        for i, env in enumerate(getattr(base, "envs", ())):
            depth = 0
            while isinstance(env, gym.Wrapper):
                if getattr(env, "_fragflow_own", False):   # (the vector env's checks, not the user's: not counted)
                    env = env.env
                    continue
                for attr, value in vars(env).items():
                    if isinstance(value, RunningMeanStd):
                        found[f"env{i}_wrapper{depth}_{type(env).__name__}_{attr}"] = value
                env, depth = env.env, depth + 1
        return found

    def load_state_dict(self, state: dict[str, Any]) -> None:
        norm = getattr(self, "_env", None)
        for key in ("obs_rms", "ret_rms"):
            rms = getattr(norm, key, None) if isinstance(norm, Normalize) else None
            if (key in state) != (rms is not None):
                raise ValueError(f"the saved environments {'had' if key in state else 'had no'} {key} statistics "
                                 "(normalize_obs / normalize_reward differ)")
            if rms is not None:
                saved = state[key]
                if np.shape(saved["mean"]) != np.shape(rms.mean) or np.shape(saved["count"]) != np.shape(rms.count):
                    raise ValueError(f"{key} was saved for {np.shape(saved['count'])[:1] or 'all'} environments with "
                                     f"values of shape {np.shape(saved['mean'])[1:]}, these are "
                                     f"{np.shape(rms.count)[0]} with {np.shape(rms.mean)[1:]} (one set of statistics "
                                     "per environment)")
                rms.mean, rms.var = np.asarray(saved["mean"]), np.asarray(saved["var"])
                rms.count = np.asarray(saved["count"], np.float64)
        wrapped, saved_wrapped = self._wrappers_statistics(), state.get("wrappers", {})
        if set(wrapped) != set(saved_wrapped):
            raise ValueError(f"the saved environments' wrappers held running statistics {sorted(saved_wrapped)}, "
                             f"these hold {sorted(wrapped)} (the wrappers given differ)")
        for key, rms in wrapped.items():
            saved = saved_wrapped[key]
            if np.shape(saved["mean"]) != np.shape(rms.mean):
                raise ValueError(f"{key} was saved with values of shape {np.shape(saved['mean'])}, these are "
                                 f"{np.shape(rms.mean)}")
            rms.mean, rms.var = np.array(saved["mean"], np.float64), np.array(saved["var"], np.float64)
            rms.count = float(np.asarray(saved["count"]).reshape(-1)[0])
        if isinstance(norm, Normalize):   # (a resumed loop's observations from its first lines' reset)
            norm.restated()

    def _identify(self, label: str, num_envs: int, seed: int, ids: np.ndarray, name: str) -> None:
        self.env_id = label
        self.seed = int(seed)
        self._seeded = False   # (its first reset seeds it)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.num_envs: int = EnvCount(len(self.ids))
        self.total_envs = num_envs
        self.name = name

    def _fragments(self, evaluation: bool) -> None:
        """``reset`` and ``step`` as env fragments: rows per environment in and out, env events."""
        self.evaluation = evaluation
        if evaluation:   # (not split across processes: a count like any other)
            self.num_envs = int(self.num_envs)
        self.reset = Fragment(self._reset, "env", name=f"{self.name}.reset", instance=self, axes=rows,
                              evaluation=evaluation)
        self.step = Fragment(self._step, "env", name=f"{self.name}.step", instance=self, axes=rows,
                             events=self._events, evaluation=evaluation, in_axes=rows)

    def _events(self, out: Any) -> tuple[int, list[tuple[float, int]]]:
        return self.num_envs, (self.pop_finished() if self._stats.finished else [])

    @property
    def finished_episodes(self) -> list[tuple[float, int]]:
        """(return, length) of every episode finished so far, in order of completion."""
        return self._stats.finished

    def pop_finished(self) -> list[tuple[float, int]]:
        done = self._stats.finished
        self._stats.finished = []
        return done

    def _reset(self) -> np.ndarray:
        # seeded at the first reset only, as gymnasium's: a later one (an evaluation env's, each round)
        # goes on with each environment's generator, to new episodes, not the first ones again
        seeds = None if self._seeded else [int(self.seed) + int(i) for i in self.ids]
        self._seeded = True
        obs, _ = self._env.reset(seed=seeds)  # type: ignore[arg-type]  # vector envs take one seed per env
        return obs

    def _step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        if self._structured_actions:
            return self._finish(self._env.step(self._structured(actions, self.single_action_space, "actions")))
        if actions is None:
            raise ConfigError(f"{self.name}.step got None for the actions", where=user_callsite(),
                              fix="give one action per environment; if an actor fragment made them, check that it "
                                  "returns them (a function without a return statement returns None)")
        a = to_numpy(actions)
        if a.dtype != object and (a.ndim == 0 or a.shape[0] != self.num_envs):
            raise ConfigError(
                f"{self.name}.step got {'one action' if a.ndim == 0 else f'{a.shape[0]} actions'} (shape "
                f"{a.shape}) for the {self.num_envs} environments this process steps",
                where=user_callsite(), fix="give one action per environment, a leading axis of env.num_envs; an "
                "actor that returns a Python list or number has no environment axis that a policy splitting the "
                "environments can split: return an array (np.asarray(...), a tensor)")
        if self._clipped is not None and a.shape[1:] != self._clipped and a.size != self.num_envs * math.prod(self._clipped):
            raise ConfigError(f"{self.name}.step got actions of shape {a.shape}, where each of its {self.num_envs} "
                              f"environments takes an action of shape {self._clipped} (clip_actions would broadcast "
                              "it to the Box's bounds)", where=user_callsite(),
                              fix=f"return one action of shape {self._clipped} per environment: an array of shape "
                                  f"({self.num_envs}, {', '.join(map(str, self._clipped))})")
        shape = self._action_shape
        if shape is not None and a.dtype != object and a.shape[1:] != shape:
            # (gymnasium's own refusal, an AssertionError naming no line, or none where another policy's
            # channel refused the actor's output first)
            space = self.single_action_space
            each = "an index" if isinstance(space, gym.spaces.Discrete) else f"an action of shape {shape}"
            raise ConfigError(f"{self.name}.step got actions of shape {a.shape}, where each of its {self.num_envs} "
                              f"environments takes {each} ({space}): an array of shape "
                              f"{(self.num_envs, *shape)}", where=user_callsite(),
                              fix="return one action per environment of the space's shape (a[:, 0] or a.squeeze(-1) "
                                  "for an axis of one too many; a.reshape(env.num_envs, ...) for a flat one)")
        if self._action_dtype is not None and a.dtype != self._action_dtype:
            a = self._cast(a, self._action_dtype, "actions")
        return self._finish(self._env.step(a))

    def _cast(self, a: np.ndarray, dtype: Any, what: str) -> np.ndarray:
        """Actions in the space's dtype; refused where that changes them (0.9 for a Discrete space
        became 0 and stepped on, as a probability or a logit given as the action would)."""
        out = a.astype(dtype)
        target = np.dtype(dtype)
        if a.dtype == object or np.can_cast(a.dtype, target, "safe") or (a.dtype.kind == "f" and target.kind == "f"):
            return out   # (float64 actions for a float32 Box: rounded, as gymnasium's own cast does)
        if not np.array_equal(out, a):
            bad = a.ravel()[np.flatnonzero(out.ravel() != a.ravel())[0]].item()
            raise ConfigError(f"{self.name}.step got {what} of dtype {a.dtype} ({bad!r} among them) for an action space "
                              f"of dtype {target} ({self.single_action_space}): casting would change them",
                              where=user_callsite(),
                              fix="give actions the space holds (for a Discrete space the chosen index, e.g. "
                                  "logits.argmax(-1) or a sample, not probabilities or logits)")
        return out

    def _structured(self, actions: Any, space: Any, path: str) -> Any:
        """A Dict or Tuple space's actions as gymnasium's vector env takes them: a dict (tuple) of
        batches, one row per environment, each leaf cast to its space's dtype."""
        if isinstance(space, gym.spaces.Dict):
            if not isinstance(actions, dict) or set(actions) != set(space.spaces):
                raise ConfigError(f"{self.name}.step got {path} of type {type(actions).__name__}"
                                  + (f" with keys {sorted(actions)}" if isinstance(actions, dict) else "")
                                  + f", but the action space is a Dict with keys {sorted(space.spaces)}",
                                  where=user_callsite(), fix="give a dict with one batch (a leading axis of "
                                  "env.num_envs) per key of the action space")
            return {k: self._structured(actions[k], s, f"{path}[{k!r}]") for k, s in space.spaces.items()}
        if isinstance(space, gym.spaces.Tuple):
            if not isinstance(actions, (tuple, list)) or len(actions) != len(space.spaces):
                raise ConfigError(f"{self.name}.step got {path} of type {type(actions).__name__}, but the action "
                                  f"space is a Tuple of {len(space.spaces)}", where=user_callsite(),
                                  fix="give a tuple with one batch (a leading axis of env.num_envs) per entry of the space")
            return tuple(self._structured(a, s, f"{path}[{i}]") for i, (a, s) in enumerate(zip(actions, space.spaces)))
        a = to_numpy(actions)
        if a.ndim == 0 or a.shape[0] != self.num_envs:
            raise ConfigError(f"{self.name}.step got {path} of shape {a.shape} for the {self.num_envs} environments "
                              "this process steps", where=user_callsite(),
                              fix="give each leaf of the action a leading axis of env.num_envs")
        return self._cast(a, space.dtype, path) if space.dtype is not None and a.dtype != space.dtype else a

    def _finish(self, stepped: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        obs, reward, terminated, truncated, info = stepped
        final = obs
        if "_final_obs" in info:
            mask = info["_final_obs"]
            if isinstance(obs, np.ndarray):
                final = obs.copy()
                final[mask] = np.stack(info["final_obs"][mask])
            else:   # a Dict or Tuple space: the same, leaf by leaf
                ended = np.flatnonzero(mask)
                final = _set_rows(obs, [(int(i), info["final_obs"][i]) for i in ended])
        return obs, reward, terminated, truncated, {"final_obs": final}

    def render(self) -> tuple[Any, ...]:
        """Each environment's ``render()`` (of those this process steps, in ``ids`` order), as the env's
        ``render_mode`` makes it: a frame each for ``"rgb_array"`` (``ff.envs.make(..., render_mode=...)``)."""
        return tuple(self._env.render() or ())

    def close(self) -> None:
        self._env.close()

    def __repr__(self) -> str:
        return f"<VectorEnv {self.name}: {self.env_id} x{self.num_envs}>"


def _unbatched_part(space: Any) -> Any:
    """A part of an observation space whose observations gymnasium does not batch into arrays
    (Text, Sequence, Graph, OneOf), or None."""
    if isinstance(space, gym.spaces.Dict):
        return next((p for p in map(_unbatched_part, space.spaces.values()) if p is not None), None)
    if isinstance(space, gym.spaces.Tuple):
        return next((p for p in map(_unbatched_part, space.spaces) if p is not None), None)
    return None if isinstance(space, ARRAY_SPACES) else space


def _set_rows(batch: Any, rows: list[tuple[int, Any]]) -> Any:
    """A copy of ``batch`` (arrays with one row per environment, in dicts and tuples as a Dict or
    Tuple space makes them) with row ``i`` replaced by each ``(i, observation)``."""
    if isinstance(batch, dict):
        return {k: _set_rows(v, [(i, o[k]) for i, o in rows]) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_set_rows(v, [(i, o[j]) for i, o in rows]) for j, v in enumerate(batch))
    out = np.array(batch, copy=True)
    for i, o in rows:
        out[i] = o
    return out


_KNOWN_AT_IMPORT = frozenset(gym.registry)


def registered_by_user() -> dict[str, Any]:
    """Environment ids registered after fragflow was imported (by the algorithm file, or a package
    it imported). A worker process started by spawn has not run that code: the specs travel with
    the program and :func:`register` adds them there."""
    return {k: v for k, v in gym.registry.items() if k not in _KNOWN_AT_IMPORT}


def register(specs: dict[str, Any]) -> None:
    for env_id, spec in specs.items():
        if env_id not in gym.registry:
            gym.registry[env_id] = spec


def ids(num_envs: int) -> np.ndarray:
    """The global indices of the environments this process steps, out of ``num_envs``: all of them
    in one process, a slice where a policy splits the environments across actor processes. A
    user's own environment sizes itself with it (and seeds environment ``i`` with ``seed + i``).

    >>> ids(4)
    array([0, 1, 2, 3])
    """
    interp = context.current()
    if interp is None:
        return np.arange(num_envs)
    asked = getattr(interp, "asked_ids", None)   # the tracer notes that the program sizes its envs
    if asked is not None:
        asked(num_envs)
    return interp.env_ids(num_envs)


def make(env_id: str | Callable[..., gym.Env], num_envs: int = 1, seed: int = 0, *, clip_actions: bool = False,
         normalize_obs: bool = False, normalize_reward: bool = False, reward_gamma: float = 0.99,
         evaluation: bool = False, wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = (), clip_rewards: bool = False,
         **env_kwargs: Any) -> VectorEnv:
    """``num_envs`` copies of a gymnasium environment, seeded ``seed + i``, as an env fragment.

    ``env_id`` is a registered gymnasium id (``"CartPole-v1"``, ``"HalfCheetah-v5"``,
    ``"ale_py:ALE/Pong-v5"``), or a ``gymnasium.Env`` subclass or a function returning one (your own
    env, wrapped as you like); other keyword arguments go to the env's constructor, as with
    ``gymnasium.make``. A PettingZoo parallel environment (``"mpe2:simple_spread_v3"``, its module,
    or a function returning one) gives a :class:`~fragflow.api.multiagent.MultiAgentVectorEnv`.

    ``evaluation=True`` marks an environment whose episodes evaluate the policy: they are counted
    apart (``eval_episodes``, ``eval_return_mean``) and never mixed into the training returns or
    env steps. It is never split across actor processes.

    ``wrappers`` wrap each environment, innermost first (gymnasium wrappers, or functions of an
    env); ``clip_rewards`` clips rewards to [-1, 1] after the episode returns are measured (so
    reported returns are the game's). :func:`atari` puts the usual Atari preprocessing together.

    ``clip_actions`` clips continuous actions to the action space; ``normalize_obs`` and
    ``normalize_reward`` normalise with running statistics and clip to +-10, as CleanRL's
    continuous-action PPO does, with statistics of each environment's own (so where the
    environments are stepped, in one process or split across several, changes nothing);
    ``reward_gamma`` is the discount of the running return whose spread scales the rewards (as
    gymnasium's ``NormalizeReward``, it runs on across ``reset()`` and restarts where an episode
    terminates). Every other keyword, ``gamma`` included, is the environment's own.
    """
    where = user_callsite()
    if isinstance(num_envs, bool) or not isinstance(num_envs, numbers.Real) or not math.isfinite(num_envs) or \
            num_envs != int(num_envs):
        # ("2" failed as "'<' not supported between instances of 'str' and 'int'")
        raise ConfigError(f"ff.envs.make got num_envs={num_envs!r:.40}, where it takes a whole number", where=where,
                          fix="pass an int: num_envs=args.num_envs (a dataclass field holding it is annotated int)")
    if num_envs < 1:
        raise UnknownEnvError(f"num_envs must be at least 1, got {num_envs}", where=where,
                              fix="pass num_envs=1 or more")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):   # (None: gymnasium's unseeded)
        raise ConfigError(f"ff.envs.make got seed={seed!r}: environment i is seeded seed + i, so that a run "
                          "repeats", where=where, fix="give an int (seed=args.seed); for other episodes in each "
                                                      "run, draw one: seed=random.randrange(2**31)")
    if seed < 0:   # (gymnasium takes seeds from 0)
        raise ConfigError(f"ff.envs.make got seed={seed}: environment i is seeded seed + i, and gymnasium takes seeds "
                          "from 0 up", where=where, fix="give a seed of 0 or more")
    inside = fragment_module.running()
    if inside is not None and context.current() is not None:
        raise TraceError(f"ff.envs.make was called inside fragment '{inside.name}': it would make new "
                         "environments at every call, in whatever process runs the fragment", where=where,
                         fix="make the environments once, in the training function before its loop, and pass "
                             f"their observations to '{inside.name}'")
    wrappers = envcheck.wrapper_list(wrappers, where)
    if isinstance(env_id, str):
        env_id = registered(env_id, where)
    parallel = parallel_factory(env_id)
    if isinstance(env_id, types.ModuleType) and parallel is None and callable(getattr(env_id, "env", None)):
        raise aec_refused(f"the module {env_id.__name__}, of a PettingZoo AEC environment", where)
    if isinstance(env_id, gym.Env) and parallel is None:   # (one environment: it cannot make num_envs of them)
        spec = getattr(env_id, "spec", None)
        raise UnknownEnvError(f"ff.envs.make got an environment, {type(env_id.unwrapped).__name__}, where it takes what "
                              f"makes one: it makes num_envs={num_envs} environments, each seeded seed + i",
                              where=where, fix=(f"pass its id, ff.envs.make({spec.id!r}, ...), or " if spec is not None
                                                else "pass its class, or ") + "a function that makes it: "
                              "ff.envs.make(lambda: gym.make(...), ...) or ff.envs.make(lambda: MyEnv(...), ...); keyword "
                              "arguments of make go to the env")
    if parallel is None and not isinstance(env_id, str) and not callable(env_id):
        raise UnknownEnvError(f"ff.envs.make got {type(env_id).__name__} {env_id!r:.200} as the environment",
                              where=where, fix="pass a gymnasium id, a gymnasium.Env subclass, a function that returns "
                                               "a gymnasium.Env, or a PettingZoo parallel env")
    first: Any = None
    if parallel is None and not isinstance(env_id, str) and not (isinstance(env_id, type) and issubclass(env_id, gym.Env)):
        try:   # a factory: of a gymnasium env or of a PettingZoo parallel env?
            first = env_id(**env_kwargs)
        except TypeError as exc:   # (a keyword it does not take came out as a TypeError in fragflow's code)
            if not envcheck.about_kwargs(exc, env_kwargs):
                raise
            raise envcheck.unknown_kwargs(env_id, env_kwargs, exc, where) from None
        if hasattr(first, "agent_iter"):        # PettingZoo's AEC API: agents act in turn
            first.close()
            raise aec_refused(f"a PettingZoo AEC environment ({type(first).__name__})", where)
        if hasattr(first, "possible_agents"):
            parallel = env_id
        elif not isinstance(first, (gym.Env, gym.vector.VectorEnv)):
            close = getattr(first, "close", None)
            if callable(close):
                close()
            made = "is not a gymnasium.Env subclass" if isinstance(env_id, type) else \
                f"returned {type(first).__name__} {first!r:.60}, not a gymnasium.Env"
            raise UnknownEnvError(f"ff.envs.make got {getattr(env_id, '__qualname__', repr(env_id))}, which {made}",
                                  where=where,
                                  fix="subclass gymnasium.Env (with its observation_space and action_space) or return "
                                      "one from the function; an environment with another interface: decorate its "
                                      "reset and step with @ff.fragment(\"env\") and step it yourself")
        else:
            vector = isinstance(first, gym.vector.VectorEnv)
            first.close()
            first = None
            if vector:
                raise UnknownEnvError("ff.envs.make got a function that returns a vector env, where it makes the "
                                      "vector env itself", where=where,
                                      fix="pass a function that returns one environment (num_envs says how many)")
    if parallel is not None:
        given = [name for name, on in (("clip_actions", clip_actions), ("normalize_obs", normalize_obs),
                                       ("normalize_reward", normalize_reward), ("clip_rewards", clip_rewards),
                                       ("wrappers", bool(wrappers))) if on]
        if given:
            if first is not None:
                first.close()
            raise UnknownEnvError(f"ff.envs.make does not apply {', '.join(given)} to a PettingZoo environment",
                                  where=where, fix="wrap the parallel env yourself (pass a function that builds and "
                                                   "wraps it), or leave these options out")
        interp = context.current()
        ids = np.arange(num_envs) if interp is None or evaluation else interp.env_ids(num_envs)
        name = "env" if interp is None else interp.instance_name("eval_env" if evaluation else "env")
        label = getattr(env_id, "__name__", None) or getattr(env_id, "__qualname__", None) or repr(env_id)
        from fragflow.api.multiagent import MultiAgentVectorEnv

        try:
            menv = MultiAgentVectorEnv(parallel, num_envs, seed, ids=ids, name=name, label=label,
                                       evaluation=evaluation, env_kwargs=env_kwargs, first=first)
        except TypeError as exc:
            if not envcheck.about_kwargs(exc, env_kwargs):
                raise
            raise envcheck.unknown_kwargs(label, env_kwargs, exc, where, parallel=True) from None
        if interp is not None:
            interp.adopt(menv)
        return menv
    gym_env: Any = env_id
    interp = context.current()
    ids = np.arange(num_envs) if interp is None or evaluation else interp.env_ids(num_envs)
    name = "env" if interp is None else interp.instance_name("eval_env" if evaluation else "env")
    try:
        env = VectorEnv(gym_env, num_envs, seed, ids=ids, name=name, clip_actions=clip_actions,
                        normalize_obs=normalize_obs, normalize_reward=normalize_reward, reward_gamma=reward_gamma,
                        evaluation=evaluation, env_kwargs=env_kwargs, wrappers=wrappers,
                        clip_rewards=clip_rewards)
    except TypeError as exc:
        if not envcheck.about_kwargs(exc, env_kwargs):
            raise
        raise envcheck.unknown_kwargs(env_id, env_kwargs, exc, where) from None
    except gym.error.DependencyNotInstalled as exc:
        text = str(exc).lower()
        family = "mujoco" if "mujoco" in text else "ale_py" if ("atari" in text or "opencv" in text) else None
        raise UnknownEnvError(f"environment {env_id!r} needs a package that is not installed: {exc}", where=where,
                              fix=EXTRA_HINT[family] if family else "install the package the message names") from None
    space = env._stats.single_observation_space
    if normalize_obs and not isinstance(space, gym.spaces.Box):
        env.close()
        raise UnknownEnvError(f"normalize_obs keeps running statistics of one array of observations, but this "
                              f"environment's observation space is {space}", where=where,
                              fix="normalise the parts you need in a wrapper of your own (wrappers=[...]), or leave "
                                  "normalize_obs out")
    if interp is not None:
        interp.adopt(env)
    return env


def atari(env_id: str, num_envs: int = 1, seed: int = 0, *, frame_stack: int = 4, clip_rewards: bool = True,
          noop_max: int = 30, evaluation: bool = False, **env_kwargs: Any) -> VectorEnv:
    """An Atari game (the ``atari`` extra: ale-py) with the usual DQN/PPO preprocessing
    (Mnih et al., 2015; Machado et al., 2018): up to ``noop_max`` no-ops at reset, 4-frame skip with
    max-pooling, 84x84 grayscale, ``frame_stack`` stacked frames (observations ``uint8[frame_stack,
    84, 84]``), rewards clipped to [-1, 1] for learning while reported returns stay the game's.
    Episodes are whole games (no end of episode on a lost life); ALE v5's sticky actions stay on.

    >>> env = atari("ALE/Pong-v5", num_envs=2)          # doctest: +SKIP
    >>> env.reset().shape                                # doctest: +SKIP
    (2, 4, 84, 84)
    """
    where = user_callsite()
    if not isinstance(env_id, str):   # (it failed in fragflow's code: "argument of type 'function' is not iterable")
        raise ConfigError(f"ff.envs.atari got {getattr(env_id, '__name__', type(env_id).__name__)}, where it takes "
                          "an Atari game's id", where=where,
                          fix="pass the game's id ('ALE/Breakout-v5', 'BreakoutNoFrameskip-v4'); an env a function of "
                              "yours makes: ff.envs.make(fn, num_envs, seed, wrappers=[...], clip_rewards=True) with the "
                              "preprocessing you want (gym.wrappers.AtariPreprocessing, FrameStackObservation)")
    atari_game(env_id, where)
    for option, why, fix in (("frameskip", "its preprocessing skips 4 frames itself (ALE's own frame skip stays 1)",
                              "leave frameskip out; for another skip, make the env with ff.envs.make and your own "
                              "AtariPreprocessing(frame_skip=...) in wrappers=[...]"),
                             ("wrappers", "it applies its own preprocessing wrappers",
                              "leave wrappers out, or make the env with ff.envs.make(env_id, ..., wrappers=[...]) "
                              "and the preprocessing you want")):
        if option in env_kwargs:
            raise ConfigError(f"ff.envs.atari was given {option}=: {why}", where=user_callsite(), fix=fix)
    if env_kwargs.get("obs_type") == "ram":   # (gymnasium's preprocessing failed at the first reset, in its own code)
        raise ConfigError("ff.envs.atari was given obs_type='ram': its preprocessing works on the screen (84x84 "
                          "grayscale frames), not on the console's 128 bytes of RAM", where=user_callsite(),
                          fix=f"make the env with ff.envs.make({env_id!r}, num_envs, seed, obs_type='ram') and the "
                              "wrappers you want (wrappers=[...]), or leave obs_type out")
    if ":" not in env_id and env_id.startswith("ALE/"):
        env_id = f"ale_py:{env_id}"    # registers the ALE/ ids
    wrappers = [lambda e: gym.wrappers.AtariPreprocessing(e, noop_max=noop_max, frame_skip=4, screen_size=84),
                lambda e: gym.wrappers.FrameStackObservation(e, frame_stack)]
    return make(env_id, num_envs, seed, evaluation=evaluation, wrappers=wrappers, clip_rewards=clip_rewards,
                frameskip=1, **env_kwargs)
