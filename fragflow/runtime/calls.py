"""Calls that cross processes: a call's arguments split into a static *skeleton* and its array leaves.

The skeleton is what stays the same from call to call (the containers, configuration such as a
frozen ``Args``, and references: to versioned state, or to an earlier output of a fragment in the
receiving process); the leaves go through a ring, stamped with a version. The receiving process
rebuilds the arguments from the skeleton, the leaves and its own values.

>>> skel, leaves = split({"x": np.zeros(2), "cfg": "adam"})
>>> skel
('dict', ('x', 'cfg'), (('leaf',), ('static', 'adam')))
>>> build(skel, iter(leaves), resolve=None)["cfg"]
'adam'
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fragflow.api.versioned import Pending, Versioned, VersionedView
from fragflow.compiler.pytree import (
    TensorSpec,
    backend_of,
    fits,
    is_static,
    leaf_paths,
    spec_of,
    structure,
    structure_paths,
    to_numpy,
    unsaved_paths,
)
from fragflow.compiler.statecheck import reshaped
from fragflow.errors import ConfigError, NonFiniteError, NotArrayPytreeError, SpecChangedError
from fragflow.source import SourceLoc, user_callsite

Skeleton = tuple[Any, ...]


def split(value: Any, leaves: list[Any] | None = None, path: str = "") -> tuple[Skeleton, list[Any]]:
    out: list[Any] = [] if leaves is None else leaves
    return _split(value, out, path), out


def split_arguments(arguments: dict[str, Any], given: frozenset[str] = frozenset(),
                    lag_of: Callable[[Pending], int] | None = None) -> tuple[Skeleton, list[Any], dict[str, Any]]:
    """A call's bound arguments: its skeleton, its leaves, and the values of the leaves at ``given``
    paths (``roll['obs']``), which the skeleton names ``("given", path)`` instead. An output of
    another call is named ``("ref", fragment, index, keys, None)``: that fragment's latest output;
    one the loop kept past later calls of it (``lag_of`` says how many) is ``("ref", ..., "@path")``,
    the number of the call that made it sent with the call as the gift ``"@path"``."""
    leaves: list[Any] = []
    gifts: dict[str, Any] = {}
    keys = tuple(arguments)
    skel = ("dict", keys, tuple(_split(arguments[k], leaves, str(k), given, gifts, lag_of) for k in keys))
    return skel, leaves, gifts


def _split(x: Any, out: list[Any], path: str, given: frozenset[str] = frozenset(),
           gifts: dict[str, Any] | None = None, lag_of: Callable[[Pending], int] | None = None) -> Skeleton:
    if backend_of(x) is not None:
        if path in given and gifts is not None:
            gifts[path] = x
            return ("given", path)
        out.append(x)
        # (numpy's scalar, np.float32 of a space's bound: received as a 0-d array, given back as the scalar)
        return ("leaf", "scalar") if isinstance(x, np.generic) else ("leaf",)
    if x is None:
        return ("none",)
    if isinstance(x, Pending):
        if lag_of is None or gifts is None or not lag_of(x):
            return ("ref", x.fragment, x.index, x.path_keys, None)
        gifts["@" + path] = x.call
        return ("ref", x.fragment, x.index, x.path_keys, "@" + path)
    if isinstance(x, Versioned):
        return ("state", x.name, ())
    if isinstance(x, VersionedView):
        return ("state", x.handle.name, x.path)
    if is_static(x):
        return ("static", x)
    if isinstance(x, dict):
        keys = tuple(x)
        return ("dict", keys, tuple(_split(x[k], out, f"{path}[{k!r}]", given, gifts, lag_of) for k in keys))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return ("namedtuple", type(x), tuple(_split(v, out, f"{path}.{f}", given, gifts, lag_of)
                                             for f, v in zip(x._fields, x)))
    if isinstance(x, (list, tuple)):
        return ("list" if isinstance(x, list) else "tuple",
                tuple(_split(v, out, f"{path}[{i}]", given, gifts, lag_of) for i, v in enumerate(x)))
    raise NotArrayPytreeError(f"argument leaf {path or '<root>'} is a {type(x).__module__}.{type(x).__qualname__}",
                              fix="fragments take pytrees (dict/list/tuple) of numpy, torch or jax arrays, "
                                  "Python numbers, and configuration (a frozen dataclass, a string)")


_SID_BITS = 20
_CALL_BITS = 35
_AGAIN_BIT = _SID_BITS + _CALL_BITS
_CUT_SHIFT = _AGAIN_BIT + 1
CUT_MARKS = 127


def pack_aux(sid: int, call: int, cut: int = 0, again: bool = False) -> int:
    """A remote call's word for the service: its skeleton id, the fragment's call number in this
    loop (the driver writes what the loop logged of which call), whether no environment was stepped
    since the loop's previous call of the clock learner (another learner step on the same rollout), and the mark of
    the last checkpoint the loop had saved its part of when it made the call (the service saves its
    states at that cut, so that the two parts agree)."""
    return sid | (call << _SID_BITS) | (int(again) << _AGAIN_BIT) | (cut << _CUT_SHIFT)


def unpack_aux(aux: int) -> tuple[int, int, int]:
    """``(sid, call, cut)`` of :func:`pack_aux`."""
    return aux & ((1 << _SID_BITS) - 1), (aux >> _SID_BITS) & ((1 << _CALL_BITS) - 1), aux >> _CUT_SHIFT


def again_of(aux: int) -> bool:
    """Whether the call was made with no environment stepped since the loop's previous call of the
    clock learner (see :func:`pack_aux`)."""
    return bool((aux >> _AGAIN_BIT) & 1)


def cut_mark(seq: int) -> int:
    """Checkpoint ``seq``'s mark in :func:`pack_aux` (1..127; 0 is before any checkpoint)."""
    return (seq - 1) % CUT_MARKS + 1


