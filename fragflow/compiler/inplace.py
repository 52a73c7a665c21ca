"""What a fragment's call changes in place among its arguments, for the tracer to see whether a
later call is given it again: the memory an array spans (another view of it, a tensor sharing
it, counts), and the entries of a container (a batch dict whose entries it replaced)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fragflow.compiler.pytree import NotAnArray, leaf_paths
from fragflow.compiler.statecheck import fingerprint
from fragflow.source import SourceLoc


@dataclass
class Changed:
    """An argument a fragment changed in place: an array (``bounds``: its memory) or a container
    (``bounds`` None), as it was after the change (``after``)."""

    value: Any
    bounds: tuple[str, int, int] | None   # an array's memory: device, first byte, end
    after: Any                            # an array's fingerprint, a container's entries
    changer: str
    label: str
    at: SourceLoc | None
    producer: str | None                  # the fragment whose output it is (None: the loop made it)

    def now(self) -> Any:
        """What ``after`` is now: unchanged, the later call is given the change."""
        return entries(self.value) if self.bounds is None else fingerprint(self.value)


def memory_bounds(x: Any) -> tuple[str, int, int] | None:
    """The memory an array's elements span: (device, first byte, end); None where it has none."""
    if isinstance(x, np.ndarray):
        if x.size == 0:
            return None
        start, itemsize = x.__array_interface__["data"][0], x.itemsize
        dims = list(zip(x.shape, x.strides))
        device = "cpu"
    else:
        if not x.numel():
            return None
        itemsize = x.element_size()
        start, dims = x.data_ptr(), [(n, st * itemsize) for n, st in zip(x.shape, x.stride())]
        device = str(x.device)
    low = start + sum((n - 1) * st for n, st in dims if st < 0)
    high = start + sum((n - 1) * st for n, st in dims if st > 0) + itemsize
    return device, low, high


def overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def containers(values: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(argument and path, container) of the dicts and lists in ``values``, two levels down."""
    out: list[tuple[str, Any]] = []

    def walk(label: str, x: Any, depth: int) -> None:
        if isinstance(x, (dict, list)) and depth < 3:
            out.append((label, x))
            for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
                walk(f"{label}[{k!r}]", v, depth + 1)

    for name, value in values:
        walk(name, value, 0)
    return out


def entries(box: Any) -> Any:
    """What a container holds, by identity (an entry replaced, added or removed changes it)."""
    return tuple((k, id(v)) for k, v in box.items()) if isinstance(box, dict) else tuple(map(id, box))


def array_leaves(values: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(argument and path, leaf) of the numpy arrays and torch tensors in ``values``."""
    out: list[tuple[str, Any]] = []
    for name, value in values:
        try:
            leaves = leaf_paths(value)
        except NotAnArray:
            continue
        out.extend((f"{name}{path}", leaf) for path, leaf in leaves
                   if isinstance(leaf, np.ndarray) or hasattr(leaf, "detach"))
    return out
