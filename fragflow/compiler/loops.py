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
import copy
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
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
    guards: tuple[tuple[int, int], ...] = ()   # lines of the ``if`` statements in its body
    exits: bool = False                        # its body has a ``break`` or ``continue`` of its own
    # where its body leaves it: (line, ``break`` or ``return``, the ``if`` around it, as written, or "")
    leaves: tuple[tuple[int, str, str], ...] = ()

    def encloses(self, where: SourceLoc | None) -> bool:
        return where is not None and where.file == self.where.file and self.first <= where.line <= self.last

    def every_trip(self, where: SourceLoc) -> bool:
        """A call at ``where`` (inside this loop) runs once per trip: no ``if`` around it, no early exit."""
        return not self.exits and not any(a <= where.line <= b for a, b in self.guards)


def calls_per(call: SourceLoc | None, clock: SourceLoc | None, loops: tuple[LoopSpec, ...]) -> float | None:
    """How many times the call at ``call`` runs per run of the call at ``clock``, from the loops
    around them (the trips of the loops only one of them is in), or None when the structure does
    not say: a bound unknown before the loop starts, an ``if`` or early exit around either call,
    a call made outside the training function's loops.

    >>> at = lambda line: SourceLoc("t.py", line)
    >>> outer = LoopSpec(at(1), "for u in range(3)", 3, 1, 9)
    >>> inner = LoopSpec(at(2), "for s in range(128)", 128, 2, 4)
    >>> calls_per(at(3), at(8), (outer, inner)), calls_per(at(8), at(3), (outer, inner))
    (128.0, 0.0078125)
    """
    if call is None or clock is None:
        return None
    around = [loop for loop in loops if loop.encloses(call)]
    around_clock = [loop for loop in loops if loop.encloses(clock)]
    if not around or not around_clock:
        return None
    ratio = 1.0
    for loop in around:
        if not loop.every_trip(call):
            return None
        if loop not in around_clock:
            if loop.trips is None:
                return None
            ratio *= loop.trips
    for loop in around_clock:
        if not loop.every_trip(clock):
            return None
        if loop not in around:
            if not loop.trips:
                return None
            ratio /= loop.trips
    return ratio


def guard_of(where: SourceLoc | None, loops: tuple[LoopSpec, ...]) -> SourceLoc | None:
    """The innermost ``if`` around the call at ``where`` inside the training function's loops (None:
    none): where a call made under a condition on data is refused, the line that makes it one.

    >>> at = lambda line: SourceLoc("t.py", line)
    >>> loop = LoopSpec(at(1), "for s in range(9)", 9, 1, 9, guards=((3, 8), (5, 6)))
    >>> guard_of(at(6), (loop,)), guard_of(at(4), (loop,)), guard_of(at(2), (loop,))
    (SourceLoc(file='t.py', line=5), SourceLoc(file='t.py', line=3), None)
    """
    if where is None:
        return None
    inner = max((a for loop in loops if loop.encloses(where) for a, b in loop.guards if a <= where.line <= b),
                default=None)
    return None if inner is None else SourceLoc(where.file, inner)


def loop_around(where: SourceLoc | None, loops: tuple[LoopSpec, ...]) -> LoopSpec | None:
    """The innermost of the training function's loops whose body holds ``where`` (None: none)."""
    around = [loop for loop in loops if loop.encloses(where) and where is not None and where.line > loop.first]
    return max(around, key=lambda loop: loop.first, default=None)


def defined_in_loop(role: str, name: str, at: SourceLoc, loop: LoopSpec) -> str:
    """What is wrong with a fragment defined in the training loop's body, for a refusal."""
    return (f"{role} fragment '{name}' is defined inside the training loop (at {at}, in `{loop.header}` at "
            f"{loop.where}): each trip defines a new fragment")


