"""Array pytrees: the only values that cross a fragment boundary.

A pytree is a nest of ``dict``, ``list``, ``tuple``, ``namedtuple`` and ``None`` whose leaves are
arrays: ``numpy.ndarray``/numpy scalars, ``torch.Tensor``, ``jax.Array``, or Python
``bool``/``int``/``float`` scalars. Two torch objects are containers too, so versioned state may
hold what users write: an ``nn.Module`` (its leaves are its ``state_dict`` tensors, parameters and
buffers) and a ``torch.optim.Optimizer`` (its leaves are its per-parameter state tensors). Such a
node cannot be rebuilt from its treedef alone: :func:`unflatten_into` loads leaves into an existing
object of the same structure (what a process that receives new weights does).

>>> leaves, treedef = flatten({"obs": np.zeros((4, 3), np.float32), "t": 1})
>>> [spec_of(x).short() for x in leaves]
['f32[4,3]', 'int[]']
>>> unflatten(treedef, leaves)["t"]
1
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# A treedef is a hashable description of a pytree's containers:
#   ("leaf",) | ("none",) | ("dict", keys, children) | ("list"|"tuple", children)
#   | ("namedtuple", type, children)
TreeDef = tuple[Any, ...]

_LEAF: TreeDef = ("leaf",)
_NONE: TreeDef = ("none",)


class NotAnArray(TypeError):
    """Raised by :func:`flatten` with the path of a leaf that is not an array."""

    def __init__(self, path: str, value: object) -> None:
        self.path = path
        self.value = value
        super().__init__(f"{path or '<root>'} is a {type(value).__module__}.{type(value).__qualname__}")


def backend_of(x: object) -> str | None:
    """'numpy', 'torch', 'jax' or 'python' for an array leaf; None for anything else."""
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(x, (bool, int, float)):
        return "python"
    mod = type(x).__module__
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):   # subclasses included
        return "torch"
    if mod.startswith("torch"):
        return None
    if mod.startswith(("jax", "jaxlib")):   # (a typed PRNG key, jax.random.key, holds no numbers: not an array)
        return "jax" if hasattr(x, "shape") and hasattr(x, "dtype") and not str(x.dtype).startswith("key<") else None
    return None


def flatten(tree: Any, path: str = "") -> tuple[list[Any], TreeDef]:
    """Leaves in a fixed order (dict keys in insertion order) and the treedef to rebuild them."""
    leaves: list[Any] = []
    treedef = _flatten(tree, path, leaves)
    return leaves, treedef


_GENERATORS = (np.random.Generator, np.random.RandomState)


def _torch_kind(x: Any) -> str | None:
    """'module', 'optimizer' or 'scheduler' (a ``torch.optim.lr_scheduler``: numbers only, no
    tensor, held beside its optimizer) for the torch objects that are pytree nodes, 'generator'
    for a random generator (``torch.Generator``, numpy's ``Generator`` or ``RandomState``: a state
    of its own, no tensor); None otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, (torch.Tensor, int, float)):   # the common leaves first
        return None
    if isinstance(x, _GENERATORS):
        return "generator"
    if torch is None:
        return None
    if isinstance(x, torch.Generator):
        return "generator"
    if isinstance(x, torch.nn.Module):
        return "module"
    if isinstance(x, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(x, _schedulers(torch)):
        return "scheduler"
    return None


_SCHEDULERS: list[tuple[type, ...]] = []


def _schedulers(torch: Any) -> tuple[type, ...]:
    """The scheduler base classes this torch has (looked up once)."""
    if not _SCHEDULERS:
        _SCHEDULERS.append(tuple(getattr(torch.optim.lr_scheduler, name) for name in ("LRScheduler", "ReduceLROnPlateau")
                                 if hasattr(torch.optim.lr_scheduler, name)))
    return _SCHEDULERS[0]


def is_scheduler(x: Any) -> bool:
    """A ``torch.optim.lr_scheduler`` scheduler (a node of versioned state, like its optimizer)."""
    return _torch_kind(x) == "scheduler"


def is_generator(x: Any) -> bool:
    """A random generator (``torch.Generator``, numpy's ``Generator`` or ``RandomState``)."""
    return _torch_kind(x) == "generator"


def _children(x: Any, kind: str) -> list[tuple[Any, Any]]:
    """(key, tensor) pairs of a module or optimizer, in a fixed order (a scheduler has none)."""
    if kind == "module":
        # what state_dict holds, then the buffers it leaves out (persistent=False: an observation
        # normaliser's running statistics kept out of checkpoints, still part of what the module computes)
        walked: list[tuple[Any, Any]] = []
        unsaved: list[tuple[Any, Any]] = []
        if not _plain_state(x, "", walked, unsaved, sys.modules["torch"].nn.Module):
            # (an extra state's dicts in one order, their keys': the learner may rebuild one in another)
            walked = [(k, _sorted_dicts(v) if _extra_owner(x, k) is not None else v)
                      for k, v in x.state_dict(keep_vars=True).items()]
            unsaved = []
            _unsaved_buffers(x, "", unsaved)
        return walked + unsaved if unsaved else walked
    if kind in ("scheduler", "generator"):
        return []
    out: list[tuple[Any, Any]] = []
    params = [p for group in x.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        st = x.state.get(p, {})
        out.extend(((i, k), st[k]) for k in sorted(st) if backend_of(st[k]) is not None)
    return out


EXTRA_STATE = "_extra_state"   # (the key suffix torch's state_dict gives a module's get_extra_state)


def _extra_owner(module: Any, key: str) -> Any:
    """The submodule whose ``get_extra_state`` gave ``module``'s state_dict entry ``key``; None for
    a parameter or buffer. Its extra state is a pytree of its own (arrays, numbers, containers),
    put back with ``set_extra_state``."""
    if not isinstance(key, str) or not key.endswith(EXTRA_STATE):
        return None
    prefix = key[:-len(EXTRA_STATE)].rstrip(".")
    try:
        owner = module.get_submodule(prefix)
    except AttributeError:
        return None
    base = sys.modules["torch"].nn.Module
    if getattr(type(owner), "get_extra_state", base.get_extra_state) is base.get_extra_state:
        return None
    return owner if key == (prefix + "." if prefix else "") + EXTRA_STATE else None


def _sorted_dicts(x: Any) -> Any:
    """``x`` with each dict in it (a module's extra state) in its keys' order, where they sort."""
    if isinstance(x, dict):
        try:
            keys = sorted(x)
        except TypeError:
            keys = list(x)
        return {k: _sorted_dicts(x[k]) for k in keys}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_sorted_dicts(v) for v in x])
    if isinstance(x, (list, tuple)):
        kids = [_sorted_dicts(v) for v in x]
        return kids if isinstance(x, list) else tuple(kids)
    return x


