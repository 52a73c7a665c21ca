"""The serial executor: the source of truth.

Runs the user's training loop in this process with every fragment called in order, exactly as an
eager call would, while versions are counted and environment steps, episodes and logged scalars
are reported to the run monitor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow import context
from fragflow.context import InstanceNames
from fragflow.envs import VectorEnv
from fragflow.errors import FragflowError, VersionedStateError
from fragflow.fragment import Fragment
from fragflow.runtime.monitor import Monitor
from fragflow.source import SourceLoc, user_callsite
from fragflow.versioned import Versioned, VersionedView


class SerialInterpreter:
    """Executes fragment calls directly (see :mod:`fragflow.context`)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.instance_name = InstanceNames()
        self._state_names = InstanceNames()
        self.resources: list[Any] = []

    def adopt(self, resource: Any) -> None:
        self.resources.append(resource)

    def close(self) -> None:
        for r in self.resources:
            r.close()
        self.resources.clear()

    def env_ids(self, num_envs: int) -> np.ndarray:
        return np.arange(num_envs)

    def versioned(self, value: Any, name: str, where: SourceLoc | None) -> Versioned:
        return Versioned(self._state_names(name), 0, value, where)

    def call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        role = frag.role
        if role == "logger":
            self.monitor.log(args[0] if args else kwargs)
            return None
        written: Versioned | None = None
        if frag.writes is not None:
            bound = frag.signature.bind(*args, **kwargs)
            handle = bound.arguments.get(frag.writes)
            if not isinstance(handle, Versioned):
                raise VersionedStateError(
                    f"learner '{frag.name}' writes '{frag.writes}', but that argument is not versioned state",
                    where=user_callsite(), fix=f"create it with ff.versioned(...) and pass it as '{frag.writes}'")
            written = handle
        args = tuple(_resolve(a) for a in args)
        if kwargs:
            kwargs = {k: _resolve(v) for k, v in kwargs.items()}
        try:
            out = frag.fn(*args, **kwargs)
        except FragflowError:
            raise
        except Exception as exc:
            exc.add_note(f"(while executing fragment '{frag.name}' called at {user_callsite()})")
            raise
        if role == "env":
            env = frag.instance
            if isinstance(env, VectorEnv) and frag is env.step:
                self.monitor.env_step(env.num_envs, env.pop_finished() if env.finished_episodes else [])
        elif written is not None:
            self.monitor.update()
            return (Versioned(written.name, written.version + 1, out[0], written.created_at), *out[1:])
        elif role == "learner":
            self.monitor.update()
        return out


def _resolve(x: Any) -> Any:
    if isinstance(x, Versioned):
        return x.value
    if isinstance(x, VersionedView):
        return x.resolve(x.handle.value)
    return x


_OWN = object()


def unwrap(value: Any, state: Any = _OWN) -> Any:
    """A training function's return value with versioned state replaced by its value: each
    handle's own latest value (serial), or ``state``, the learner's final state, for a value that
    came back from an actor process, where learner outputs the actor never saw (Pending) become None."""
    from fragflow.versioned import Pending

    if isinstance(value, Versioned):
        return value.value if state is _OWN else state
    if isinstance(value, VersionedView):
        return value.resolve(value.handle.value if state is _OWN else state)
    if isinstance(value, Pending):
        return None
    if isinstance(value, tuple):
        return tuple(unwrap(v, state) for v in value)
    if isinstance(value, list):
        return [unwrap(v, state) for v in value]
    if isinstance(value, dict):
        return {k: unwrap(v, state) for k, v in value.items()}
    return value


def execute(train: Callable[..., Any], args: tuple[Any, ...], monitor: Monitor) -> Any:
    """Run the loop under the serial interpreter; envs it made are closed however it ends."""
    interp = SerialInterpreter(monitor)
    try:
        with context.using(interp):
            return unwrap(train(*args))
    finally:
        interp.close()