def build(skel: Skeleton, leaves: Iterator[Any], resolve: Callable[[Skeleton], Any] | None) -> Any:
    kind = skel[0]
    if kind == "leaf":
        leaf = next(leaves)
        return leaf[()] if len(skel) > 1 and isinstance(leaf, np.ndarray) and leaf.ndim == 0 else leaf
    if kind == "none":
        return None
    if kind == "static":
        return skel[1]
    if kind in ("ref", "state", "given"):
        assert resolve is not None
        return resolve(skel)
    if kind == "dict":
        return {k: build(c, leaves, resolve) for k, c in zip(skel[1], skel[2])}
    if kind == "namedtuple":
        return skel[1](*[build(c, leaves, resolve) for c in skel[2]])
    kids = [build(c, leaves, resolve) for c in skel[1]]
    return kids if kind == "list" else tuple(kids)


def argument_paths(skel: Skeleton, path: str = "") -> list[str]:
    """Where each leaf of a call's skeleton (:func:`split_arguments`'s) is in its arguments, in leaf
    order and written as :func:`_split` writes them (``batch['obs']``), for messages."""
    kind = skel[0]
    if kind == "leaf":
        return [path]
    if kind == "dict":
        return [p for k, c in zip(skel[1], skel[2]) for p in argument_paths(c, f"{path}[{k!r}]" if path else str(k))]
    if kind == "namedtuple":
        return [p for f, c in zip(skel[1]._fields, skel[2]) for p in argument_paths(c, f"{path}.{f}")]
    if kind in ("list", "tuple"):
        return [p for i, c in enumerate(skel[1]) for p in argument_paths(c, f"{path}[{i}]")]
    return []


