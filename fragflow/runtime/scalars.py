"""What ``ff.log`` writes: a logged value's scalar leaves, named by their path in it (dict keys,
namedtuple fields and list indices joined by "/")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fragflow.compiler.pytree import to_numpy


def flat_scalars(tree: Any) -> dict[str, float]:
    """``{"loss": 0.5, "x": {"y": 1}, "v": [2]}`` -> ``{"loss": 0.5, "x/y": 1.0, "v/0": 2.0}`` (a lone
    scalar is ``"value"``). A leaf that is not one number (a value first logged after the trace, or
    grown since) is refused at the ``ff.log`` line."""
    out: dict[str, float] = {}
    for name, leaf in _named_leaves(tree, ""):
        what = (f"of type {type(leaf).__name__}, not a number" if isinstance(leaf, (str, bytes))
                else f"with shape {tuple(np.shape(to_numpy(leaf)))}, not a scalar" if _size(leaf) != 1 else None)
        fix = "log scalars: reduce it first (x.mean(), x.max()) or log its elements under names of their own"
        if what is None and (name or "value") in out:   # {1: x, "1": y}, {"a": {"b": x}, "a/b": y}: one column
            name = name or "value"
            what = ("twice: two of its values have that name (keys are joined with '/' and written as text), and "
                    "one column cannot hold both")
            fix = "give each value a name of its own"
        if what is not None:
            from fragflow.errors import ConfigError
            from fragflow.source import user_callsite

            raise ConfigError(f"ff.log got {name or 'its value'!r} {what}", where=user_callsite(), fix=fix)
        out[name or "value"] = _number(leaf)
    return out


def _size(leaf: Any) -> int:
    if isinstance(leaf, (int, float)):
        return 1
    size = getattr(leaf, "size", None)
    if isinstance(size, int):
        return size
    numel = getattr(leaf, "numel", None)
    return int(numel()) if callable(numel) else int(np.asarray(to_numpy(leaf)).size)


def non_scalar(tree: Any) -> tuple[str, str] | None:
    """The first leaf of ``tree`` that is not one number: its name (as :func:`flat_scalars` names
    it) and what it is instead ("of type str", "has shape (3,)")."""
    for name, leaf in _named_leaves(tree, ""):
        if isinstance(leaf, (str, bytes)):
            return name, f"is of type {type(leaf).__name__}, not a number"
        if _size(leaf) != 1:
            return name, f"has shape {tuple(np.shape(to_numpy(leaf)))}, not a scalar"
    return None


def named_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """(column, leaf) of each leaf ``ff.log(tree)`` writes, named as :func:`flat_scalars` names them."""
    for name, leaf in _named_leaves(tree, ""):
        yield name or "value", leaf


def _named_leaves(tree: Any, name: str, nones: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, leaf) of each leaf of ``tree``: dict keys, namedtuple fields and list indices joined by "/"
    (``nones``: a None is a leaf too)."""
    items: Any
    if tree is None:
        if nones:
            yield name, None
        return
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = zip(tree._fields, tree)
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        yield name, tree
        return
    for k, v in items:
        yield from _named_leaves(v, f"{name}/{k}" if name else str(k), nones)


def _number(leaf: Any) -> float:
    """A scalar leaf as a float: a number, or an array or tensor of one element (any shape: the
    trace lets ff.log take ``np.ones(1) * x``, which numpy's float() refuses)."""
    if isinstance(leaf, (int, float)):
        return float(leaf)
    if type(leaf).__name__ == "Tensor" and type(leaf).__module__ == "torch" and not leaf.is_complex():
        return float(leaf.detach().reshape(()).item())   # (a plain tensor: its one number, without a numpy copy)
    return float(np.asarray(to_numpy(leaf)).reshape(()))


def scalars_in(tree: Any) -> dict[str, float | None]:
    """The scalar leaves of ``tree`` by their path in it, named as :func:`flat_scalars` names them
    ("" for ``tree`` itself a scalar), and its Nones as None (ff.log writes nothing of them, but
    they were there: see :func:`logged_at`); leaves that are not one number are left out."""
    return {name: None if leaf is None else _number(leaf) for name, leaf in _named_leaves(tree, "", nones=True)
            if leaf is None or isinstance(leaf, (int, float)) or getattr(leaf, "size", None) == 1
            or getattr(leaf, "numel", lambda: 0)() == 1}


def logged_name(name: str, rest: str) -> str:
    """The column of a scalar at ``rest`` in a value the loop logged as ``name`` (flat_scalars' names)."""
    return "/".join(x for x in (name, rest) if x) or "value"


def logged_at(scalars: dict[str, float | None], rest: str, name: str) -> dict[str, float | None]:
    """The scalars at ``rest`` in a part, by the names they are logged under as ``name`` (a None:
    a None there, which writes nothing; empty: nothing there)."""
    return {logged_name(name, path[len(rest):].lstrip("/")): value for path, value in scalars.items()
            if not rest or path == rest or path.startswith(rest + "/")}


def by_position(names: Any, rest: str) -> str:
    """``rest`` with each index that names nothing at its level of ``names`` taken as a position among
    the names there: the loop indexes a namedtuple output (``metrics[0]``), whose part is reported by
    its fields' names (``r``, ``s``)."""
    out: list[str] = []
    for seg in rest.split("/"):
        prefix = "/".join(out)
        level = list(dict.fromkeys(n[len(prefix):].lstrip("/").split("/")[0] for n in names
                                   if not prefix or n == prefix or n.startswith(prefix + "/")))
        if seg not in level and seg.isdigit() and int(seg) < len(level):
            seg = level[int(seg)]
        out.append(seg)
    return "/".join(out)
