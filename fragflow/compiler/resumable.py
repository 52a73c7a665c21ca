"""The training function with its top-level loops made resumable.

A checkpoint is taken where one trip of a top-level loop (a loop of the training function not
inside another loop) ends and the next begins; resuming re-runs the function from its first line
(environments, state, buffers are made again) and fast-forwards that loop to the saved trip. For
that the runtime must see each top-level loop start a trip, so the function is recompiled from
its source with one call added per loop, at the loop's own line:

- ``for x in ITER:`` becomes ``for x in <trips>.loop(ITER, line):``, which yields ITER's items
  and reports each trip before it starts (and, on resume, skips the trips already done);
- ``while TEST:`` becomes ``while <trips>.going(line) and (TEST):``.

Everything else is the user's code, compiled from the same file with the same line numbers (a
traceback, a debugger and the tracer's ``file:line`` see the user's lines). Run without fragflow
the hooks do nothing but iterate. A function whose source cannot be read (defined in a REPL) or
that has no top-level loop is left as it is: such a run cannot be checkpointed, and says so.

>>> def train(n):
...     total = 0
...     for i in range(n):
...         total += i
...     return total
>>> fn = resumable(train)
>>> fn is not train, fn(4), loop_lines(fn) == (train.__code__.co_firstlineno + 2,)
(True, 6, True)
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import linecache
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

HOOKS = "fragflow.runtime.trips"


def _hook(name: str, where: ast.AST) -> ast.expr:
    """``__import__("fragflow.runtime.trips", fromlist=("loop",)).<name>``: no name is added to the
    user's module, and the import is a dictionary lookup once the module is loaded."""
    imp = ast.Call(ast.Name("__import__", ast.Load()),
                   [ast.Constant(HOOKS)], [ast.keyword("fromlist", ast.Tuple([ast.Constant(name)], ast.Load()))])
    return ast.copy_location(ast.Attribute(imp, name, ast.Load()), where)


def _top_level_loops(body: list[ast.stmt]) -> list[ast.For | ast.While]:
    """Loops of a function body that no other loop (or nested function) encloses, in source order."""
    found: list[ast.For | ast.While] = []
    todo = list(body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.For, ast.While)):
            found.append(node)
            todo.extend(node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.AsyncFor)):
            continue
        else:
            todo.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return sorted(found, key=lambda n: n.lineno)