def check_leaves(leaves: list[Any], specs: tuple[TensorSpec, ...], fragment: str, where: SourceLoc | None,
                 replicas: int = 1, skeleton: Skeleton | None = None, one: str = "one acting process") -> None:
    """The leaves a call sends must match the traced specs its ring was sized for (``replicas``: the
    loop's processes, each stepping its share of the environments; ``where``: the call's line, None
    for the user's line on the stack, found only if it is refused; ``skeleton``: the call's, which
    says where each leaf is in its arguments, for the message; ``one``: the policy with one acting
    process, as a fix names it: ``actor_learner(actors=1)``, ``central_inference(env_workers=1)``)."""
    if len(leaves) != len(specs):
        raise SpecChangedError(f"fragment '{fragment}' was called with {len(leaves)} array leaves, "
                               f"but it was traced with {len(specs)}", where=where or user_callsite(),
                               fix="pass the same pytree on every call (channels are sized from the traced call)")
    for i, (x, spec) in enumerate(zip(leaves, specs)):
        got = spec_of(x)
        if not fits(got, spec):
            paths = argument_paths(skeleton) if skeleton is not None else []   # (only here: it costs)
            leaf = f"{paths[i]} (argument leaf {i})" if i < len(paths) and paths[i] else f"argument leaf {i}"
            message = (f"fragment '{fragment}' got {leaf} as {got.short()} {got.backend}, "
                       f"but it was traced as {spec.short()} {spec.backend}")
            fix = "keep every argument's shape and dtype fixed across calls (pad or bucket variable-size data)"
            inner = _shared_axis(got.shape, spec.shape, replicas) if got.dtype == spec.dtype else None
            if inner:
                message += (f"; the training loop runs in {replicas} processes here, each stepping its share of "
                            f"the environments, and this leaf, made in the loop, has them on axis {inner}, not "
                            "first: fragflow follows per-environment arrays the loop makes with the environments "
                            "on their first axis (a recurrent state in the [1, env, hidden] layout)")
                fix = ("keep the environments first in what the loop holds ([env, hidden]) and move the axis inside "
                       "the fragment where the network wants it (h.transpose(0, 1), h[None]); or run with " + one)
            elif replicas > 1 and got.dtype == spec.dtype and len(got.shape) >= 2 and got.shape[0] != got.shape[1] \
                    and got.shape[:2] == spec.shape[1::-1] and got.shape[2:] == spec.shape[2:]:
                message += (f"; the training loop runs in {replicas} processes here, each stepping its share of "
                            "the environments, and this leaf's first two sizes are the trace's swapped: an array "
                            "of [time, env] the loop stacked and gave to collect() (np.stack of a value per step), "
                            "where the rollout has as many steps as environments, was taken as one row per "
                            "environment ([env, ...]) and split on its first axis")
                fix = ("give the value to the buffer at each step (buf.add(..., logp=logp)), so that it travels as "
                       "the rollout does; or make num_steps differ from num_envs; or run with " + one)
            elif replicas > 1 and got.dtype == spec.dtype and (k := _whole_rows(got.shape, spec.shape, replicas)) >= 0:
                on = f" on axis {k}" if k else ""   # ([time, env] beside a rollout: returns the loop computes)
                message += (f"; the training loop runs in {replicas} processes here, each stepping "
                            f"{spec.shape[k]} of the {got.shape[k]} environments, and this leaf, made in the loop, "
                            f"has a row for every environment of the run{on} (sized with the run's count, as "
                            f"args.num_envs, or a size that only equals it: a statistic over as many features), "
                            f"where this process holds its {spec.shape[k]}")
                fix = ("size per-environment arrays with env.num_envs (the environments this process steps) or make "
                       "them from env.ids (ff.random.keys(seed, env.ids)), or pass them in the rollout; compute "
                       "anything else from the batch inside a fragment or keep it in versioned state; or run with "
                       + one)
            elif replicas > 1 and got.dtype == spec.dtype and got.shape != spec.shape:
                message += (f"; the training loop runs in {replicas} processes here, each stepping its share of "
                            "the environments, and this leaf was made in the loop from per-environment data whose "
                            "environment axis fragflow cannot follow (sliced, reshaped or flattened; or given with "
                            "nothing per-environment beside it, as episode scores kept per environment), so its size "
                            "changed with the share")
                fix = ("pass per-environment data in the rollout, as the buffer returns it ([time, env, ...] arrays, "
                       "merged across processes along the env axis: buf.add(..., score=score)), or beside "
                       "per-environment data the fragment also takes, and slice, reshape or flatten it inside the "
                       "fragment; or run with " + one)
            raise SpecChangedError(message, where=where or user_callsite(), fix=fix)


def _one_axis_apart(got: tuple[int, ...], traced: tuple[int, ...]) -> int:
    """The one axis on which two shapes of as many axes differ; -1 where none or several do."""
    if len(got) != len(traced):
        return -1
    differ = [k for k, (g, t) in enumerate(zip(got, traced)) if g != t]
    return differ[0] if len(differ) == 1 else -1


def _whole_rows(got: tuple[int, ...], traced: tuple[int, ...], replicas: int) -> int:
    """The axis along which a leaf has every replica's rows where one replica's were traced (its
    environment axis: the first of a batch, the second of a [time, env] array); -1 where none."""
    k = _one_axis_apart(got, traced)
    return k if k >= 0 and got[k] == traced[k] * replicas else -1


