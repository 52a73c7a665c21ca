"""What fragflow checks of a user's environment as ``ff.envs.make`` builds it: the wrappers it
is given, the keyword arguments its constructor takes, and its first reset and step against
gymnasium's API (one written for gym's old API is refused at its own method, naming what it
returned)."""

from __future__ import annotations

import inspect
import numbers
import os
import re
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import gymnasium as gym
import numpy as np

from fragflow.errors import ConfigError, UnknownEnvError
from fragflow.source import SourceLoc, definition_of, is_internal, user_callsite


def wrapped(factory: Callable[..., gym.Env], kwargs: dict[str, Any],
             wrappers: tuple[Callable[[gym.Env], gym.Env], ...]) -> gym.Env:
    env = factory(**kwargs)
    for wrap in wrappers:
        env = wrap(env)
    if isinstance(env, gym.Env):   # (outermost: a user's wrapper may adapt an env of gym's old API)
        check_spaces(env)
        check_api(env)
    return env


def check_spaces(env: gym.Env) -> None:
    """Refuse an environment without a gymnasium space as its observation_space or action_space (it
    failed in gymnasium's vector env, an AttributeError or TypeError from its code)."""
    for name in ("observation_space", "action_space"):
        space = getattr(env, name, None)
        if not isinstance(space, gym.spaces.Space):
            env.close()
            owner = type(env.unwrapped).__qualname__
            raise ConfigError(f"environment {owner} has " + (f"no {name}" if space is None else
                              f"{type(space).__name__} {space!r:.60} as its {name}, not a gymnasium space"),
                              where=_make_line(),
                              fix=f"set self.{name} in the env's __init__ (or as a class attribute) to a gymnasium "
                                  "space, e.g. gymnasium.spaces.Box(low, high, shape, dtype) or Discrete(n) (a Dict "
                                  "or Tuple of them for structured ones)")


def _make_line() -> SourceLoc | None:
    """The user's line that made the environments (``ff.envs.make``), past gymnasium's vector env."""
    frame: FrameType | None = sys._getframe(1)
    inside = f"{os.sep}gymnasium{os.sep}"
    while frame is not None and (is_internal(frame.f_code.co_filename) or inside in frame.f_code.co_filename):
        frame = frame.f_back
    return SourceLoc.of(frame.f_code.co_filename, frame.f_lineno) if frame is not None else None


def check_api(env: gym.Env) -> None:
    """Check the environment's first reset and step against gymnasium's API: one written for gym's
    old API (``reset()`` returning the observation alone, ``step`` returning ``obs, reward, done,
    info``) failed in the batching, with an unpacking error that seemed to be the loop's own line, or
    had an observation of five numbers unpacked as the step's five values. The checks are the
    instance's own ``reset`` and ``step`` until each has passed once, then removed: the class's
    methods run, with no call per step, and the environment is not wrapped (its attributes, its
    ``spec`` and ``isinstance`` are the user's)."""
    cls = type(env)

    def reset(*args: Any, **kwargs: Any) -> Any:
        try:
            params = inspect.signature(_defining(env, "reset")).parameters
        except (TypeError, ValueError):   # (a builtin's: nothing to check)
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            missing = [k for k in kwargs if k not in params]
            if missing:
                raise _refused(env, "reset", f"takes no {' or '.join(map(repr, missing))} keyword argument",
                               "take the arguments gymnasium's reset takes: def reset(self, seed=None, "
                               "options=None), calling super().reset(seed=seed) to seed self.np_random, and "
                               "return (obs, info)")
        out = cls.reset(env, *args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], dict):
            raise _refused(env, "reset", f"returned {_described(out[1])} as its info, where gymnasium's reset returns "
                                         "(obs, info) with info a dict",
                           "return the observation and an info dict (empty if there is nothing to report): "
                           "return obs, {}")
        if not (isinstance(out, tuple) and len(out) == 2):
            raise _refused(env, "reset", f"returned {_described(out)}, where gymnasium's reset returns (obs, info)",
                           "return the observation and an info dict: return obs, {}")
        seeded.append(kwargs.get("seed"))
        _check_seeded(env, seeded[0], "reset")
        _unpatch(env, "reset")
        return out

    def step(action: Any) -> Any:
        out = cls.step(env, action)
        if not (isinstance(out, tuple) and len(out) == 5):
            old = " (obs, reward, done, info: gym's old API)" if isinstance(out, tuple) and len(out) == 4 else ""
            raise _refused(env, "step", f"returned {_described(out)}{old}, where gymnasium's step returns 5 values: "
                                        "obs, reward, terminated, truncated, info",
                           "return obs, reward, terminated, truncated, info: done split into terminated (the "
                           "episode ended by the task's rules) and truncated (cut off, e.g. by a time limit)")
        # (stored into the batch's float and bool arrays, None became a NaN reward and a False flag, a
        # string '0.5' a reward and 'no' a True flag, with no error)
        for i, what, kind in ((1, "reward", "one number"), (2, "terminated flag", "a bool"),
                              (3, "truncated flag", "a bool")):
            if not a_number(out[i]):
                raise _refused(env, "step", f"returned {_described(out[i])} as its {what}, where gymnasium's step "
                                            f"returns {kind}", "return a float reward and bool terminated and "
                                            "truncated flags: return obs, reward, terminated, truncated, info")
        if not isinstance(out[4], dict):
            raise _refused(env, "step", f"returned {_described(out[4])} as its info, where gymnasium's step returns a "
                                        "dict", "return a dict (empty if there is nothing to report): "
                                                "return obs, reward, terminated, truncated, {}")
        if seeded:   # (a generator first drawn from at the step)
            _check_seeded(env, seeded[0], "reset")
        _unpatch(env, "step")
        return out

    seeded: list[Any] = []   # the seed the first reset was given

    try:
        env.reset = reset   # type: ignore[method-assign]
        env.step = step     # type: ignore[method-assign]
    except AttributeError:   # (__slots__, a read-only attribute: left unchecked)
        _unpatch(env, "reset")


