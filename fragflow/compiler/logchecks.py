"""What ``ff.log`` may take, checked at the line that logs it while tracing: numbers, named apart from
the columns and TensorBoard tags the run writes itself and from each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow.compiler.pytree import NotAnArray, leaf_paths, spec_of
from fragflow.errors import NotArrayPytreeError, TraceError
from fragflow.source import SourceLoc, user_callsite


def check_scalars(tree: Any, where: SourceLoc | None, tags: dict[str, tuple[str, SourceLoc | None]]) -> dict[str, float]:
    """What ``ff.log(tree)`` writes, by column, once checked (``tags``: the TensorBoard tags logged so far,
    by the name and line that took each)."""
    try:
        leaves = leaf_paths(tree)
    except NotAnArray as bad:
        raise NotArrayPytreeError(f"ff.log got {bad.path or 'a value'} of type {type(bad.value).__qualname__}",
                                  where=where, fix="log numbers or 0-d arrays, e.g. ff.log({'loss': loss})") from None
    for path, leaf in leaves:
        spec = spec_of(leaf)
        if spec.shape and int(np.prod(spec.shape)) != 1:
            raise TraceError(f"ff.log got {path or 'its value'} with shape {spec.shape}, not a scalar",
                             where=where, fix="log scalars: reduce it first (x.mean(), x.max()) or log its "
                                              "elements under names of their own")
    from fragflow.runtime.outputs import CHANNEL_COLUMNS, EVAL_COLUMNS, RUN_TAGS, RUNTIME_COLUMNS, tb_tag
    from fragflow.runtime.scalars import flat_scalars

    # (the channel's columns too, though single_process has none: the program must run under every policy)
    taken = RUNTIME_COLUMNS + EVAL_COLUMNS + CHANNEL_COLUMNS
    scalars = flat_scalars(tree)
    clash = [name for name in scalars if name in taken]
    if clash:
        raise TraceError(f"ff.log got '{clash[0]}', the name of a column the run writes itself "
                         f"({', '.join(taken)}): it would overwrite it", where=where,
                         fix=f"log it under a name of its own, e.g. ff.log({{'my_{clash[0]}': ...}})")
    for name in scalars:
        tag = tb_tag(name)
        if tag in RUN_TAGS:
            column = tag.split("/", 1)[1]
            raise TraceError(f"ff.log got '{name}', the TensorBoard tag the run writes its own "
                             f"{'episodes' if 'episodic' in tag else f'column {column!r}'} "
                             "under: the two series would be mixed", where=where,
                             fix=f"log it under a name of its own, e.g. ff.log({{'my_{column}': ...}})")
        other = tags.setdefault(tag, (name, where))
        if other[0] != name:
            raise TraceError(f"ff.log got '{name}', and '{other[0]}' at {other[1]}: both are TensorBoard tag "
                             f"'{tag}' (a name without a '/' is logged under 'losses/'), so the two series "
                             "would be mixed", where=where,
                             fix=f"rename one of them (ff.log({{'{name}_2': ...}}))")
    return scalars


def log_sources(tree: Any, where: SourceLoc | None, origin_of: Callable[[Any], Any],
                logged_by: dict[str, tuple[str, SourceLoc | None]]
                ) -> tuple[str, str, SourceLoc | None, SourceLoc | None] | None:
    """Note which learner (``""``: the loop) each name ``ff.log(tree)`` writes comes from, in ``logged_by``;
    returns the first name logged both from a learner's output and from the loop's own values (name,
    learner, the learner's line, the loop's), else None: where the learner runs in another process,
    its value and the loop's reach the driver in either order."""
    from fragflow.runtime.scalars import named_leaves

    clash = None
    for name, leaf in named_leaves(tree):
        origin = origin_of(leaf)
        learner = origin.node if origin is not None and origin.role == "learner" else ""
        seen = logged_by.get(name)
        if seen is None:
            logged_by[name] = (learner, where or user_callsite())
        elif clash is None and bool(seen[0]) != bool(learner):
            here = where or user_callsite()
            clash = (name, seen[0] or learner, seen[1] if seen[0] else here, here if seen[0] else seen[1])
    return clash
