"""Which environment an id names: a registered gymnasium id (``"module:Env-v0"`` imports the module
first, as gymnasium does), a PettingZoo environment module (``"mpe2:simple_spread_v3"``), an Atari
game for :func:`fragflow.api.envs.atari`; and the refusals of what ``ff.envs.make`` cannot step
(a PettingZoo AEC env, an env whose package is missing), with the extra or package to install."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from fragflow.errors import ConfigError, UnknownEnvError, did_you_mean


def aec_refused(what: str, where: Any) -> UnknownEnvError:
    """The refusal of a PettingZoo AEC environment (its agents act in turn), with the fix."""
    return UnknownEnvError(f"ff.envs.make got {what}, whose agents act one at a time; it steps parallel "
                           "environments, where all agents act together", where=where,
                           fix="pass the module's parallel_env where it has one, or a function that wraps the AEC env "
                               "with pettingzoo.utils.conversions.aec_to_parallel (for games whose agents all act at "
                               "every step; a turn-based game such as tictactoe cannot be stepped that way)")


def atari_game(env_id: str, where: Any) -> None:
    """Refuse an id :func:`atari` cannot make: one of another family was refused for options the user
    never gave (CartPole's 'does not take frameskip', a PettingZoo env's 'does not apply wrappers')."""
    found = registered(f"ale_py:{env_id}" if ":" not in env_id and env_id.startswith("ALE/") else env_id, where)
    entry = getattr(gym.registry.get(found), "entry_point", None) if isinstance(found, str) else None
    if entry is not None and "ale_py" in (entry if isinstance(entry, str) else getattr(entry, "__module__", "") or ""):
        return
    raise ConfigError(f"ff.envs.atari makes Atari games (ale-py's), with their preprocessing, and {env_id!r} is not one",
                      where=where, fix=f"make it with ff.envs.make({env_id!r}, num_envs, seed) (for an Atari game, give "
                                       "its id: 'ALE/Breakout-v5', 'BreakoutNoFrameskip-v4')")


def parallel_factory(env_id: Any) -> Callable[..., Any] | None:
    """The ``parallel_env`` constructor of a PettingZoo environment module, or None."""
    factory = getattr(env_id, "parallel_env", None)
    return factory if callable(factory) else None


def registered(env_id: str, where: Any) -> Any:
    """The registered id (``module:Env-v0`` imports ``module`` first, as gymnasium does), or the
    PettingZoo environment module ``package:env_module`` names."""
    if env_id in gym.registry:
        return env_id
    namespace = env_id.split(":", 1)[0] if ":" in env_id else None
    if namespace is not None:   # "module:Env-v0" imports the module that registers it, as gymnasium does
        try:
            importlib.import_module(namespace)
        except ImportError as exc:
            raise UnknownEnvError(f"environment {env_id!r} needs the module {namespace!r}, which is not installed "
                                  f"({exc})", where=where, fix=EXTRA_HINT.get(namespace, f"pip install {namespace}")) from None
        if env_id.split(":", 1)[1] in gym.registry:
            return env_id.split(":", 1)[1]
        path = env_id.replace(":", ".")
        try:   # "mpe2:simple_spread_v3": a PettingZoo environment module of that package
            module = importlib.import_module(path)
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            if missing and missing != path and not path.startswith(f"{missing}."):   # (the module is there, not what it imports)
                sub = namespace.split(".")[1] if namespace.startswith("pettingzoo.") else None
                raise UnknownEnvError(f"environment {env_id!r} needs the package {missing!r}, which is not installed "
                                      f"({exc})", where=where,
                                      fix=f"pip install {missing}" + (f' (pip install "pettingzoo[{sub}]" installs '
                                                                     f"what PettingZoo's {sub} environments need)"
                                                                     if sub else "")) from None
            module = None
        if module is not None and parallel_factory(module) is not None:
            return module
        if module is not None and callable(getattr(module, "env", None)):   # a PettingZoo module of AEC envs only
            raise aec_refused(f"{env_id!r}, a PettingZoo AEC environment", where)
        package = importlib.import_module(namespace)
        if hasattr(package, "__path__"):   # a package of environment modules (mpe2, pettingzoo.butterfly): their names
            names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
            ours = [f"{namespace}:{n}" for n in names if n[-1].isdigit() and "_v" in n] + \
                [f"{namespace}:{k}" for k in gym.registry if k.startswith(f"{namespace}/")]
            if ours:
                raise UnknownEnvError(f"unknown environment id {env_id!r}: {namespace} has no environment "
                                      f"{env_id.split(':', 1)[1]!r}", where=where, fix=did_you_mean(env_id, ours))
    prefix = env_id.split("/", 1)[0]
    # ale-py registers its games when imported ("ale_py:ALE/Pong-v5" in gymnasium): ALE/ ids, and the
    # v0/v4 ids CleanRL and SB3 use ("BreakoutNoFrameskip-v4")
    try:
        importlib.import_module("ale_py")
    except ImportError:
        pass
    if env_id in gym.registry:
        return env_id
    # (the extra to install only where its family registered nothing: a typo in 'ALE/...' with
    # ale-py installed is a typo)
    hint = EXTRA_HINT.get(prefix) if "/" in env_id and not any(k.startswith(f"{prefix}/") for k in gym.registry) \
        else None
    raise UnknownEnvError(f"unknown environment id {env_id!r}", where=where,
                          fix=hint or did_you_mean(env_id.split(":", 1)[-1], gym.registry.keys()))


# the extra that registers an env family when it is missing
EXTRA_HINT = {"ale_py": 'pip install "fragflow[atari]"', "ALE": 'pip install "fragflow[atari]"',
               "mujoco": 'pip install "fragflow[mujoco]"', "mpe2": 'pip install "fragflow[multiagent]"',
               "pettingzoo": 'pip install "fragflow[multiagent]"'}