def _like(live: Any, value: Any) -> Any:
    """``value`` (an extra state rebuilt in :func:`_sorted_dicts`' order) with the dicts' order and
    types of ``live``, the module's own ``get_extra_state()``, where they hold the same keys."""
    if isinstance(live, dict) and isinstance(value, dict) and live.keys() == value.keys():
        items = [(k, _like(live[k], value[k])) for k in live]
        try:
            return type(live)(items)
        except Exception:
            return dict(items)
    if isinstance(live, (list, tuple)) and isinstance(value, (list, tuple)) and len(live) == len(value):
        kids = [_like(a, b) for a, b in zip(live, value)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*kids)
        return kids if isinstance(value, list) else tuple(kids)
    return value


def _unsaved_buffers(m: Any, prefix: str, out: list[tuple[Any, Any]]) -> None:
    """The buffers ``state_dict`` leaves out (registered with ``persistent=False``), named and
    ordered as it would name them."""
    for name, buf in m._buffers.items():   # (in their order: the set's differs between processes)
        if buf is not None and name in m._non_persistent_buffers_set:
            out.append((prefix + name, buf))
    for name, child in m._modules.items():
        if child is not None:
            _unsaved_buffers(child, prefix + name + ".", out)


def _plain_state(m: Any, prefix: str, out: list[tuple[Any, Any]], unsaved: list[tuple[Any, Any]], module: Any) -> bool:
    """``m.state_dict(keep_vars=True).items()`` appended to ``out`` and the buffers it leaves out to
    ``unsaved`` (as :func:`_unsaved_buffers`), walked without state_dict's per-module machinery (~5x
    quicker: a broadcast flattens its state every update), where no module in the tree changes what
    ``state_dict`` holds (no hook, no override of ``state_dict``, ``_save_to_state_dict`` or
    ``get_extra_state``); False where one might (``out`` is then incomplete)."""
    cls = type(m)
    if m._state_dict_pre_hooks or m._state_dict_hooks or cls.state_dict is not module.state_dict or \
            cls._save_to_state_dict is not module._save_to_state_dict or \
            getattr(cls, "get_extra_state", module.get_extra_state) is not module.get_extra_state:
        return False
    for name, param in m._parameters.items():
        if param is not None:
            out.append((prefix + name, param))
    for name, buf in m._buffers.items():
        if buf is not None:
            (unsaved if name in m._non_persistent_buffers_set else out).append((prefix + name, buf))
    for name, child in m._modules.items():
        if child is not None and not _plain_state(child, prefix + name + ".", out, unsaved, module):
            return False
    return True


