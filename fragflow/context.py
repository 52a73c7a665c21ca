"""The active interpreter: who executes a fragment call right now.

With no interpreter active, fragments are plain function calls (eager mode): an algorithm file
runs unchanged without fragflow's runtime. The tracer and every executor are interpreters that
take over fragment calls for the duration of a ``with using(interp):`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from fragflow.api.fragment import Fragment
    from fragflow.source import SourceLoc


class Interpreter(Protocol):
    """What the tracer and the executors implement."""

    def call(self, fragment: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Execute (or record, or ship) one fragment call and return its result."""
        ...

    def versioned(self, value: Any, name: str, where: SourceLoc | None) -> Any:
        """Register a value that one learner writes and other fragments read."""
        ...

    def env_ids(self, num_envs: int) -> np.ndarray:
        """Global indices of the environments this process steps (a slice under replication)."""
        ...

    def replica(self) -> tuple[int, int]:
        """(index, count) of this process among the replicas of its group: (0, 1) in one process."""
        ...

    def instance_name(self, prefix: str) -> str:
        """A deterministic unique name for a built-in fragment instance ('env', 'env_1', ...)."""
        ...

    def adopt(self, resource: Any) -> None:
        """Take ownership of something with a ``close()`` (an environment): closed when the run ends."""
        ...


_stack: list[Interpreter] = []


def current() -> Interpreter | None:
    return _stack[-1] if _stack else None


@contextmanager
def using(interp: Interpreter) -> Iterator[Interpreter]:
    _stack.append(interp)
    try:
        yield interp
    finally:
        _stack.remove(_swapped.pop(id(interp), interp))


_swapped: dict[int, Interpreter] = {}


def swap(old: Interpreter, new: Interpreter) -> None:
    """``new`` takes over the calls ``old`` was taking, for the rest of ``old``'s ``using`` block
    (the tracer handing a loop it has traced to the interpreter that runs it on)."""
    _stack[_stack.index(old)] = new
    _swapped[id(old)] = new


class InstanceNames:
    """Deterministic names for built-in fragment instances, counted per run."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        n = self._counts.get(prefix, 0)
        self._counts[prefix] = n + 1
        return prefix if n == 0 else f"{prefix}_{n}"
