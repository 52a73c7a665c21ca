"""Trips of the training function's top-level loops: where a checkpoint is taken and a resumed
run starts (the calls come from the recompiled function, see :mod:`fragflow.compiler.resumable`).

A process that runs the loop installs one :class:`Trips` tracker. At the start of every trip it
checks one flag; when a checkpoint is wanted it takes a :class:`Snapshot` of the loop there (the
trip, and the loop's locals that can be saved, see :mod:`fragflow.runtime.checkpoint`) and hands
it to the tracker's ``capture`` callback. On resume the tracker is given the saved position: top-level
loops before it run no trip, the saved loop gets its locals back and skips the trips already done.

>>> loop(range(3), 1) == range(3)    # no tracker installed: the loop runs as written
True
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any


@dataclass
class Snapshot:
    line: int                     # the top-level loop
    trip: int                     # trips of it completed
    frame_locals: dict[str, Any]  # the training function's locals at that moment (not copied)
    file: str = ""                # the training function's file
    params: tuple[str, ...] = ()  # the training function's parameters (its args: the run's, never restored)


@dataclass
class Resume:
    line: int
    trip: int
    restore: Callable[[FrameType], dict[str, Any]]   # the locals to write back, given the live frame
    done: bool = field(default=False)


class Trips:
    def __init__(self, capture: Callable[[Snapshot], None] | None = None, resume: Resume | None = None) -> None:
        self.capture = capture
        self.resume = resume
        self.pending = False           # a checkpoint is wanted at the next trip start
        self.poll: Callable[[], bool] | None = None   # asked at every trip start when set (a shared request)
        self.on_start: Callable[[int], None] | None = None   # told each trip as it starts, before ``poll``
        self.first: Callable[[FrameType], None] | None = None   # given the loop's frame at its first trip, once
        self.position: tuple[int, int] | None = None
        self._whiles: dict[int, int] = {}

    # -- hooks ---------------------------------------------------------------------------
    def iterate(self, iterable: Iterable[Any], line: int, frame: FrameType) -> Iterator[Any]:
        start = 0
        r = self.resume
        if r is not None and not r.done:
            if line < r.line:
                return iter(())
            if line == r.line:
                r.done = True
                write_locals(frame, r.restore(frame))
                start = r.trip
        return self._trips(iterable, line, frame, start)

    def _trips(self, iterable: Iterable[Any], line: int, frame: FrameType, start: int) -> Iterator[Any]:
        if start and isinstance(iterable, range):
            it: Iterator[Any] = iter(iterable[start:])
        else:
            it = iter(iterable)
            if start:
                it = itertools.islice(it, start, None)
        trip = start
        for item in it:
            self._start(frame, line, trip)
            yield item
            trip += 1
        self.position = (line, trip)

    def going(self, line: int, frame: FrameType) -> bool:
        trip = self._whiles.get(line)
        if trip is None:
            trip = 0
            r = self.resume
            if r is not None and not r.done:
                if line < r.line:
                    return False
                if line == r.line:
                    r.done = True
                    write_locals(frame, r.restore(frame))
                    trip = r.trip
        self._whiles[line] = trip + 1
        self._start(frame, line, trip)
        return True

    def _start(self, frame: FrameType, line: int, trip: int) -> None:
        self.position = (line, trip)
        if self.first is not None:
            first, self.first = self.first, None
            first(frame)
        if self.on_start is not None:
            self.on_start(trip)
        if self.pending or (self.poll is not None and self.poll()):
            self.pending = False
            if self.capture is not None:
                code = frame.f_code
                self.capture(Snapshot(line, trip, dict(frame.f_locals), code.co_filename,
                                      code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]))


_tracker: Trips | None = None


def install(tracker: Trips | None) -> Trips | None:
    """Make ``tracker`` this process's (None: none); returns the one it replaces."""
    global _tracker
    previous, _tracker = _tracker, tracker
    return previous


def current() -> Trips | None:
    return _tracker


def loop(iterable: Iterable[Any], line: int) -> Iterable[Any]:
    """The recompiled ``for`` loop's iterable (called from the training function's frame)."""
    t = _tracker
    if t is None:
        return iterable
    return t.iterate(iterable, line, sys._getframe(1))


def going(line: int) -> bool:
    """Called before each test of a recompiled ``while`` loop (from the training function's frame)."""
    t = _tracker
    if t is None:
        return True
    return t.going(line, sys._getframe(1))


def write_locals(frame: FrameType, values: dict[str, Any]) -> None:
    """Assign local variables of a running frame (the training function's, from a hook it called)."""
    if not values:
        return
    if sys.version_info >= (3, 13):
        proxy = frame.f_locals        # PEP 667: a write-through view of the frame's variables
        for name, value in values.items():
            proxy[name] = value
        return
    f_locals = frame.f_locals         # a dict synced from the fast locals; written back below
    f_locals.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