def _check_seeded(env: gym.Env, seed: Any, method: str) -> None:
    """Refuse an environment that was given a seed at its first reset but draws from a
    ``self.np_random`` it never seeded (its reset does not call ``super().reset(seed=seed)``):
    gymnasium then makes the generator from fresh entropy, and the episodes differ from run to run,
    and between policies, silently. A generator the env seeds itself (``self._np_random = ...``, its
    own ``default_rng(seed)``) is its own business."""
    base = env.unwrapped
    made_with = getattr(base, "_np_random_seed", None)
    if seed is None or getattr(base, "_np_random", None) is None or not isinstance(made_with, int) or \
            made_with in (seed, -1):
        return
    raise _refused(env, method, f"was given seed={seed!r} but did not seed self.np_random, which the environment "
                                "draws from: gymnasium made it from fresh entropy, so each run (and each process "
                                "of a policy that splits the environments) would step other episodes",
                   "call super().reset(seed=seed) at the start of reset (it seeds self.np_random with environment "
                   "i's seed + i), and draw the environment's randomness from self.np_random")


def _unpatch(env: gym.Env, method: str) -> None:
    env.__dict__.pop(method, None)


def _defining(env: Any, method: str) -> Any:
    """The first implementation of ``method`` in the wrapper chain that is not gymnasium's own (a
    wrapper that only passes the call on): where the user wrote it."""
    e = env
    while True:
        fn = getattr(type(e), method, None)
        owner = getattr(fn, "__module__", "") or ""
        if fn is None or not owner.startswith("gymnasium") or not isinstance(getattr(e, "env", None), gym.Env):
            return fn
        e = e.env


def _refused(env: gym.Env, method: str, what: str, fix: str) -> ConfigError:
    fn = _defining(env, method)
    owner = getattr(fn, "__qualname__", "").rsplit(".", 1)[0] or type(env.unwrapped).__qualname__
    return ConfigError(f"environment {owner}'s {method} {what}", where=definition_of(fn) or user_callsite(), fix=fix)


def a_number(value: Any) -> bool:
    """One real number or flag: Python's, numpy's, or an array of one (a tensor's ``.item()`` need not be taken)."""
    if isinstance(value, numbers.Real):
        return True
    if value is None or isinstance(value, (str, bytes)):
        return False
    try:
        arr = np.asarray(value)
    except Exception:   # (what numpy cannot take in, the batch cannot store)
        return False
    return arr.size == 1 and arr.dtype.kind in "biuf"


def one_number(env: gym.Env, value: Any, what: str) -> Any:
    """A step's reward or flag that the batch could not store as it is: an array of one number (a
    tensor's, numpy's of shape ``(1,)``) as that number; anything else refused at the env's step
    (its first step's check passed, a later step returned it)."""
    if a_number(value):
        return np.asarray(value).item()
    raise _refused(env, "step", f"returned {_described(value)} as its {what}, where gymnasium's step returns "
                                f"{'one number' if what == 'reward' else 'a bool'}",
                   "return a float reward and bool terminated and truncated flags: return obs, reward, terminated, "
                   "truncated, info")