def _flatten(tree: Any, path: str, out: list[Any]) -> TreeDef:
    if tree is None:
        return _NONE
    kind = _torch_kind(tree) if not isinstance(tree, (dict, list, tuple, np.ndarray)) else None
    if kind is not None:
        items = _children(tree, kind)
        extra: dict[int, TreeDef] = {}
        for i, (k, v) in enumerate(items):
            if kind == "module" and _extra_owner(tree, k) is not None:   # get_extra_state's: a pytree of its own
                extra[i] = _flatten(v, f"{path}[{k!r}]", out)
            else:
                out.append(v.detach() if kind == "module" else v)
        keys = tuple(k for k, _ in items)
        return (kind, keys, extra) if extra else (kind, keys)
    if isinstance(tree, dict):
        keys = tuple(tree.keys())
        return ("dict", keys, tuple(_flatten(tree[k], f"{path}[{k!r}]", out) for k in keys))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        kids = tuple(_flatten(v, f"{path}.{f}", out) for f, v in zip(tree._fields, tree))
        return ("namedtuple", type(tree), kids)
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return (kind, tuple(_flatten(v, f"{path}[{i}]", out) for i, v in enumerate(tree)))
    if backend_of(tree) is None:
        raise NotAnArray(path, tree)
    out.append(tree)
    return _LEAF


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return _unflatten(treedef, it)


def ordered_like(template: Any, value: Any) -> Any:
    """``value`` with its dicts in ``template``'s key order where both hold the same keys: a
    learner's new state (``jax.tree_util.tree_map`` sorts keys) flattens as the state it was given,
    so each leaf keeps its place in what is sent and checked.

    >>> list(ordered_like({"x": 0, "y": 1}, {"y": 2, "x": 3}))
    ['x', 'y']
    """
    if value is template:
        return value
    if isinstance(value, np.generic) and type(template) in _AS_NUMPY and _AS_NUMPY[type(template)] == value.dtype:
        # numpy's scalar where the state held Python's of the same arithmetic (np.abs(w).max() for a
        # float: eagerly the same numbers): Python's, as the state's leaf was traced
        return value.item()
    if isinstance(value, dict) and isinstance(template, dict) and value.keys() == template.keys():
        return {k: ordered_like(template[k], value[k]) for k in template}
    if isinstance(value, (list, tuple)) and isinstance(template, (list, tuple)) and len(value) == len(template):
        kids = [ordered_like(t, v) for t, v in zip(template, value)]
        if isinstance(value, list):
            return kids
        return type(value)(*kids) if hasattr(value, "_fields") else tuple(kids)
    return value


_AS_NUMPY = {float: np.dtype(np.float64), int: np.dtype(np.int64), bool: np.dtype(np.bool_)}


def without_optimizers(tree: Any) -> Any:
    """``tree`` with every ``torch.optim`` optimizer (and learning-rate scheduler) in it replaced by
    None (containers rebuilt, modules and arrays kept): what a version broadcast to the acting side carries. An actor never
    steps an optimizer, and Adam's state only exists after its first step, so a broadcast sized
    from it would not fit version 0."""
    if isinstance(tree, (dict, list, tuple)):
        if isinstance(tree, dict):
            return {k: without_optimizers(v) for k, v in tree.items()}
        kids = [without_optimizers(v) for v in tree]
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*kids)
        return kids if isinstance(tree, list) else tuple(kids)
    return None if _torch_kind(tree) in ("optimizer", "scheduler") else tree


