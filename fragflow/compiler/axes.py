"""Batch-axis inference while tracing: which leaves carry one row per environment.

Env fragments, rollout and replay buffers declare their axes; what they do not cover is inferred
here from sizes: a user's env sized with ``ff.envs.ids``, a fragment that declares nothing (a
user's ``act``) keeping its inputs' ``env`` batch, arrays the loop makes beside a batch of
environments or a rollout, and an array that is another one seen through another library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow.api.fragment import Fragment
from fragflow.compiler.inplace import memory_bounds
from fragflow.compiler.ir import LeafSpec
from fragflow.compiler.pytree import backend_of

Axes = Callable[[str], "tuple[str, int] | None"]
Leaves = list[tuple[str, str, Any]]   # (port, path, leaf) of a call's outputs


def sized_by_ids(frag: Fragment, leaves: Leaves, env_counts: set[int]) -> Axes | None:
    """A user's env fragment that returns no gymnasium step (its ``reset``): leaves whose leading
    size is a number of environments the program asked ``ff.envs.ids`` for are ``env`` axis 0."""
    if frag.role != "env" or frag.evaluation or not env_counts:
        return None
    batched = {path for _, path, x in leaves if getattr(x, "ndim", 0) >= 1 and x.shape[0] in env_counts}
    return (lambda path: ("env", 0) if path in batched else None) if batched else None


def env_rows(inputs: list[LeafSpec]) -> int | None:
    """How many environments a call's batched inputs carry on axis 0 (None: none, or several sizes)."""
    sizes = {leaf.spec.shape[0] for leaf in inputs if leaf.axis == 0 and leaf.axis_name == "env" and leaf.spec.shape}
    return sizes.pop() if len(sizes) == 1 else None


def loop_rows(inputs: list[LeafSpec], loop_made: list[tuple[int, Any]],
              per_env: list[tuple[Any, tuple[str, int]]] = ()) -> None:  # type: ignore[assignment]
    """Arrays the loop made and passed beside a batch of environments on axis 0, with that many
    rows (a recurrent state carried from step to step, a mask of done environments), are rows
    one per environment too, as a fragment's outputs of that leading size are: a policy that
    splits the environments splits them, and a served call merges the workers' rows. Beside a
    rollout (``[time, env, ...]`` leaves), arrays the loop computed from it per step and environment
    (advantages, returns) start ``[time, env]``, per environment (a bootstrap value) ``[env]``.
    With neither beside them, nothing tells a per-environment array (episode scores kept per
    environment) from one that merely has as many rows (a vector of two constants with two
    environments): such an array is taken whole, and the run refuses a per-environment one at the
    call, with the fix; but one whose shape past its first axis is that of a per-environment array
    of two or more axes the run made (``per_env``: the fragments' latest outputs with an ``env``
    axis 0, an observation's ``[env, 4]``) is a stack of them, ``[time, env, ...]``, as CleanRL's
    storage (``obs = np.zeros((num_steps, env.num_envs, 4)); obs[step] = next_obs``) or
    ``np.stack`` of a value per step makes it: the environments on axis 1, and the ``[time, env]``
    arrays beside it (rewards, values, log-probabilities stacked alike) with them (where that is
    only the size of one, the acting processes' arrays, not split, are refused at the call; a
    ``[rows, features]`` array, a flattened minibatch, is never taken for a stack).
    ``inputs`` (and each edge's leaves, ``loop_made``: (index into inputs, edge)) are updated."""
    stacked = {tuple(array.shape) for array, (name, axis) in per_env
               if name == "env" and axis == 0 and getattr(array, "ndim", 0) >= 2}
    stacks = set()
    for i, edge in loop_made:
        leaf = inputs[i]
        if leaf.axis is None and len(leaf.spec.shape) >= 3 and tuple(leaf.spec.shape[1:]) in stacked:
            _mark(inputs, i, edge, leaf, 1)   # a stack of per-environment arrays, beside the batch or alone
            stacks.add(i)
    n = env_rows(inputs)
    steps = {leaf.spec.shape[:2] for leaf in inputs
             if leaf.axis == 1 and leaf.axis_name == "env" and len(leaf.spec.shape) >= 2}
    if n is None and len(steps) == 1:
        n = next(iter(steps))[1]
    if n is None:
        return
    for i, edge in loop_made:
        leaf = inputs[i]
        if i in stacks:
            continue
        axis = 1 if len(steps) == 1 and leaf.spec.shape[:2] == next(iter(steps)) else \
            0 if leaf.spec.shape and leaf.spec.shape[0] == n else None
        if axis is not None:
            _mark(inputs, i, edge, leaf, axis)


def _mark(inputs: list[LeafSpec], i: int, edge: Any, leaf: LeafSpec, axis: int) -> None:
    rows = dataclasses.replace(leaf, axis=axis, axis_name="env")
    inputs[i] = rows
    key = (leaf.src_path, leaf.dst_path)
    if edge.leaves.get(key) == leaf:
        edge.leaves[key] = rows


def view_axis(leaf: Any, known: list[tuple[Any, tuple[str, int]]]) -> tuple[str, int] | None:
    """The ``env`` axis of an array the loop made as a view of a per-environment one (``known``:
    (array, its axis)): the view's one axis that spans the same memory as that array's environment
    axis, whole (its size and stride). ``rollout["obs"][0:8]``, a transpose, a field of a record
    keep the environments; ``[:, 0]``, ``[:, ::2]`` or a flattening do not, and are not followed."""
    mine = _layout(leaf)
    if mine is None:
        return None
    bounds = memory_bounds(leaf)
    for array, (name, axis) in known:
        theirs = _layout(array)
        if theirs is None or array is leaf or theirs[2] != mine[2] or axis >= len(theirs[0]):
            continue
        size, stride = theirs[0][axis], theirs[1][axis]
        outer = memory_bounds(array)
        if size < 2 or bounds is None or outer is None or not (outer[0] == bounds[0] and outer[1] <= bounds[1]
                                                               and bounds[2] <= outer[2]):
            continue
        axes = [i for i, (n, st) in enumerate(zip(*mine[:2])) if n == size and st == stride]
        if len(axes) == 1:
            return name, axes[0]
    return None


def _layout(x: Any) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(shape, strides in bytes, element size) of a numpy array or torch tensor with elements."""
    if isinstance(x, np.ndarray):
        return (x.shape, x.strides, x.itemsize) if x.size else None
    if backend_of(x) == "torch" and x.numel():
        size = x.element_size()
        return tuple(x.shape), tuple(st * size for st in x.stride()), size
    return None


def inherited_axes(inputs: list[LeafSpec], leaves: Leaves) -> Axes | None:
    """A fragment that declares no axes (a user's ``act``) keeps its inputs' ``env`` batch: when
    its batched inputs have the environments on axis 0, outputs with that leading size do too."""
    n = env_rows(inputs)
    if n is None:
        return None
    batched = {path for _, path, x in leaves if getattr(x, "ndim", 0) >= 1 and x.shape[0] == n}
    return lambda path: ("env", 0) if path in batched else None


def address(x: Any) -> tuple[int, tuple[int, ...], int] | None:
    """Where an array's elements start in host memory, its shape and element size (None: not a
    numpy array or a CPU torch tensor with elements): ``torch.as_tensor(obs)`` is ``obs``."""
    if isinstance(x, np.ndarray):
        return (x.__array_interface__["data"][0], x.shape, x.itemsize) if x.size else None
    if backend_of(x) == "torch" and x.device.type == "cpu" and x.numel():
        return x.data_ptr(), tuple(x.shape), x.element_size()
    return None