def _shared_axis(got: tuple[int, ...], traced: tuple[int, ...], replicas: int) -> int:
    """The axis, behind leading axes of one ([1, env, hidden]), along which a leaf holds this
    process's share of what was traced (0: none, or the first)."""
    if replicas < 2 or len(got) < 2:
        return 0
    k = max(_one_axis_apart(got, traced), 0)
    # (only behind axes of one: a [time, env] array is better put in the rollout, as the other message says)
    return k if k > 0 and got[k] * replicas == traced[k] and all(n == 1 for n in got[:k]) else 0


Where = SourceLoc | None | Callable[[], SourceLoc | None]


def _loc(where: Where) -> SourceLoc | None:
    return where() if callable(where) else where


def check_every() -> int:
    """Learner writes are checked at each of the first ``n`` updates, then at every ``n``-th
    (``FRAGFLOW_CHECK_EVERY``, default 16; 1 checks every update). A check walks the whole state
    and takes a norm of every tensor, about a millisecond for SAC's: every update it would be a
    tenth of SAC's update time."""
    raw = os.environ.get("FRAGFLOW_CHECK_EVERY", "").strip()
    if not raw:
        return 16
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"FRAGFLOW_CHECK_EVERY={raw!r} is not a whole number of updates of at least 1",
                          fix="unset it (16: the first 16 updates, then every 16th) or set e.g. FRAGFLOW_CHECK_EVERY=1")
    return int(raw)


def is_checked(update: int, every: int) -> bool:
    return update <= every or update % every == 0


def _when(update: int, every: int) -> str:
    """Which update a check found a change in: that one, or one of those since the last check."""
    if update <= every or every == 1:
        return f"in update {update}"
    return (f"by update {update} (after the first {every} updates, every {every}th is checked: "
            "FRAGFLOW_CHECK_EVERY=1 checks each)")


def check_state(value: Any, traced: dict[str, TensorSpec], fragment: str, state: str, where: Where,
                leaves: list[tuple[str, Any]] | None = None, update: int = 0, every: int = 1) -> None:
    """A learner's new state must keep the shapes and dtypes traced for it (every policy checks the same)."""
    for path, leaf in leaves if leaves is not None else leaf_paths(value):
        spec = traced.get(path)
        if spec is None:
            continue   # optimizer moments appear after the first step
        if _same_spec(leaf, spec):
            continue
        got = spec_of(leaf)
        if got.shape != spec.shape or got.dtype != spec.dtype:
            when = f" {_when(update, every)}" if update else ""
            raise SpecChangedError(f"learner '{fragment}' returned state '{state}' with {path} as {got.short()} "
                                   f"{got.backend}, traced as {spec.short()} {spec.backend}{when}", where=_loc(where),
                                   fix=cast_back(got, spec))


def cast_back(got: TensorSpec, spec: TensorSpec) -> str:
    """The fix of a state leaf that changed from ``spec`` (traced) to ``got``: the cast to the traced
    dtype in its library (the message said np.float32 whatever the dtype was), or the shape to keep."""
    if got.dtype != spec.dtype:
        cast = cast_expression(spec) or f"a {spec.dtype} value"
        return f"keep the state's dtypes fixed: cast it back to {spec.dtype} ({cast}) before returning it"
    return f"keep the state's shapes fixed: return it as {spec.short()}, as traced (pad, slice or reshape it back)"


def cast_expression(spec: TensorSpec) -> str | None:
    """The cast of an array ``x`` to ``spec``'s dtype in its library (None: a Python number's)."""
    return {"numpy": f"x.astype(np.{spec.dtype})", "torch": f"x.to(torch.{spec.dtype})",
            "jax": f"x.astype(jnp.{spec.dtype})"}.get(spec.backend)


def check_structure(value: Any, shape: Any, fragment: str, state: str, update: int, where: Where) -> None:
    """A learner's new state must hold the leaves of the state it was given (``shape``: the state's
    :func:`~fragflow.compiler.pytree.structure`): a key it adds (``{**state, "extra": x}``) or drops.
    Checked at every update: it compares the containers only, not the arrays."""
    got = structure(value)
    if got == shape:
        return
    given, now = structure_paths(shape), structure_paths(got)
    if given != now:   # (else the same leaves: a tuple for a list, an empty dict for None)
        raise reshaped(fragment, state, given, now, _loc(where), f" in update {update}")