def resumable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recompiled with its top-level loops reporting their trips (``fn`` itself when that
    cannot be done; see the module docstring)."""
    if getattr(fn, "__fragflow_loops__", None) is not None or not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__
    try:
        lines, start = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return fn
    ast.increment_lineno(tree, start - 1)
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != code.co_name:
        return fn
    loops = _top_level_loops(fdef.body)
    if not loops:
        return fn
    for loop in loops:
        line = ast.copy_location(ast.Constant(loop.lineno), loop)
        if isinstance(loop, ast.For):
            loop.iter = ast.copy_location(ast.Call(_hook("loop", loop), [loop.iter, line], []), loop.iter)
        else:
            going = ast.copy_location(ast.Call(_hook("going", loop), [line], []), loop.test)
            loop.test = ast.copy_location(ast.BoolOp(ast.And(), [going, loop.test]), loop.test)
    fdef.decorator_list = []
    body: list[ast.stmt] = [fdef]
    if code.co_freevars:
        # free variables stay free: define the function inside one that binds the same names
        outer = ast.FunctionDef(
            name="__fragflow_outer__", args=ast.arguments([], [], None, [], [], None, []),
            body=[ast.Assign([ast.Name(v, ast.Store())], ast.Constant(None), lineno=fdef.lineno) for v in code.co_freevars]
            + [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))],
            decorator_list=[], returns=None, type_comment=None)
        body = [ast.copy_location(outer, fdef)]
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    try:
        compiled = compile(module, code.co_filename, "exec", dont_inherit=True,
                           flags=_future_flags(code))
    except SyntaxError:
        return fn
    new_code = _find(compiled, code.co_name, fdef.lineno)
    if new_code is None or new_code.co_freevars != code.co_freevars:
        return fn
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(fn.__annotations__)
    new.__fragflow_loops__ = tuple(loop.lineno for loop in loops)   # type: ignore[attr-defined]
    new.__fragflow_original__ = fn   # type: ignore[attr-defined]
    return new


def loop_lines(fn: Callable[..., Any]) -> tuple[int, ...]:
    """Lines of the top-level loops that report their trips (empty: ``fn`` cannot be resumed)."""
    return tuple(getattr(fn, "__fragflow_loops__", ()) or ())


def set_before_loops(code: types.CodeType) -> frozenset[str]:
    """The names the function of ``code`` binds only before its first top-level loop, in statements
    no loop encloses (``num_updates = args.total_timesteps // batch``): what a resumed run computes
    again, from its own args, before the loop it resumes starts. A name bound anywhere from that
    loop's line on (in a loop, between two loops, after them) is not one. Empty where the source
    cannot be read."""
    # (a name a nested function reads or changes, `nonlocal count` in a closure the loop calls, is
    # not: the closure may change it at any trip)
    return _set_before_loops(code.co_filename, code.co_firstlineno, code.co_name) - frozenset(code.co_cellvars)


@functools.lru_cache(maxsize=32)
def _set_before_loops(filename: str, first: int, name: str) -> frozenset[str]:
    lines = linecache.getlines(filename)
    if not lines or first < 1:
        return frozenset()
    try:
        block = inspect.getblock(lines[first - 1:])
        tree = ast.parse(textwrap.dedent("".join(block)))
    except (SyntaxError, IndentationError, ValueError, inspect.EndOfBlock):
        return frozenset()
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or fdef.name != name:
        return frozenset()
    loops = _top_level_loops(fdef.body)
    if not loops:
        return frozenset()
    first_loop = loops[0].lineno
    before: set[str] = set()
    later: set[str] = set()
    for stmt in fdef.body:
        (before if stmt.end_lineno is not None and stmt.end_lineno < first_loop and
         not isinstance(stmt, (ast.For, ast.While, ast.AsyncFor)) else later).update(_bound(stmt))
    return frozenset(before - later)


def _bound(node: ast.AST) -> set[str]:
    """Every name a statement may bind (nested scopes' too: more, never fewer, than it binds)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            out.update(n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            out.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            out.add(n.rest)
    return out


def _future_flags(code: types.CodeType) -> int:
    import __future__

    return code.co_flags & __future__.annotations.compiler_flag


def _find(code: types.CodeType, name: str, line: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == line:
                return const
            hit = _find(const, name, line)
            if hit is not None:
                return hit
    return None


class InModule:
    """A recompiled training function as it travels to a worker whose process imports its module:
    rebuilt there over that module's own globals, as the function it stands for is. (Pickled as any
    function that is not its module's attribute, by value, it took a copy of every global it names,
    fragments included: a helper function of the module, which travels by reference, then called
    the module's fragment, and the loop its copy, two fragments where the program has one.)"""

    def __init__(self, fn: Any) -> None:
        self.fn: types.FunctionType = fn

    @staticmethod
    def fits(fn: Any) -> bool:
        """``fn`` is a recompiled function (see :func:`resumable`) whose original its module holds
        under its name, with no free variables: importable, so its globals are the module's."""
        original = getattr(fn, "__fragflow_original__", None)
        if original is None or not isinstance(fn, types.FunctionType) or fn.__closure__ is not None:
            return False
        module = sys.modules.get(fn.__module__)
        return module is not None and getattr(module, fn.__qualname__, None) is original

    def __reduce__(self) -> tuple[Any, ...]:
        fn = self.fn
        return (in_module, (fn.__module__, fn.__code__, fn.__name__, fn.__qualname__, fn.__defaults__,
                            fn.__kwdefaults__, dict(fn.__dict__)))


def in_module(module: str, code: types.CodeType, name: str, qualname: str, defaults: Any, kwdefaults: Any,
              attrs: dict[str, Any]) -> types.FunctionType:
    """The function of ``code`` over module ``module``'s globals (see :class:`InModule`)."""
    mod = importlib.import_module(module)
    fn = types.FunctionType(code, mod.__dict__, name, defaults, None)
    fn.__kwdefaults__ = kwdefaults
    fn.__dict__.update(attrs)
    original = attrs.get("__fragflow_original__")
    fn.__qualname__, fn.__module__ = qualname, module
    fn.__doc__ = getattr(original, "__doc__", None)
    fn.__annotations__ = dict(getattr(original, "__annotations__", {}))
    return fn