class LoopWatcher:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = getattr(fn, "__wrapped__", fn)
        self.code = getattr(self.fn, "__code__", None)
        self.loops: dict[int, tuple[str, int, CodeType | None]] = {}   # line -> (header, last line, range bound)
        self.guards: dict[int, tuple[tuple[int, int], ...]] = {}   # line -> its body's if statements
        self.exits: dict[int, bool] = {}
        self.leaves: dict[int, tuple[tuple[int, str, str], ...]] = {}
        self.trips: dict[int, int | None] = {}
        self._previous: Any = None
        self.value: Any = None
        self.file = ""
        try:
            lines, start = inspect.getsourcelines(self.fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            source_file = inspect.getsourcefile(self.fn) or "<train>"
            self.file = display_path(source_file)
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
                            and not it.keywords and _pure(it.args)):
                        # compiled at the user's line: what its evaluation records (a learner output
                        # read there, refused under some policies) names that line, not a string's
                        expr = ast.Expression(body=copy.deepcopy(it))
                        ast.increment_lineno(expr, start - 1)
                        bound = compile(expr, source_file, "eval")
                else:
                    header, bound = f"while {ast.unparse(node.test)}", None
                self.loops[line] = (header, last, bound)
                body = [n for stmt in node.body for n in ast.walk(stmt)]
                self.guards[line] = tuple((n.lineno + start - 1, (n.end_lineno or n.lineno) + start - 1)
                                          for n in body if isinstance(n, ast.If))
                self.exits[line] = _exits(node)
                self.leaves[line] = tuple((at + start - 1, kind, test) for at, kind, test in _leaves(node))

    def line_now(self) -> int | None:
        """The line the training function runs now (a call made from inside it), or None."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back   # type: ignore[assignment]
        return None if frame is None else frame.f_lineno

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
            if len(self.trips) == len(self.loops):
                # every loop has started: stop tracing, which slows every Python call in the process
                # (a DQN trace of 10k warm-up steps took 18 s with it on, for loops seen at step 1)
                sys.settrace(self._previous)
                return None
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is self.code:
            return self._local
        return None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[LoopSpec]:
        """Call ``fn`` watching the training function's loops (its value: ``self.value``); the
        loops, outermost first."""
        if self.code is None or not self.loops:
            self.value = fn(*args, **kwargs)
            return self.specs()
        previous = self._previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            self.value = fn(*args, **kwargs)
        finally:
            sys.settrace(previous)
        return self.specs()

    def stop(self) -> None:
        """Stop watching (a loop not started yet keeps an unknown bound)."""
        if sys.gettrace() == self._global:   # (a bound method: equal, never the same object)
            sys.settrace(self._previous)

    def specs(self) -> list[LoopSpec]:
        return [LoopSpec(SourceLoc(self.file, line), header, self.trips.get(line), line, last,
                         self.guards.get(line, ()), self.exits.get(line, False), self.leaves.get(line, ()))
                for line, (header, last, _) in sorted(self.loops.items())]


_PURE_CALLS = frozenset({"len", "int", "min", "max", "abs", "round"})


def _pure(args: list[ast.expr]) -> bool:
    """Whether ``range``'s arguments can be evaluated again without effects: names, attributes,
    constants, arithmetic, indexing and a few builtins (``range(rng.integers(3, 8))`` draws a number:
    evaluated a second time, the run, which the trace begins, would draw one more than eagerly)."""
    for node in (n for a in args for n in ast.walk(a)):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _PURE_CALLS):
            return False
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda)):
            return False
    return True


def _exits(loop: ast.For | ast.While) -> bool:
    """Whether a ``break`` or ``continue`` of this loop (not of a loop inside it) is in its body."""
    todo: list[ast.AST] = list(loop.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Break, ast.Continue)):
            return True
        if isinstance(node, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(node.orelse if isinstance(node, (ast.For, ast.While)) else [])
            continue
        todo.extend(ast.iter_child_nodes(node))
    return False


def _leaves(loop: ast.For | ast.While) -> list[tuple[int, str, str]]:
    """(line, ``break`` or ``return``, the innermost ``if`` around it as written, or "") of each
    statement that leaves this loop early: its own ``break`` (not a loop's inside it) and any
    ``return`` in its body.

    >>> tree = ast.parse("for u in range(9):\\n    for s in range(3):\\n        break\\n    if r > 1:\\n        break\\n")
    >>> _leaves(tree.body[0])
    [(5, 'break', 'if r > 1')]
    """
    found: list[tuple[int, str, str]] = []

    def walk(nodes: list[ast.stmt], test: str, own: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Break) and own:
                found.append((node.lineno, "break", test))
            elif isinstance(node, ast.Return):
                found.append((node.lineno, "return", test))
            elif isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
                walk(node.body, test, False)        # (its break leaves that loop; a return leaves them all)
                walk(node.orelse, test, own)
            elif isinstance(node, ast.If):
                walk(node.body, f"if {ast.unparse(node.test)}", own)
                walk(node.orelse, f"if not ({ast.unparse(node.test)})", own)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                walk(node.body, test, own)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    walk(part, test, own)
            elif isinstance(node, ast.Match):
                for case in node.cases:
                    walk(case.body, test, own)

    walk(loop.body, "", True)
    return sorted(found)
