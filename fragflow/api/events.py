"""What env fragments emit and what batch axes fragment outputs carry, for fragments that do not
declare them (see :mod:`fragflow.api.fragment`).

A user's own env fragment with gymnasium's step signature, ``(obs, reward, terminated, truncated,
info)``, is counted like a built-in one: one env step per reward entry, an episode ending wherever
``terminated | truncated``, its return summed from the raw rewards. Its outputs whose leading
dimension is the number of environments get the ``env`` axis 0.

>>> count = StepCounter()
>>> count((None, np.ones(2), np.array([False, True]), np.zeros(2, bool), {}))
(2, [(1.0, 1)])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow.compiler.pytree import backend_of, to_numpy

Events = Callable[[Any], tuple[int, list[tuple[float, int]]]]
Axes = Callable[[str], "tuple[str, int] | None"]


def _is_step(out: Any) -> bool:
    return (isinstance(out, tuple) and len(out) == 5 and backend_of(out[1]) is not None
            and backend_of(out[2]) is not None and backend_of(out[3]) is not None)


class StepCounter:
    """Env steps and finished episodes of calls with gymnasium's step signature."""

    def __init__(self) -> None:
        self.returns: np.ndarray | None = None
        self.lengths: np.ndarray | None = None

    def __call__(self, out: Any) -> tuple[int, list[tuple[float, int]]]:
        if not _is_step(out):
            return 0, []
        reward = np.asarray(to_numpy(out[1]), np.float64).reshape(-1)
        done = (np.asarray(to_numpy(out[2])) | np.asarray(to_numpy(out[3]))).reshape(-1)
        if self.returns is None or self.returns.shape != reward.shape:
            self.returns = np.zeros_like(reward)
            self.lengths = np.zeros(reward.shape, np.int64)
        assert self.lengths is not None
        self.returns += reward
        self.lengths += 1
        finished = []
        if done.any():
            for i in np.flatnonzero(done):
                finished.append((float(self.returns[i]), int(self.lengths[i])))
            self.returns[done] = 0.0
            self.lengths[done] = 0
        return reward.size, finished


class EventSources:
    """Per run: the events function of every env fragment (declared, or a counter of its own).

    A user's env counted here (no ``events`` of its own) is reset by an env fragment named ``reset``
    (``reset_all``...) of the same object, or of the same module where they are plain functions:
    its call ends the episodes under way in the counters of that object's other env fragments
    (they are abandoned, as gymnasium's reset abandons them), so the next episode counts from its
    first step."""

    def __init__(self) -> None:
        self._counters: dict[int, Events | None] = {}
        self._resets: dict[int, object] = {}           # a reset fragment -> its group
        self._groups: dict[object, list[StepCounter]] = {}

    def of(self, frag: Any) -> Events | None:
        """What a call of ``frag`` counted, asked once it has returned (a reset takes effect here)."""
        key = id(frag)
        if key not in self._counters:
            events = frag.events
            if events is None and frag.role == "env":
                events = StepCounter()   # (a reset's: no step, no episode)
                if getattr(frag.fn, "__name__", "").lstrip("_").startswith("reset"):
                    self._resets[key] = _group(frag)
                else:
                    self._groups.setdefault(_group(frag), []).append(events)
            self._counters[key] = events
        group = self._resets.get(key)
        if group is not None:
            for counter in self._groups.get(group, ()):
                counter.returns = counter.lengths = None
        return self._counters[key]

    def steady(self, frag: Any) -> bool:
        """Whether :meth:`of` answers the same for every later call of ``frag`` (it was asked once:
        all but a reset, whose call ends the episodes under way in its group's counters)."""
        return id(frag) in self._counters and id(frag) not in self._resets


def _group(frag: Any) -> object:
    """The environments a user's env fragment steps: its object's, or its module's."""
    return ("instance", id(frag.instance)) if frag.instance is not None else \
        ("module", getattr(frag.fn, "__module__", None))


def default_axes(role: str, out: Any) -> Axes | None:
    """Batch axes for the outputs of an env fragment that declares none: leaves whose leading
    dimension is the number of rewards of a gymnasium step are ``env`` axis 0."""
    if role != "env" or not _is_step(out):
        return None
    reward = out[1]
    n = reward.shape[0] if getattr(reward, "ndim", 0) >= 1 else None
    if n is None:
        return None
    batched = {f"[{i}]{p}" for i, item in enumerate(out) for p, x in _leaves(item)
               if getattr(x, "ndim", 0) >= 1 and x.shape[0] == n}
    return lambda path: ("env", 0) if path in batched else None


def _leaves(item: Any) -> list[tuple[str, Any]]:
    from fragflow.compiler.pytree import NotAnArray, leaf_paths

    try:
        return leaf_paths(item)
    except NotAnArray:
        return []