def structure(tree: Any) -> Any:
    """The containers of a pytree (dicts by key, lists and tuples by place, a namedtuple's fields)
    with a mark for each leaf and None for None: compared with ``==``, which is cheap. Modules and
    optimizers are leaves here: Adam's moments appear at its first step, and for a parameter first
    given a gradient later.

    >>> structure({"w": np.zeros(2), "h": [None, 1.0]})
    {'w': 0, 'h': [None, 0]}
    """
    if isinstance(tree, dict):
        return {k: structure(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return (tree._fields, [structure(v) for v in tree])
    if isinstance(tree, (list, tuple)):
        return [structure(v) for v in tree]
    return None if tree is None else 0


def structure_paths(shape: Any, path: str = "") -> set[str]:
    """The leaf paths of a :func:`structure`, as :func:`leaf_paths` writes them (a module or an
    optimizer is one path).

    >>> sorted(structure_paths(structure({"w": np.zeros(2), "h": [None, 1.0]})))
    ["['h'][1]", "['w']"]
    """
    if isinstance(shape, dict):
        return {p for k, v in shape.items() for p in structure_paths(v, f"{path}[{k!r}]")}
    if isinstance(shape, tuple):
        return {p for f, v in zip(shape[0], shape[1]) for p in structure_paths(v, f"{path}.{f}")}
    if isinstance(shape, list):
        return {p for i, v in enumerate(shape) for p in structure_paths(v, f"{path}[{i}]")}
    return set() if shape is None else {path}


def unflatten_into(template: Any, leaves: list[Any], optimizers: bool = True,
                   plain: Callable[[Any], Any] | None = None) -> Any:
    """``template``'s structure with ``leaves`` in it: containers are rebuilt, but modules and
    optimizers in ``template`` are kept and their tensors overwritten in place (their leaves are
    copied, so the caller may reuse ``leaves``). With ``optimizers=False`` the leaves are those of
    :func:`without_optimizers` (``template``'s optimizers are kept as they are). ``plain`` maps
    each leaf that is not copied into a module or optimizer (e.g. to a private copy of a view).

    >>> unflatten_into({"a": 1, "b": [2]}, [10, 20])
    {'a': 10, 'b': [20]}
    """
    it = iter(leaves) if plain is None else _Mapped(iter(leaves), plain)
    out = _into(template, it, optimizers)
    if next(it, _END) is not _END:
        raise ValueError("more leaves than the template has")
    return out


_END = object()


class _Mapped:
    """An iterator of leaves whose plain ones (those ``_into`` does not copy into a module) are mapped."""

    def __init__(self, it: Iterator[Any], plain: Callable[[Any], Any]) -> None:
        self.it, self.plain = it, plain

    def __iter__(self) -> _Mapped:
        return self

    def __next__(self) -> Any:
        return self.plain(next(self.it))

    def raw(self) -> Any:
        return next(self.it)


def _into(tree: Any, it: Iterator[Any], optimizers: bool = True) -> Any:
    if tree is None:
        return None
    kind = _torch_kind(tree) if not isinstance(tree, (dict, list, tuple, np.ndarray)) else None
    if kind in ("optimizer", "scheduler") and not optimizers:
        return tree
    if kind is not None:
        import torch

        raw = it.raw if isinstance(it, _Mapped) else it.__next__
        with torch.no_grad():
            for k, dst in _children(tree, kind):
                owner = _extra_owner(tree, k) if kind == "module" else None
                if owner is not None:   # (its leaves copied: ``leaves`` are the caller's)
                    value = _into(dst, it if isinstance(it, _Mapped) else _Mapped(it, private))
                    owner.set_extra_state(_like(owner.get_extra_state(), value))   # (in its own order and types)
                    continue
                src = raw()
                dst.copy_(src if isinstance(src, torch.Tensor) else torch.as_tensor(src))
        return tree
    if isinstance(tree, dict):
        return {k: _into(v, it, optimizers) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[_into(v, it, optimizers) for v in tree])
    if isinstance(tree, (list, tuple)):
        kids = [_into(v, it, optimizers) for v in tree]
        return kids if isinstance(tree, list) else tuple(kids)
    return next(it)


def _unflatten(td: TreeDef, it: Iterator[Any]) -> Any:
    kind = td[0]
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    if kind == "dict":
        return {k: _unflatten(c, it) for k, c in zip(td[1], td[2])}
    if kind == "namedtuple":
        return td[1](*[_unflatten(c, it) for c in td[2]])
    if kind in ("module", "optimizer", "scheduler", "generator"):
        raise TypeError(f"a {kind} cannot be rebuilt from leaves alone; use unflatten_into with a template")
    kids = [_unflatten(c, it) for c in td[1]]
    return kids if kind == "list" else tuple(kids)


def leaf_paths(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs in flatten order, e.g. ``[("['obs']", array), ...]``."""
    out: list[tuple[str, Any]] = []
    _paths(tree, prefix, out)
    return out


def _paths(tree: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if tree is None:
        return
    if type(tree) is np.ndarray:   # the common leaf first
        out.append((path, tree))
        return
    kind = _torch_kind(tree) if not isinstance(tree, (dict, list, tuple, np.ndarray)) else None
    if kind is not None:
        for k, v in _children(tree, kind):
            if kind == "module" and _extra_owner(tree, k) is not None:
                _paths(v, f"{path}[{k!r}]", out)
            else:
                out.append((f"{path}[{k!r}]", v.detach() if kind == "module" else v))
        return
    if isinstance(tree, dict):
        for k, v in tree.items():
            _paths(v, f"{path}[{k!r}]", out)
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for f, v in zip(tree._fields, tree):
            _paths(v, f"{path}.{f}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _paths(v, f"{path}[{i}]", out)
    else:
        if backend_of(tree) is None:
            raise NotAnArray(path, tree)
        out.append((path, tree))


def unsaved_paths(tree: Any, prefix: str = "") -> set[str]:
    """The paths, in :func:`leaf_paths`'s notation, of the buffers registered with
    ``persistent=False`` in ``tree``'s modules (a mask, a cache: state_dict leaves them out)."""
    if isinstance(tree, dict):
        return {p for k, v in tree.items() for p in unsaved_paths(v, f"{prefix}[{k!r}]")}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return {p for f, v in zip(tree._fields, tree) for p in unsaved_paths(v, f"{prefix}.{f}")}
    if isinstance(tree, (list, tuple)):
        return {p for i, v in enumerate(tree) for p in unsaved_paths(v, f"{prefix}[{i}]")}
    if _torch_kind(tree) != "module":
        return set()
    return {f"{prefix}[{k!r}]" for k, _ in unsaved_buffers(tree)}


def unsaved_buffers(module: Any) -> list[tuple[str, Any]]:
    """A module's buffers registered with ``persistent=False``, by state_dict-style names."""
    found: list[tuple[Any, Any]] = []
    _unsaved_buffers(module, "", found)
    return found


def none_paths(tree: Any, prefix: str = "") -> list[str]:
    """The paths, in :func:`leaf_paths`'s notation, at which ``tree`` holds ``None`` (where a call
    returned no value in place of an array)."""
    if tree is None:
        return [prefix]
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in none_paths(v, f"{prefix}[{k!r}]")]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return [p for f, v in zip(tree._fields, tree) for p in none_paths(v, f"{prefix}.{f}")]
    if type(tree) in (list, tuple):
        return [p for i, v in enumerate(tree) for p in none_paths(v, f"{prefix}[{i}]")]
    return []


class _Leaf:
    """Where an array leaf goes in an output's skeleton (see :func:`skeleton_of`)."""

    def __repr__(self) -> str:
        return "<leaf>"


def skeleton_of(tree: Any) -> Any:
    """``tree`` with each array leaf replaced by a marker, and what has no leaf kept (``None``, an
    empty dict or list): :func:`fill_skeleton` rebuilds the whole value from the leaves, in
    :func:`leaf_paths`'s order. None where a module is in it (its leaves are its tensors).

    >>> fill_skeleton(skeleton_of((np.zeros(1), None, {})), iter([5]))
    (5, None, {})
    """
    if tree is None:
        return None
    if isinstance(tree, dict):
        out = {k: skeleton_of(v) for k, v in tree.items()}
        return None if any(v is None and tree[k] is not None for k, v in out.items()) else out
    if isinstance(tree, (list, tuple)):
        if type(tree) not in (list, tuple) and not hasattr(tree, "_fields"):
            return None   # another sequence type (torch.Size): rebuilt from its leaves' paths
        kids = [skeleton_of(v) for v in tree]
        if any(k is None and v is not None for k, v in zip(kids, tree)):
            return None
        return type(tree)(*kids) if hasattr(tree, "_fields") else type(tree)(kids)
    if _torch_kind(tree) is not None:
        return None
    return _Leaf()


def kind_change(skel: Any, tree: Any, path: str = "", depth: int = 1) -> str | None:
    """Where ``tree`` is not of the kinds its traced skeleton ``skel`` (:func:`skeleton_of`) records,
    down to ``depth`` levels (a tuple of outputs and each output's own kind, not what is inside it:
    per-epoch values in a list of the metrics, one shorter after an early stop, ran as eagerly): a
    container of another type (a dict where a list was), a list or tuple of another length, a
    container where a leaf was or the reverse; described as ``path: was, now``. A dict's keys may
    differ (a learner's metrics that come and go); None (an output not made at some calls) and what
    the skeleton does not know are not compared."""
    def kind(x: Any) -> str:
        if isinstance(x, _Leaf):
            return "a value"
        if isinstance(x, dict):
            return "a dict"
        if hasattr(x, "_fields"):
            return f"a {type(x).__name__}"
        if isinstance(x, (list, tuple)):
            return f"a {type(x).__name__} of {len(x)}"
        return "a value"

    if skel is None or tree is None or depth < 0:
        return None
    where = path or "the output"
    if isinstance(skel, _Leaf):
        if isinstance(tree, (dict, list, tuple)) and skeleton_of(tree) is not None:
            return f"{where}: {kind(skel)}, now {kind(tree)}"
        return None
    if isinstance(skel, dict):
        if not isinstance(tree, dict):
            return f"{where}: {kind(skel)}, now {kind(tree)}"
        for k, v in skel.items():
            if k in tree:
                found = kind_change(v, tree[k], f"{path}[{k!r}]", depth - 1)
                if found:
                    return found
        return None
    if isinstance(skel, (list, tuple)):
        if type(tree) is not type(skel) or len(tree) != len(skel):
            return f"{where}: {kind(skel)}, now {kind(tree)}"
        for i, (a, b) in enumerate(zip(skel, tree)):
            found = kind_change(a, b, f"{path}[{i}]", depth - 1)
            if found:
                return found
    return None


def fill_skeleton(skel: Any, leaves: Any) -> Any:
    if isinstance(skel, _Leaf):
        return next(leaves)
    if isinstance(skel, dict):
        return {k: fill_skeleton(v, leaves) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        kids = [fill_skeleton(v, leaves) for v in skel]
        return type(skel)(*kids) if hasattr(skel, "_fields") else type(skel)(kids)
    return skel


def is_static(x: Any) -> bool:
    """Configuration rather than data: a frozen dataclass instance (an algorithm's ``Args``) or a
    string. A fragment may take it as an argument; a runtime sends it once, not with every call.

    >>> is_static("adam"), is_static(np.zeros(2))
    (True, False)
    """
    if isinstance(x, (str, bytes)):
        return True
    params = getattr(type(x), "__dataclass_params__", None)
    return params is not None and params.frozen and not isinstance(x, type)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    leaves, td = flatten(tree)
    return unflatten(td, [fn(x) for x in leaves])


_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8",
    "uint64": "u64", "uint32": "u32", "uint16": "u16", "uint8": "u8", "bool": "bool",
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, dtype, array library and device of one leaf. Python scalars have dtype
    'int'/'float'/'bool'; a torch tensor on an accelerator has its device (``cuda:0``): what crosses
    a process boundary through host memory is put back there."""

    shape: tuple[int, ...]
    dtype: str
    backend: str
    device: str = "cpu"

    def short(self) -> str:
        where = "" if self.device == "cpu" else f"@{self.device}"
        return f"{_SHORT.get(self.dtype, self.dtype)}[{','.join(map(str, self.shape))}]{where}"

    @property
    def nbytes(self) -> int:
        size = int(np.prod(self.shape)) if self.shape else 1
        try:
            return size * np.dtype(self.dtype).itemsize
        except TypeError:
            return size * 8


def fits(got: TensorSpec, slot: TensorSpec) -> bool:
    """Whether a leaf of spec ``got`` goes through a channel's slot sized for ``slot`` (a Python
    number's type may change: it travels as a number)."""
    return got.shape == slot.shape and (got.dtype == slot.dtype or slot.backend == "python")


_DTYPE_NAMES: dict[Any, str] = {}   # dtype object -> its name (str() of a numpy dtype is slow)


_BY_ID: dict[int, tuple[Any, str]] = {}   # id -> (the dtype, kept alive so its id stays its own; its name)


def _dtype_name(dtype: Any) -> str:
    hit = _BY_ID.get(id(dtype))   # hashing a numpy dtype costs more than the rest of spec_of
    if hit is not None and hit[0] is dtype:
        return hit[1]
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.") if "torch" in type(dtype).__module__ else \
            str(np.dtype(dtype))
    if len(_BY_ID) < 1024:
        _BY_ID[id(dtype)] = (dtype, name)
    return name


def typed_key_note(x: Any) -> str:
    """What a typed jax PRNG key is, where ``x`` is one (its dtype ``key<fry>``), else ""."""
    return f" (a typed jax PRNG key, {x.dtype}, which holds no array of numbers)" if _typed_key(x) else ""


def typed_key_fix(x: Any) -> str | None:
    return ("pass its numbers, jax.random.key_data(key), and wrap them again inside the fragment "
            "(jax.random.wrap_key_data); or use jax.random.PRNGKey keys or ff.random keys") if _typed_key(x) else None


def _typed_key(x: Any) -> bool:
    return type(x).__module__.startswith(("jax", "jaxlib")) and str(getattr(x, "dtype", "")).startswith("key<")


def spec_of(x: Any) -> TensorSpec:
    if type(x) is np.ndarray:   # the common case first
        return TensorSpec(x.shape, _dtype_name(x.dtype), "numpy")
    backend = backend_of(x)
    if backend == "python":   # the builtin's name, for subclasses too (the tracer's probes)
        return TensorSpec((), "bool" if isinstance(x, bool) else "int" if isinstance(x, int) else "float", "python")
    if backend == "torch":
        device = x.device
        return TensorSpec(tuple(x.shape), _dtype_name(x.dtype), "torch", "cpu" if device.type == "cpu" else str(device))
    if backend is None:
        raise NotAnArray("", x)
    return TensorSpec(tuple(x.shape), _dtype_name(x.dtype), backend)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view (or copy, for device arrays) of an array leaf."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        # (each step only where it changes something: a broadcast converts every leaf of a state each update)
        t = x.detach() if x.requires_grad or type(x) is not torch.Tensor else x
        if not t.is_cpu:
            t = t.cpu()
        if t.dtype is torch.bfloat16:   # (numpy's own dtypes lack it: ml_dtypes', as jax's arrays have)
            return t.view(torch.int16).numpy().view(bfloat16())
        return t.numpy()
    return np.asarray(x)


def bfloat16() -> np.dtype:
    """numpy's bfloat16 (from ml_dtypes, which jax installs)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def from_numpy(arr: np.ndarray, backend: str, device: str = "cpu") -> Any:
    """A leaf received as numpy, in the library it was traced in (torch: the same memory, or a copy
    on its traced ``device``; jax: a copy on the default device)."""
    if backend == "torch":
        import torch

        # (isbuiltin: 2 for a type another library registered, as ml_dtypes' bfloat16; .name is slow)
        t = torch.from_numpy(arr) if arr.dtype.isbuiltin != 2 or arr.dtype.name != "bfloat16" else \
            torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return t if device == "cpu" else t.to(device, non_blocking=False)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(arr)
    return arr


def private(leaf: Any) -> Any:
    """A leaf received as a view of shared memory, as a copy of its own (a leaf on a device, or a
    Python number, is one already)."""
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.clone() if leaf.is_cpu else leaf
    if backend_of(leaf) == "jax":
        import jax.numpy as jnp

        return jnp.array(leaf, copy=True)
    return leaf


def from_keys(keys: tuple[tuple[Any, ...], ...], leaves: list[Any]) -> Any:
    """Rebuild an output from its leaves and their key paths: int keys make tuples, others dicts.

    >>> from_keys(((0,), (1, "a")), [1, 2])
    (1, {'a': 2})
    """
    if len(keys) == 1 and keys[0] == ():
        return leaves[0]
    root: dict[Any, Any] = {}
    for path, leaf in zip(keys, leaves):
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: build(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items):
            return tuple(items[i] for i in sorted(items))
        return items

    return build(root)
