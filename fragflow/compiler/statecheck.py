"""Checks of what a fragment was given and what a learner returns: a checksum of a tree's arrays (did a
fragment change what it read, in place), and whether a learner's new state is shaped like the state
it was given."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from fragflow.api.versioned import Versioned
from fragflow.compiler.pytree import NotAnArray, leaf_paths, spec_of
from fragflow.errors import VersionedStateError
from fragflow.source import SourceLoc


def fingerprint(tree: Any, counters: bool = True) -> list[int]:
    """A checksum of each array leaf's bytes, and of a torch tensor its version counter too (any
    in-place operation moves it, one that leaves the values as they were included: ``w.mul_(1)``,
    a step on zeros): whether a fragment changed what it read in place. ``counters=False``: the
    values alone (a view shares its base's counter: a write to another part of the base moves it)."""
    try:
        leaves = leaf_paths(tree)
    except NotAnArray:
        return []
    out = []
    for _, leaf in leaves:
        if hasattr(leaf, "detach"):
            if counters and not leaf.is_inference():   # (made under inference_mode: it keeps no version counter)
                out.append(int(leaf._version))
            leaf = leaf.detach().cpu().reshape(-1)
            try:
                leaf = leaf.numpy()
            except TypeError:   # a dtype numpy lacks (bfloat16): its bytes
                leaf = leaf.contiguous().view(_torch_uint8()).numpy()
        out.append(zlib.crc32(_bytes(leaf)))
    return out


def grad_flags(tree: Any) -> list[bool]:
    """The requires_grad of each torch tensor and module parameter in ``tree`` (an actor freezing a
    layer changes the state as a write would; a module's leaves as pytrees walk them are detached)."""
    if isinstance(tree, dict):
        return [f for v in tree.values() for f in grad_flags(v)]
    if isinstance(tree, (list, tuple)):
        return [f for v in tree for f in grad_flags(v)]
    parameters = getattr(tree, "parameters", None)
    if callable(parameters) and hasattr(tree, "named_modules"):   # (a torch module)
        return [bool(p.requires_grad) for p in parameters()]
    grad = getattr(tree, "requires_grad", None)
    return [grad] if isinstance(grad, bool) else []


def _bytes(leaf: Any) -> Any:
    """An array's bytes, whatever its dtype (one the buffer protocol lacks, ml_dtypes' bfloat16, too)."""
    arr = np.ascontiguousarray(leaf).reshape(-1)
    return arr.view(np.uint8).data if arr.dtype.kind == "V" or arr.dtype.char == "E" or \
        type(arr.dtype).__module__.startswith("ml_dtypes") else arr.data


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def reshaped(learner: str, state: str, given: set[str], got: set[str], where: SourceLoc | None,
             when: str = "") -> VersionedStateError:
    """A learner's new state whose leaves are not the state's (``given``: its leaf paths; ``got``:
    the new state's), at its first write (while tracing) or any later one (``when``: which)."""
    def some(paths: set[str]) -> str:
        return ", ".join(sorted(paths)[:4]) + (", ..." if len(paths) > 4 else "") if paths else "none"
    return VersionedStateError(
        f"learner '{learner}' returned, as the next version of '{state}', a value that is not shaped "
        f"like the state it was given (missing: {some(given - got)}; not in the state: {some(got - given)}){when}",
        where=where, fix=f"return the new state first, with the same structure: return {state}, metrics (a value "
                         "it adds later belongs in the state from the start: ff.versioned({..., 'extra': "
                         f"np.zeros(...)}})); a learner that only reads '{state}' (it computes metrics, changes "
                         "nothing) is declared @ff.fragment(\"learner\", writes=None)")


def check_new_state(learner: str, handle: Versioned, leaves: list[tuple[str, Any]], where: SourceLoc | None) -> None:
    """A learner's first new state (``leaves``) must be shaped like the state it was given: the same
    leaves, each with its shape, dtype and array library."""
    try:
        before = dict(leaf_paths(handle.value))
    except NotAnArray:
        return
    given, got = set(before), {p for p, _ in leaves}
    if got != given:
        raise reshaped(learner, handle.name, given, got, where)
    for p, leaf in leaves:
        was, now = spec_of(before[p]), spec_of(leaf)
        if (was.shape, was.dtype, was.backend) != (now.shape, now.dtype, now.backend):
            raise VersionedStateError(
                f"learner '{learner}' returned, as the next version of '{handle.name}', {p} as {now.short()} "
                f"{now.backend}, but the state it was given holds {was.short()} {was.backend}", where=where,
                fix="keep every leaf's shape, dtype and array library (cast back, e.g. x.astype(old.dtype)), "
                    "or create the state as the learner returns it")