def _described(out: Any) -> str:
    if isinstance(out, tuple):
        return f"{len(out)} value{'s' if len(out) != 1 else ''}"
    if hasattr(out, "shape"):
        return f"an array of shape {tuple(out.shape)} ({type(out).__name__})"
    if out is None or isinstance(out, (str, bytes)):
        return repr(out) if len(repr(out)) <= 40 else f"a {type(out).__name__}"
    return f"a value of type {type(out).__name__}"


def about_kwargs(exc: TypeError, env_kwargs: dict[str, Any]) -> bool:
    """Whether a TypeError raised while making the environment is its constructor refusing keyword
    arguments given to make, rather than an error of the env's own code (``helper(b=2)`` in its
    ``__init__``, which was reported as the env not taking make's keywords)."""
    text = str(exc)
    if not env_kwargs or "keyword argument" not in text:
        return False
    named = re.findall(r"keyword argument '(\w+)'", text)
    return not named or any(name in env_kwargs for name in named)


def unknown_kwargs(env: Any, env_kwargs: dict[str, Any], exc: TypeError, where: Any,
                   parallel: bool = False) -> UnknownEnvError:
    # (make took gamma as normalize_reward's discount once: every keyword but its own is the env's now)
    renamed = "normalize_reward's discount is reward_gamma= (gamma= goes to the environment); " \
        if "gamma" in env_kwargs else ""
    if "max_episode_steps" in env_kwargs and parallel:
        renamed += ("max_episode_steps= is gymnasium.make's; a PettingZoo env takes its episode length as a keyword "
                    "of its own (max_cycles= for MPE and butterfly envs); ")
    elif "max_episode_steps" in env_kwargs and not isinstance(env, str):   # (gymnasium.make's, for an id)
        renamed += (f"max_episode_steps= is gymnasium.make's, for a registered id; limit your own env's episodes with "
                    f"wrappers=[lambda e: gym.wrappers.TimeLimit(e, {env_kwargs['max_episode_steps']!r})]; ")
    if not isinstance(env, str):
        env = getattr(env, "__qualname__", None) or env
    return UnknownEnvError(f"environment {env!r} does not take the keyword arguments given to ff.envs.make "
                           f"({', '.join(sorted(env_kwargs))}): {exc}", where=where,
                           fix=renamed + "pass only arguments the environment's constructor takes (options of "
                               "ff.envs.make itself: clip_actions, normalize_obs, normalize_reward, reward_gamma, "
                               "clip_rewards, wrappers, evaluation)")


def wrapper_list(wrappers: Any, where: Any) -> tuple[Callable[[gym.Env], gym.Env], ...]:
    """``wrappers`` as make applies them, or the error saying what it takes."""
    fix = ("give a list of wrapper classes or functions of an env, innermost first: "
           "wrappers=[gym.wrappers.RecordEpisodeStatistics, lambda e: gym.wrappers.TimeLimit(e, 500)]")
    if wrappers is None:   # (as gymnasium's own: none)
        return ()
    if callable(wrappers) or isinstance(wrappers, (gym.Env, str)) or not hasattr(wrappers, "__iter__"):
        raise ConfigError(f"ff.envs.make got wrappers={wrappers!r:.80}, where it takes a list", where=where, fix=fix)
    listed = tuple(wrappers)
    for w in listed:
        if isinstance(w, type) and issubclass(w, gym.vector.VectorWrapper):
            raise ConfigError(f"ff.envs.make got {w.__qualname__} in wrappers, a wrapper of vector envs, where each "
                              "environment is wrapped", where=where,
                              fix=f"give the per-environment gym.wrappers.{w.__name__} if there is one, or make's own "
                                  "options (normalize_obs, normalize_reward, clip_actions, clip_rewards)")
        if isinstance(w, gym.Env):
            raise ConfigError(f"ff.envs.make got {w!r:.80} among its wrappers: an environment, not a wrapper to "
                              "apply to each one it makes", where=where, fix=fix)
        if not callable(w):
            raise ConfigError(f"ff.envs.make got {w!r:.80} (of type {type(w).__name__}) among its wrappers: not a wrapper "
                              "class or a function of an env", where=where, fix=fix)
    return listed