_DTYPE_NAMES: dict[Any, str] = {}


def _same_spec(leaf: Any, spec: TensorSpec) -> bool:
    """The fast path of the spec check: an array's shape and dtype name, the dtype's name cached."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return False
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = spec_of(leaf).dtype
    return name == spec.dtype and tuple(leaf.shape) == spec.shape


def check_write(value: Any, traced: dict[str, TensorSpec] | None, fragment: str, state: str, update: int,
                where: Where, finite: bool, shape: Any = None, every: int | None = None) -> None:
    """The checks of a learner's new state: its structure (``shape``, where given) at every update;
    its specs and finiteness, over one walk of its leaves, at the updates :func:`is_checked` picks
    (``every``: :func:`check_every`, as the caller read it once; ``where`` may be a callable: it is
    called only to report an error)."""
    if shape is not None:
        check_structure(value, shape, fragment, state, update, where)
    if every is None:
        every = check_every()
    if not is_checked(update, every) or (traced is None and not finite):
        return
    leaves = leaf_paths(value)
    if traced is not None:
        check_state(value, traced, fragment, state, where, leaves, update, every)
    if finite:
        check_finite(value, fragment, update, where, leaves, every)


def _all_finite_torch(tensors: list[Any]) -> bool:
    import torch

    by_kind: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        norms = torch._foreach_norm(group)
        if not bool(torch.stack(norms).isfinite().all()):
            return False
    return True


def check_finite(out: Any, fragment: str, update: int, where: Where,
                 leaves: list[tuple[str, Any]] | None = None, every: int = 1) -> None:
    """Stop on NaN or infinity in a learner's output (state or metrics).

    Torch tensors are checked together: one fused norm over all of them (a norm is non-finite
    exactly when some element is, or the tensor's values are beyond any sane parameter); only
    when that fails are they looked at one by one, to name the leaf."""
    if leaves is None:
        leaves = leaf_paths(out)
    # a module's buffers kept out of state_dict (persistent=False) may hold infinities by design (a
    # causal mask's -inf): only NaN there is refused, and they stay out of the fused norm
    unsaved = unsaved_paths(out)
    floats = [leaf.detach() for path, leaf in leaves
              if backend_of(leaf) == "torch" and leaf.is_floating_point() and path not in unsaved]
    torch_ok = not floats or _all_finite_torch(floats)
    for path, leaf in leaves:
        if path in unsaved:
            bad = backend_of(leaf) == "torch" and leaf.is_floating_point() and bool(leaf.detach().isnan().any())
        elif isinstance(leaf, float):
            bad = not math.isfinite(leaf)
        elif isinstance(leaf, (bool, int)):
            continue
        else:
            backend = backend_of(leaf)
            if backend == "torch":
                if torch_ok or not leaf.is_floating_point():
                    continue
                bad = not bool(leaf.detach().isfinite().all())
            else:
                arr = to_numpy(leaf)
                if arr.dtype.kind not in "fc":
                    continue
                bad = not bool(np.isfinite(arr).all())
        if bad:
            when = _when(update, every)
            raise NonFiniteError(f"learner '{fragment}' produced a non-finite value (NaN or inf) at {path or 'its output'} "
                                 f"{when}", where=_loc(where),
                                 fix="lower the learning rate, clip gradients or check the loss for log(0) / division "
                                     "by zero; FRAGFLOW_ALLOW_NONFINITE=1 lets the run go on")


def state_checks(graph: Any) -> dict[str, Any]:
    """What every executor checks after a learner call: the traced state specs and the clock."""
    from fragflow.compiler.ir import EdgeKind, NodeKind

    state = {(e.src, e.dst): {leaf.src_path: leaf.spec for leaf in e.leaves}
             for e in graph.edges_of(EdgeKind.STATE_WRITE)}
    learners = graph.fragments("learner")
    clock = graph.clock() or (learners[0].name if learners else None)
    made_at = {n.name: n.defined_at for n in graph.nodes if n.kind is NodeKind.STATE}   # (where ff.versioned made each)
    return {"state": state, "clock": clock, "made_at": made_at}
