"""What ``multi_learner``'s learners compare as each update ends: a checksum of each part of the
state each made (see GradientAllReduce.update), and the refusal where they differ: a value a learner
computed from its own share of the batch (a running statistic, a counter, a BatchNorm's running
moments), of which learner 0's alone would be published, reported and checkpointed."""

from __future__ import annotations

import zlib
from typing import Any

from fragflow.errors import ConfigError

SMALL = 1024
"""Arrays of up to this many values in a learner's state are compared at every update; larger ones
(parameters, optimizer moments) at the first 16 and every 16th (see GradientAllReduce.update)."""


def key(checksums: list[int]) -> int:
    """One number for a list of checksums, small enough for the digits the learners' all-reduces carry."""
    return zlib.crc32(repr(checksums).encode()) % 251 ** 3


def state_sums(state: Any, name: str, whole: bool = True) -> list[tuple[str, int]]:
    """(path, checksum) of each part of a learner's new state: its arrays, numbers, modules' tensors
    and optimizers' states (their bytes), and its optimizers' settings (a rate set from a share).
    ``whole=False``: the arrays of up to :data:`SMALL` values alone (statistics, counters), and the
    settings, not the parameters and their optimizer's moments (0.55 ms for PPO's 134k parameters
    with Adam's moments; a large network's copy from a GPU each update would cost more)."""
    import numpy as np
    import torch

    from fragflow.compiler.pytree import NotAnArray, leaf_paths
    from fragflow.compiler.statecheck import fingerprint

    if state is None:
        return []
    try:
        leaves = leaf_paths(state, name)
    except NotAnArray:
        return []
    out = []
    for path, leaf in leaves:
        if not whole and (int(leaf.numel()) if isinstance(leaf, torch.Tensor) else int(np.size(leaf))) > SMALL:
            continue
        try:
            out.append((path, fingerprint(leaf, counters=False)[0]))
        except (RuntimeError, TypeError, ValueError, IndexError):   # (no bytes to read: a sparse tensor's, say)
            out.append((path, zlib.crc32(repr((type(leaf), getattr(leaf, "shape", None))).encode())))
    for path, opt in optimizers_at(state, name):
        for i, group in enumerate(opt.param_groups):
            for k, v in group.items():   # (numbers: an object's repr may hold its address, another in each process)
                if k != "params" and all(isinstance(x, (int, float)) for x in (v if isinstance(v, (tuple, list)) else [v])):
                    out.append((f"{path}.param_groups[{i}][{k!r}]", zlib.crc32(repr(v).encode())))
    return out


def optimizers_at(tree: Any, path: str = "") -> Any:
    """(path, optimizer) of each optimizer in ``tree``, its path as :func:`leaf_paths` writes them."""
    import torch

    if isinstance(tree, torch.optim.Optimizer):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from optimizers_at(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from optimizers_at(v, f"{path}[{i}]")


def apart(fragment: str, paths: list[str], where: Any, learned: bool = True) -> ConfigError:
    """The refusal of learners whose new states differ at ``paths`` (none: their structure);
    ``learned``: whether the learner has averaged a gradient yet (else it learns without torch's)."""
    if not learned:
        return ConfigError(
            f"multi_learner averages the gradients '{fragment}' computes, and it computed none (no backward() "
            "into the parameters of its versioned state, no torch.autograd.grad), while its learners' new states "
            "differ (each learned from its own share)", where=where,
            fix="compute gradients with torch (backward() into the parameters of the versioned state's modules or "
                "tensors, or torch.autograd.grad), or use a single-learner policy")
    named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "") if paths else \
        "its structure"
    norms = any(k in p for p in paths for k in ("running_mean", "running_var", "num_batches_tracked"))
    why = ("a BatchNorm's running statistics, which each learner keeps over its own share of the batch" if norms
           else "a value each learner computes from its own share of the batch: a running statistic, a "
                "coefficient adapted to its share's KL, a counter of its share's events, a rate set from its loss")
    return ConfigError(
        f"after an update of '{fragment}' its learners hold different values of {named} ({why}), and "
        "multi_learner's learners must stay identical: learner 0's state alone is published to the actors, "
        "reported and checkpointed, so the run would depend on which learner's share it was", where=where,
        fix=("use a norm without running statistics (LayerNorm, GroupNorm, BatchNorm with "
             "track_running_stats=False), or run a single-learner policy (pipelined, actor_learner)") if norms else
            "compute it from what every learner holds alike: a statistic of the whole batch from the learners' "
            "sums (`if ff.learners() > 1: torch.distributed.all_reduce(sums)`, in every learner "
            "alike, as mappo.py's return moments are), the parameters, the update count, an argument without a "
            "batch axis; or return it as a metric rather than keep it in the versioned state; or run a "
            "single-learner policy (pipelined, actor_learner)")
