"""What a fragment's code reaches besides its arguments, and whether it changed what it was given.

A fragment sees versioned state only through its arguments: that is how a placement hands it the
version it may act with. The tracer asks, on a fragment's first call, what its closure and the
globals its code names hold (a ``Versioned`` handle, or an object a versioned state holds, such as
its ``nn.Module``), and fingerprints the state a fragment reads to see whether it changed it in place.
A fragment that reaches a handle that way runs in the loop's own process with the handle's value in
its place (:func:`handles_as_values`), as it does eagerly; placements over several processes refuse it.
"""

from __future__ import annotations

import contextlib
import functools
import types
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler.pytree import NotAnArray, leaf_paths


def fingerprint(tree: Any) -> list[int]:
    """A checksum of each array leaf's bytes: whether a fragment changed what it read in place."""
    try:
        leaves = leaf_paths(tree)
    except NotAnArray:
        return []
    out = []
    for _, leaf in leaves:
        if hasattr(leaf, "detach"):
            leaf = leaf.detach().cpu().numpy()
        out.append(zlib.crc32(np.ascontiguousarray(leaf).data))
    return out


def objects_of(value: Any) -> list[Any]:
    """The objects a versioned value holds that code could keep a reference to: its containers,
    modules (and their submodules and parameters), optimizers, tensors and arrays."""
    out: list[Any] = []
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, (str, bytes, int, float, bool)) or x is None:
            continue
        out.append(x)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "modules") and hasattr(x, "parameters"):   # an nn.Module
            out.extend(m for m in x.modules() if m is not x)
            out.extend(x.parameters())
    return out


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a function's code (and the functions and comprehensions nested in it) may look up."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def _reachable(fn: Any) -> Iterator[tuple[str, str, Any]]:
    """(``"closure variable"`` or ``"global"``, name, value) for what ``fn``'s code can reach
    without its arguments: its closure's cells and the globals its code names."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            yield "closure variable", name, cell.cell_contents
        except ValueError:   # not assigned yet
            continue
    scope = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        if name in scope:
            yield "global", name, scope[name]


def _holds_state(value: Any) -> bool:
    if isinstance(value, (Versioned, VersionedView)):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return any(isinstance(x, (Versioned, VersionedView)) for x in items)


def _as_value(x: Any) -> Any:
    """What a handle, or a dict/list/tuple of handles, holds: the handle's own value, as the
    variable would hold it had ``ff.versioned`` returned its argument (as it does eagerly)."""
    if isinstance(x, Versioned):
        return x.value
    if isinstance(x, VersionedView):
        return x.resolve(x.handle.value)
    if isinstance(x, dict):
        return {k: _as_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_as_value(v) for v in x)
    return x


@contextlib.contextmanager
def handles_as_values(fn: Any) -> Iterator[None]:
    """While a fragment runs in the loop's own process, the closure cells and globals its code
    reaches that hold versioned state hold the state's value instead, as they do when the program
    runs eagerly; restored afterwards (the loop still moves the handles)."""
    fn = getattr(fn, "__func__", fn)
    code = fn.__code__
    swapped: list[tuple[Any, str, Any]] = []   # (cell or globals dict, name, handle)
    try:
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                held = cell.cell_contents
            except ValueError:
                continue
            if _holds_state(held):
                swapped.append((cell, name, held))
                cell.cell_contents = _as_value(held)
        scope = fn.__globals__
        for name in _global_names(code):
            held = scope.get(name)
            if held is not None and _holds_state(held):
                swapped.append((scope, name, held))
                scope[name] = _as_value(held)
        yield
    finally:
        for where, name, held in reversed(swapped):
            if isinstance(where, dict):
                where[name] = held
            else:
                where.cell_contents = held


def captured_state(fn: Any) -> tuple[str, str, str] | None:
    """Versioned state a fragment's code reaches without being passed it, through a closure or a
    global: (kind, the variable, the state's name); None when there is none."""
    for kind, name, value in _reachable(fn):
        if _holds_state(value):
            return kind, name, _handles(value)[0].name
    return None


def _handles(value: Any) -> list[Versioned]:
    if isinstance(value, Versioned):
        return [value]
    if isinstance(value, VersionedView):
        return [value.handle]
    items = value.values() if isinstance(value, dict) else value
    return [h for x in items if isinstance(x, (Versioned, VersionedView)) for h in _handles(x)]


def captured_objects(fn: Any, objects: dict[int, tuple[str, Any]]) -> tuple[str, str, str] | None:
    """An object versioned state holds (``objects``: id -> (state, object)) that a fragment's code
    reaches through a closure or a global: (kind, variable, state); None when there is none."""
    if not objects:
        return None
    for kind, name, value in _reachable(fn):
        hit = objects.get(id(value))
        if hit is not None and hit[1] is value:
            return kind, name, hit[0]
    return None
