"""Loop structure of the training function: which loops enclose each fragment call, and how many
times each loop runs.

The loops come from the function's source (``ast``); while tracing, a line tracer on the training
function's own frame (nothing it calls) evaluates the bound of every ``for ... in range(...)``
when the loop starts, so the IR knows ``for update in range(args.num_updates)`` runs 3906 times
although tracing stopped after two. ``while`` loops and other iterables have no known bound.

>>> def train(n):
...     for i in range(n):
...         pass
>>> [(loop.header, loop.trips) for loop in LoopWatcher(train).run(train, 3)]
[('for i in range(n)', 3)]
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from fragflow.source import SourceLoc, display_path


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """One loop of the training function: where it is, its header, how many times it runs (None:
    not known before it runs), and its lines."""

    where: SourceLoc
    header: str
    trips: int | None
    first: int
    last: int

    def encloses(self, where: SourceLoc | None) -> bool:
        return where is not None and where.file == self.where.file and self.first <= where.line <= self.last


class LoopWatcher:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = getattr(fn, "__wrapped__", fn)
        self.code = getattr(self.fn, "__code__", None)
        self.loops: dict[int, tuple[str, int, str | None]] = {}   # line -> (header, last line, range bound)
        self.trips: dict[int, int | None] = {}
        self.file = ""
        try:
            lines, start = inspect.getsourcelines(self.fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            self.file = display_path(inspect.getsourcefile(self.fn) or "")
        except (OSError, TypeError, SyntaxError):
            return
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.While)):
                line = node.lineno + start - 1
                last = (node.end_lineno or node.lineno) + start - 1
                if isinstance(node, ast.For):
                    header = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
                    bound = None
                    it = node.iter
                    if (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                            and not it.keywords):
                        bound = ast.unparse(it)
                else:
                    header, bound = f"while {ast.unparse(node.test)}", None
                self.loops[line] = (header, last, bound)

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno in self.loops and frame.f_lineno not in self.trips:
            bound = self.loops[frame.f_lineno][2]
            trips = None
            if bound is not None:
                try:
                    trips = len(eval(bound, frame.f_globals, frame.f_locals))  # noqa: S307 - the user's own range()
                except Exception:
                    trips = None
            self.trips[frame.f_lineno] = trips
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is self.code:
            return self._local
        return None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[LoopSpec]:
        """Call ``fn`` watching the training function's loops; the loops, outermost first."""
        if self.code is None or not self.loops:
            fn(*args, **kwargs)
            return self.specs()
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            fn(*args, **kwargs)
        finally:
            sys.settrace(previous)
        return self.specs()

    def specs(self) -> list[LoopSpec]:
        return [LoopSpec(SourceLoc(self.file, line), header, self.trips.get(line), line, last)
                for line, (header, last, _) in sorted(self.loops.items())]
