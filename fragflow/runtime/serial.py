"""The serial executor: the source of truth.

``single_process`` lowers to one loop group that serves every fragment here: the user's loop runs
in this process with every fragment called in order, exactly as an eager call would, while versions
are counted and environment steps, episodes and logged scalars go to the run monitor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fragflow import context
from fragflow.api.versioned import Pending, Versioned, VersionedView
from fragflow.lowering import LoopProgram
from fragflow.runtime import trips
from fragflow.runtime.checkpoint import RunCheckpoints, args_changed, changed_fields
from fragflow.runtime.loop import LoopInterpreter
from fragflow.runtime.monitor import Monitor
from fragflow.runtime.signals import shielded
from fragflow.runtime.snapshot import (
    drawn_apart,
    encode_states,
    held_by_state,
    loop_part,
    recomputed_message,
    resume_point,
    served_objects,
)


class MonitorReporter:
    """A loop's events straight into the monitor (one process)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.log_seq = 0

    def env_step(self, n: int, episodes: list[tuple[float, int]], evaluation: bool) -> None:
        if evaluation:
            for ret, length in episodes:
                self.monitor.eval_episode(ret, length)
        else:
            self.monitor.env_step(n, episodes)

    def loop_begins(self) -> None:
        self.monitor.loop_begins()

    def update(self) -> None:
        self.monitor.update()

    def log(self, scalars: dict[str, float], update: int | None = None, steps: int = 0,
            new_row: bool = False) -> None:
        self.monitor.log_scalars(scalars)

    def flush(self) -> None:
        pass

    def mark(self, update: int, call: int = -1) -> None:
        pass

    def logged(self, requests: list[tuple[str, int, int, str, str, int]], steps: int = 0,
               new_row: bool = False) -> None:
        pass


_OWN: dict[str, Any] = {}


def unwrap(value: Any, final: dict[str, Any] = _OWN) -> Any:
    """A training function's return value with versioned state replaced by its value: each
    handle's own value (serial), or ``final[name]``, the state a service group ended with, for a
    value that came back from a loop replica (where outputs it never saw, ``Pending``, become None)."""
    if isinstance(value, Versioned):
        return final.get(value.name, value.value) if final is not _OWN else value.value
    if isinstance(value, VersionedView):
        root = final.get(value.handle.name, value.handle.value) if final is not _OWN else value.handle.value
        return value.resolve(root)
    if isinstance(value, Pending):
        return None
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(unwrap(v, final) for v in value)
    if isinstance(value, list):
        return [unwrap(v, final) for v in value]
    if isinstance(value, dict):
        return {k: unwrap(v, final) for k, v in value.items()}
    return value


def interpreter(program: LoopProgram, monitor: Monitor, checks: dict[str, Any]) -> LoopInterpreter:
    """The interpreter that runs a loop here, every fragment served in this process."""
    return LoopInterpreter(program, MonitorReporter(monitor), checks=checks)


def execute(train: Callable[..., Any], args: tuple[Any, ...], monitor: Monitor, program: LoopProgram,
            checks: dict[str, Any], checkpoints: RunCheckpoints | None = None) -> Any:
    """Run the loop here, every fragment served in this process; envs it made are closed however it ends.

    With ``checkpoints`` the loop is checkpointed at the start of a top-level loop's trip once
    one is due, and resumed from the one it names (see :mod:`fragflow.runtime.checkpoint`)."""
    from fragflow.runtime.worker import threads, threads_for

    with threads(threads_for(program.threads)):   # (torch's and numpy's; put back however the run ends)
        interp = interpreter(program, monitor, checks)
        tracker = _checkpointing(interp, monitor, checkpoints, args) if checkpoints is not None else None
        previous = trips.install(tracker) if tracker is not None else None
        try:
            with context.using(interp):
                value = train(*args)
            with shielded():   # the run has completed: a signal now stops nothing, and its last checkpoint is written whole
                if checkpoints is not None and checkpoints.enabled:
                    checkpoints.commit(monitor.counters(), None, {"states": _states(interp)}, complete=True)
            return unwrap(value)
        finally:
            with shielded():   # (its environments closed whole, however the run ended)
                if tracker is not None:
                    trips.install(previous)
                interp.close()


def _states(interp: LoopInterpreter) -> tuple[Any, Any]:
    return encode_states({name: (h.version, h.value) for name, h in interp._states.items()})


def _checkpointing(interp: LoopInterpreter, monitor: Monitor, checkpoints: RunCheckpoints, args: Any = ()) -> trips.Trips:
    tracker = trips.Trips()
    if checkpoints.resume is not None:
        interp.restored = checkpoints.resumed_states()
        interp.changed_args = args_changed(checkpoints.resume, args[0]) if args else []
        interp.warn = monitor.warn
        said = (lambda changed: monitor.warn(recomputed_message(changed))) \
            if args and changed_fields(checkpoints.resume, args[0]) else None
        tracker.resume = resume_point(checkpoints.resume.part("loop0"), served_objects(checkpoints.resume),
                                      apart=drawn_apart(checkpoints.resume), recomputed=said)

    def on_update(_: int) -> None:
        if checkpoints.due(monitor.updates):
            tracker.pending = True

    def capture(snapshot: trips.Snapshot) -> None:
        position, part = loop_part(snapshot, held_by_state(interp._states))
        checkpoints.commit(monitor.counters(), {"replicas": 1, **position}, {"states": _states(interp), "loop0": part})
        if checkpoints.stop_after:
            raise KeyboardInterrupt

    interp.on_update = on_update
    tracker.capture = capture
    checkpoints.tracker = tracker
    return tracker
