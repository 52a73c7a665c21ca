"""What the tracer records of each fragment call: its arguments' leaves with their sources (a
fragment's output or the loop), specs and batch axes, on the graph's data edges; its outputs'
specs and axes; and each output leaf as that call's, so that a later call taking it is an edge.

Sources are found by identity (``id`` of a leaf, while it is alive) and, for an array seen through
another library, by memory address (``torch.as_tensor(obs)`` is ``obs``). :class:`Recording` holds
this state; :class:`~fragflow.compiler.tracer.Tracer`, the interpreter, calls it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fragflow.api.envs import EnvCount
from fragflow.api.events import default_axes
from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler.axes import address, env_rows, inherited_axes, sized_by_ids, view_axis
from fragflow.compiler.ir import EdgeKind, LeafSpec
from fragflow.compiler.pytree import (
    _AS_NUMPY,
    NotAnArray,
    TensorSpec,
    _torch_kind,
    leaf_paths,
    none_paths,
    skeleton_of,
    spec_of,
    typed_key_fix,
    typed_key_note,
)
from fragflow.compiler.window import TraceWindow
from fragflow.errors import NotArrayPytreeError, ShapeChangedError, VersionedStateError
from fragflow.source import SourceLoc, user_callsite

LOOP = "loop"


@dataclass
class NodeRec:
    name: str
    role: str
    defined_at: SourceLoc | None
    instance: str | None
    called_at: SourceLoc | None = None
    calls: list[int] = field(default_factory=lambda: [0, 0])   # calls per window (set-up, steady)
    out_specs: list[tuple[str, TensorSpec]] | None = None
    out_skeleton: Any = None   # the first call's output without its leaves (what has none: None, {})
    out_kinds: Any = None      # ... of what the loop receives beside a written state (see kind_change)
    out_nones: list[str] = field(default_factory=list)   # the first call's outputs that were None
    names_data: dict[int, str] = field(default_factory=dict)     # module data its code reaches (id -> label)
    changes_data: dict[int, str] = field(default_factory=dict)   # ... and of it, what it changed in place
    changes_through: dict[int, str] = field(default_factory=dict)   # what it changed without naming it
    # what its code reaches without its arguments, as it was after its first call: (label, holder, name,
    # the value, its fingerprint), and which of it the loop changed since (the first seen)
    reached: list[tuple[str, Any, str, Any, Any]] | None = None
    loop_changes: str = ""
    own_data: set[str] = field(default_factory=set)   # labels of what it changed itself while it ran
    out_axes: tuple[tuple[str, str, int], ...] | None = None   # (path, axis name, axis) of batched outputs
    arity: int = 0
    inputs: list[LeafSpec] | None = None
    input_srcs: list[str] | None = None   # where each of ``inputs`` came from (a fragment, or the loop)
    backends: set[str] = field(default_factory=set)
    static: tuple[str, ...] = ()
    mutates: str = ""   # a fragment that is not a learner changed the versioned state it read, in place
    # a learner changed in place versioned state it reads but does not write: (state, argument)
    changes_read: tuple[str, str] | None = None
    rebinds: dict[tuple[int, str], str] = field(default_factory=dict)   # globals it rebound: (id(globals), name) -> label
    dtype_change: tuple[str, SourceLoc | None] | None = None   # its output's dtypes changed between calls (what, where)
    captures: str = ""  # ... or reaches an object versioned state holds (a module) through a global or closure
    reads_captured: str = ""  # ... or reaches versioned state itself (its handle) through a global or closure
    rows: int | None = None   # the environments its first call acted on (its inputs' env rows)
    other_rows: str = ""      # it was also called on another number of environments (an evaluation env): where
    other_rows_n: int | None = None   # ... and that number
    other_inputs: str = ""    # it was also given an argument of another shape (two rollouts' sizes): which, where
    module_arg: tuple[str, str, SourceLoc | None] | None = None   # an nn.Module given as (part of) an argument
    # torch's mode around its calls from the loop where not the default ("torch.no_grad()", an autocast;
    # "" where it varied between calls, None where never other), with where the first such call was
    torch_mode: tuple[str | None, SourceLoc | None] = (None, None)
    repeat: Repeat | None = None   # its last call, where the next one like it need not be recorded again
    repeated: bool = False         # its last call was like that one (its arguments from the same places)


@dataclass
class Repeat:
    """What a call recorded, for a later call with the same inputs from the same places: it is
    counted on the same edges and its outputs are known by the same axes, without recording it
    again (a warm-up of thousands of steps is traced at a fraction of the cost)."""

    params: tuple[tuple[Any, ...], ...]   # per parameter: ("state", name, handle, keys) | ("static", name) | ("data", name, sources)
    edges: tuple[EdgeRec, ...]           # the data edges the call crossed
    axes: Any                             # its outputs' axes (a callable, or None)
    out_axes: dict[str, tuple[str, int] | None]


@dataclass
class EdgeRec:
    kind: EdgeKind
    leaves: dict[tuple[str, str], LeafSpec] = field(default_factory=dict)
    crossings: list[int] = field(default_factory=lambda: [0, 0])
    where: SourceLoc | None = None
    read_version: int = -1   # a state read edge: the version whose leaves it holds


@dataclass(frozen=True, slots=True)
class Origin:
    node: str
    role: str
    port: str        # "[i]" for element i of a tuple output, "" for a whole non-tuple output
    path: str
    axis: tuple[str, int] | None
    ref: Callable[[], Any]


class Recording:
    """The records of a trace, and how a call's arguments and outputs are recorded into them."""

    fragments: dict[str, Fragment]   # the interpreter's: fragment objects by node name
    window: TraceWindow
    env_counts: set[int]

    def __init__(self) -> None:
        self._nodes: dict[int, NodeRec] = {}
        self._edges: dict[tuple[str, str, EdgeKind, str, str], EdgeRec] = {}
        self._origins: dict[int, Origin] = {}
        self._by_address: dict[tuple[int, tuple[int, ...], int], Origin] = {}   # outputs by memory (see _origin)
        self._containers: dict[tuple[str, str], tuple[Any, str, Any]] = {}   # (node, port) -> its last output container
        self._axis_hint: dict[int, tuple[tuple[str, int], Callable[[], Any]]] = {}
        self._batched: dict[tuple[str, str, str], tuple[Callable[[], Any], tuple[str, int]]] = {}   # (node, port, path)
        # the current call's
        self._input_ids: set[int] = set()
        self._input_backends: set[str] = set()
        self._inputs: list[LeafSpec] = []
        self._input_srcs: list[str] = []   # the fragment (or the loop) each of this call's input leaves came from
        self._loop_made: list[tuple[int, EdgeRec]] = []   # its inputs the loop made (index, edge)

    def _edge(self, src: str, dst: str, kind: EdgeKind, src_port: str, dst_port: str) -> EdgeRec:
        key = (src, dst, kind, src_port, dst_port)
        rec = self._edges.get(key)
        if rec is None:
            rec = self._edges[key] = EdgeRec(kind)
        return rec

    def _record_inputs(self, rec: NodeRec, pname: str, value: Any, window: int, where: SourceLoc | None,
                       in_axes: Callable[[str], tuple[str, int] | None] | None,
                       crossed: list[EdgeRec]) -> tuple[tuple[Any, ...], ...]:
        """Record an argument's leaves on the data edges they came by (``crossed``: the edges this
        call crossed); returns where each leaf came from."""
        sources = self._sources(rec, pname, value, where, in_axes)
        touched: set[tuple[str, str]] = set()
        recorded = []
        for path, leaf, src, port, src_path, axis in sources:
            spec = spec_of(leaf)
            recorded.append((path, spec, src, port, src_path, axis))
            self._input_backends.add(spec.backend)
            edge = self._edge(src, rec.name, EdgeKind.DATA, port, pname)
            if edge.where is None:
                edge.where = where
            leaf_spec = LeafSpec(src_path, f"{pname}{path}", spec, axis[1] if axis else None,
                                 axis[0] if axis else "count" if src == LOOP and isinstance(leaf, EnvCount) else None)
            edge.leaves.setdefault((src_path, f"{pname}{path}"), leaf_spec)
            if src == LOOP and axis is None:
                self._loop_made.append((len(self._inputs), edge))
            self._inputs.append(leaf_spec)
            self._input_srcs.append(src)
            if (src, port) not in touched:
                touched.add((src, port))
                edge.crossings[window] += 1
                crossed.append(edge)
        if rec.module_arg is None:
            inside = _module_in(value)
            if inside is not None:
                module = type(inside[1]).__module__.removeprefix("fragflow_user_")   # (a user's file: its own name)
                rec.module_arg = (f"{pname}{inside[0]}", f"{module}.{type(inside[1]).__qualname__}",
                                  where or user_callsite())
        return tuple(recorded)

    def _sources(self, rec: NodeRec, pname: str, value: Any, where: SourceLoc | None,
                 in_axes: Callable[[str], tuple[str, int] | None] | None) -> list[tuple[Any, ...]]:
        """(path, leaf, source node, its port, the path there, batch axis) of each leaf of an argument."""
        try:
            leaves = leaf_paths(value)
        except NotAnArray as bad:
            if isinstance(bad.value, (Versioned, VersionedView)):
                frag = self.fragments[rec.name]
                param = frag.signature.parameters.get(pname)
                if param is not None and param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                    star = "*" if param.kind == param.VAR_POSITIONAL else "**"
                    raise VersionedStateError(
                        f"versioned state {bad.value!r} reached fragment '{rec.name}' through its {star}{pname}",
                        where=where, fix=f"give '{rec.name}' a named parameter for each state or view it reads "
                                         "(def f(obs, w0, w1)), or pass the whole state and index it inside") from None
                raise VersionedStateError(
                    f"versioned state reached fragment '{rec.name}' nested inside argument '{pname}' at {bad.path}",
                    where=where, fix="pass versioned state (or a view such as state['params']) as an argument of its own") from None
            raise NotArrayPytreeError(
                f"fragment '{rec.name}' was given argument '{pname}' whose leaf {pname}{bad.path} is a "
                f"{type(bad.value).__module__}.{type(bad.value).__qualname__}" + typed_key_note(bad.value),
                where=where, fix=typed_key_fix(bad.value) or
                "fragments take pytrees (dict/list/tuple) of numpy, torch or jax arrays, "
                "Python numbers and configuration (a frozen dataclass, a string); keep other "
                "objects in the loop or inside the fragment") from None
        container = next(((node, port, axes) for (node, port), (obj, _, axes) in self._containers.items()
                          if obj is value), None)
        out = []
        for path, leaf in leaves:
            self._input_ids.add(id(leaf))
            origin = self._origin(leaf)
            if container is not None:
                src, port = container[0], container[1]
                src_path = f"{port}{path}"
                axis = container[2](src_path) if container[2] is not None else None
                if axis is None and origin is not None:
                    axis = origin.axis
            elif origin is None:
                src, port, src_path, axis = LOOP, "", "", None
            else:
                src, port, src_path, axis = origin.node, origin.port, origin.path, origin.axis
            if axis is None:
                hint = self._axis_hint.get(id(leaf))
                axis = hint[0] if hint is not None and hint[1]() is leaf else None
            if axis is None and in_axes is not None and getattr(leaf, "ndim", 0) >= 1:
                axis = in_axes(f"{pname}{path}")   # the loop made it, the fragment declares its rows
            if axis is None and src == LOOP and getattr(leaf, "ndim", 0) >= 1 and \
                    (not isinstance(leaf, np.ndarray) or leaf.base is not None):
                axis = view_axis(leaf, self._per_env())   # a slice of a rollout, a transpose: its rows
            out.append((path, leaf, src, port, src_path, axis))
        return out

    def _per_env(self) -> list[tuple[Any, tuple[str, int]]]:
        """The latest output of each fragment's output leaf with a batch axis, and its axis."""
        return [(array, axis) for ref, axis in self._batched.values() if (array := ref()) is not None]

    def _origin(self, leaf: Any) -> Origin | None:
        origin = self._origins.get(id(leaf))
        if origin is not None and origin.ref() is leaf:
            return origin
        if getattr(leaf, "_ff_element", False):   # an element the loop took out of a learner output (probes)
            rec = next((r for r in self._nodes.values() if r.name == leaf._ff_fragment), None)
            if rec is not None:
                path = leaf._ff_path
                port = path[:path.index("]") + 1] if rec.arity and path.startswith("[") else ""
                return Origin(rec.name, rec.role, port, path, None, strong(leaf))
        # the same memory seen through another library (torch.as_tensor(obs), np.asarray(tensor)): the
        # array it views is still alive, so the address is not a reused one
        at = address(leaf)
        origin = self._by_address.get(at) if at is not None else None
        if origin is not None and origin.ref() is not None:
            return origin
        return None

    def _record_outputs(self, rec: NodeRec, frag: Fragment, out: Any, where: SourceLoc | None,
                        written_specs: list[TensorSpec]) -> Any:
        """Record a call's outputs (their specs, batch axes and backends) and know each leaf as this
        call's output; returns the outputs' axes."""
        rec.arity = len(out) if isinstance(out, tuple) else 0
        leaves = self._output_leaves(rec, frag, out, where)
        specs = [(p, spec_of(x)) for _, p, x in leaves]
        rows = env_rows(self._inputs)
        if rec.out_specs is None:
            rec.out_specs, rec.rows = specs, rows
            rec.out_skeleton = skeleton_of(out)
            rest = skeleton_of(out[1:]) if frag.writes and isinstance(out, tuple) else None   # (beside the state: None)
            rec.out_kinds = (None if rest is None else (None, *rest)) if frag.writes else rec.out_skeleton
            rec.out_nones = _output_nones(frag, out)
        elif specs != rec.out_specs and rec.rows is not None and rows is not None and rows != rec.rows \
                and _rows_differ(rec.out_specs, specs, rec.rows, rows):
            # the same policy acting on an evaluation env of another size: the first call's specs size
            # the channels; a policy that serves this fragment through them refuses it
            if not rec.other_rows:
                rec.other_rows = f"{rows} environments at {where} as well as {rec.rows} at {rec.called_at}"
                rec.other_rows_n = rows
        elif specs != rec.out_specs and rec.role == "learner" and _only_keys_differ(rec.out_specs, specs):
            # a learner's metrics may gain or lose keys (a value it reports only now and then): no
            # channel carries them, its process logs what each call returns
            seen = {p for p, _ in rec.out_specs}
            rec.out_specs = rec.out_specs + [(p, s) for p, s in specs if p not in seen]
        elif specs != rec.out_specs and rec.role == "buffer" and _sizes_differ(rec.out_specs, specs):
            # a buffer sampled in several sizes (the learner's batch, a diagnostic's larger one): what
            # crosses to another process is its consumers' arguments, each sized by its own calls (a
            # fragment given two sizes is refused at placement, naming both calls); the buffer's own
            # outputs size no channel (where its process is not its consumers', the edges carry the
            # consumers' sizes; a buffer output read by the loop itself there is refused at its line)
            pass
        elif specs != rec.out_specs and (none := _none_changed(rec, specs, _output_nones(frag, out), where)):
            raise ShapeChangedError(
                f"fragment '{rec.name}' changed its output between calls:\n"
                f"    before: {_describe(rec.out_specs, rec.out_nones)}\n"
                f"    now:    {_describe(specs, _output_nones(frag, out))}\n    {none}",
                where=where or rec.defined_at,
                fix="return an array of the same shape every call: where there is no value, an array of "
                    "zeros (np.zeros(shape, dtype)) in its place, and if the loop must know, a flag (an array: "
                    "np.array(has_value)) returned beside it")
        elif specs != rec.out_specs and _same_numbers(rec.out_specs, specs):
            # a Python number at one call, numpy's scalar of the same arithmetic at another (a metric
            # `max(1 - np.mean(r), 0)` after `1.0`): the same values, as eagerly; sent as the first
            pass
        elif specs != rec.out_specs and rec.role != "buffer" and _dtypes_differ(rec.out_specs, specs):
            # the same leaves and shapes in other dtypes (int32 random actions in a warm-up, int64 greedy ones
            # after it): one process runs it as eagerly (a buffer casts what it stores); a placement over
            # several processes, whose channels are sized from the first call's specs, refuses it
            if rec.dtype_change is None:
                rec.dtype_change = (f"fragment '{rec.name}' changed the dtypes of its output between calls:\n"
                                    f"    before: {_describe(rec.out_specs)}\n    now:    {_describe(specs)}",
                                    rec.defined_at or where)
        elif specs != rec.out_specs:
            raise ShapeChangedError(
                f"fragment '{rec.name}' changed its output between calls:\n"
                f"    before: {_describe(rec.out_specs)}\n    now:    {_describe(specs)}",
                where=rec.defined_at or where,
                fix="sample one size from a buffer: draw the largest batch and slice the smaller ones from it "
                    "(small = {k: v[:n] for k, v in batch.items()}), or keep a buffer per size"
                if rec.role == "buffer" and rec.arity == 0 and [p for p, _ in specs] == [p for p, _ in rec.out_specs]
                and all(len(a.shape) == len(b.shape) >= 1 and a.shape[1:] == b.shape[1:] and a.dtype == b.dtype
                        for (_, a), (_, b) in zip(specs, rec.out_specs)) else
                "a fragment must return the same pytree with the same shapes and dtypes every call "
                "(pad or bucket variable-size data; channels are sized from the traced specs)")
        rec.backends.update(s.backend for _, s in specs if s.backend != "python")
        if written_specs:   # (a torch learner returning its TD errors as numpy computes with torch)
            rec.backends.update(s.backend for s in written_specs if s.backend != "python")
        if not rec.backends:
            rec.backends.update(b for b in self._input_backends if b != "python")
        axes = frag.axes or default_axes(frag.role, out) or sized_by_ids(frag, leaves, self.env_counts) or \
            inherited_axes(self._inputs, leaves)
        if rec.out_axes is None:
            known = [(path, axes(path)) for _, path, _ in leaves] if axes is not None else []
            rec.out_axes = tuple((path, a[0], a[1]) for path, a in known if a is not None)
        self._know_outputs(rec, frag, out, leaves, axes, axes)
        return axes

    def _output_leaves(self, rec: NodeRec, frag: Fragment, out: Any, where: SourceLoc | None) -> list[tuple[str, str, Any]]:
        """(port, path, leaf) of a call's outputs (a learner's new state is not data)."""
        first = 1 if frag.writes is not None else 0
        if frag.writes is not None and not isinstance(out, tuple):
            return []   # the new state alone: no data output
        try:
            if isinstance(out, tuple):
                return [(f"[{i}]", p, x) for i, item in enumerate(out) if i >= first
                        for p, x in leaf_paths(item, f"[{i}]")]
            return [("", p, x) for p, x in leaf_paths(out)]
        except NotAnArray as bad:
            raise NotArrayPytreeError(
                f"fragment '{rec.name}' returned a value whose leaf {bad.path or '<root>'} is a "
                f"{type(bad.value).__module__}.{type(bad.value).__qualname__}",
                where=rec.defined_at or where,
                fix="fragments return pytrees (dict/list/tuple) of numpy, torch or jax arrays") from None

    def _know_outputs(self, rec: NodeRec, frag: Fragment, out: Any, leaves: list[tuple[str, str, Any]],
                      axes: Any, axis_of: Callable[[str], tuple[str, int] | None] | None) -> None:
        """Know each output leaf as this call's (its origin), and the output's containers."""
        # The output's containers: passed on whole (``learn(state, buffer.collect(...))``), every leaf
        # in one comes from this fragment, what it passed through included: placed elsewhere, the
        # fragment's process resolves the whole container.
        if frag.writes is None or isinstance(out, tuple):
            first = 1 if frag.writes is not None else 0
            items = [(f"[{i}]", x) for i, x in enumerate(out) if i >= first] if isinstance(out, tuple) else [("", out)]
            for port, item in items:
                if isinstance(item, (dict, list)):
                    self._containers[(rec.name, port)] = (item, rec.role, axes)
        registered: set[int] = set()
        for port, path, leaf in leaves:
            axis = axis_of(path) if axis_of is not None else None
            if axis is not None and id(leaf) in self._input_ids:
                # what a fragment passes through keeps its producer, but the batch axis is the
                # declaring fragment's (a rollout's last observation is [num_envs, ...])
                self._axis_hint[id(leaf)] = (axis, strong(leaf))
            # A leaf the fragment passed through keeps its producer; when one array appears twice
            # in an output (final_obs is obs when no episode ended) the first place names it.
            if id(leaf) in self._input_ids or id(leaf) in registered or isinstance(leaf, (bool, int)):
                continue   # Python ints and bools are shared singletons: their identity says nothing
            registered.add(id(leaf))
            try:
                ref: Callable[[], Any] = weakref.ref(leaf)
            except TypeError:
                ref = strong(leaf)   # floats and numpy scalars: small, kept alive while tracing
            self._origins[id(leaf)] = origin = Origin(rec.name, rec.role, port, path, axis, ref)
            if axis is not None:
                self._batched[(rec.name, port, path)] = (ref, axis)
            at = address(leaf)
            if at is not None:
                self._by_address[at] = origin


def _only_keys_differ(before: list[tuple[str, Any]], now: list[tuple[str, Any]]) -> bool:
    """The outputs differ in which leaves they have, not in the shape of any leaf both have."""
    known = dict(before)
    return all(known.get(path, spec) == spec for path, spec in now)


def _module_in(value: Any, path: str = "", depth: int = 0) -> tuple[str, Any] | None:
    """(path, module) of the first torch module in an argument (itself, or in its dicts, lists and tuples)."""
    if _torch_kind(value) == "module":
        return path, value
    if depth < 4 and isinstance(value, dict):
        return next((m for k, v in value.items() if (m := _module_in(v, f"{path}[{k!r}]", depth + 1))), None)
    if depth < 4 and isinstance(value, (list, tuple)):
        return next((m for i, v in enumerate(value) if (m := _module_in(v, f"{path}[{i}]", depth + 1))), None)
    return None


def strong(x: Any) -> Callable[[], Any]:
    return lambda: x


def _rows_differ(before: list[tuple[str, TensorSpec]], now: list[tuple[str, TensorSpec]], rows: int,
                 now_rows: int) -> bool:
    """Whether two calls' outputs differ only in their leading size, the number of environments
    each call acted on."""
    if [p for p, _ in before] != [p for p, _ in now]:
        return False
    return all(a == b or (a.dtype == b.dtype and a.backend == b.backend and a.shape[1:] == b.shape[1:]
                          and a.shape[:1] == (rows,) and b.shape[:1] == (now_rows,))
               for (_, a), (_, b) in zip(before, now))


def _sizes_differ(before: list[tuple[str, TensorSpec]], now: list[tuple[str, TensorSpec]]) -> bool:
    """Whether two calls' outputs differ only in their leading size, the same one in every leaf (a
    buffer's sample of another size)."""
    if [p for p, _ in before] != [p for p, _ in now]:
        return False
    sizes = {b.shape[0] for (_, a), (_, b) in zip(before, now) if a != b and len(b.shape) >= 1}
    return len(sizes) == 1 and all(
        a == b or (a.dtype == b.dtype and a.backend == b.backend and len(a.shape) == len(b.shape) >= 1
                   and a.shape[1:] == b.shape[1:]) for (_, a), (_, b) in zip(before, now))


_PYTHON_AS = {kind.__name__: dtype.name for kind, dtype in _AS_NUMPY.items()}   # "float": "float64", ...


def _same_numbers(before: list[tuple[str, TensorSpec]], now: list[tuple[str, TensorSpec]]) -> bool:
    """The same leaves, where some are a Python number in one and numpy's scalar of its arithmetic
    (float64, int64, bool) in the other."""
    def same(a: TensorSpec, b: TensorSpec) -> bool:
        if a == b:
            return True
        if a.shape != () or b.shape != () or {a.backend, b.backend} != {"python", "numpy"}:
            return False
        py, np_ = (a, b) if a.backend == "python" else (b, a)
        return _PYTHON_AS.get(py.dtype) == np_.dtype

    return len(before) == len(now) and all(p == q and same(a, b) for (p, a), (q, b) in zip(before, now))


def _dtypes_differ(before: list[tuple[str, TensorSpec]], now: list[tuple[str, TensorSpec]]) -> bool:
    """The same leaves of the same shapes and backends, some in another dtype."""
    return len(before) == len(now) and all(
        p == q and a.shape == b.shape and a.backend == b.backend for (p, a), (q, b) in zip(before, now))


def _describe(specs: list[tuple[str, TensorSpec]], nones: list[str] | None = None) -> str:
    nones = nones or []
    described = [(p, s.short()) for p, s in specs] + [(p, "None") for p in nones]
    return ", ".join(f"{p or 'out'}: {s}" for p, s in sorted(described, key=lambda d: _order(d[0], specs, nones))) \
        or "nothing"


def _order(path: str, specs: list[tuple[str, TensorSpec]], nones: list[str]) -> tuple[int, str, int]:
    """Leaves and Nones in the output's order: by the output's top-level item they are in."""
    top = path[1:path.index("]")] if path.startswith("[") and "]" in path else ""
    kids = [p for p, _ in specs] + list(nones)
    return (int(top), "", kids.index(path)) if top.isdigit() else (-1, top, kids.index(path))


def _output_nones(frag: Fragment, out: Any) -> list[str]:
    """The paths of a call's outputs that are None (as :meth:`_output_leaves` names its leaves)."""
    first = 1 if frag.writes is not None else 0
    if frag.writes is not None and not isinstance(out, tuple):
        return []
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return [p for i, item in enumerate(out) if i >= first for p in none_paths(item, f"[{i}]")]
    return none_paths(out)


def _none_changed(rec: NodeRec, specs: list[tuple[str, TensorSpec]], nones: list[str], where: Any) -> str:
    """Where an output was None in one call and arrays in another: which, and in which calls."""
    def under(path: str, leaves: list[tuple[str, TensorSpec]]) -> list[TensorSpec]:
        return [s for p, s in leaves if p == path or p.startswith((f"{path}[", f"{path}."))]

    def what(leaves: list[TensorSpec]) -> str:
        one = leaves[0].short()
        return f"{'an' if one[:1] in 'fi' else 'a'} {one} array" if len(leaves) == 1 else \
            "arrays (" + ", ".join(s.short() for s in leaves) + ")"

    why = "channels between processes are sized by a fragment's outputs, and None has no shape to size one by"
    for path in rec.out_nones:
        now = under(path, specs)
        if now:
            return (f"output {path or 'out'} was None in one call (at {rec.called_at}) and {what(now)} in another "
                    f"(at {where}): {why}")
    for path in nones:
        before = under(path, rec.out_specs or [])
        if before:
            return (f"output {path or 'out'} was {what(before)} in one call (at {rec.called_at}) and None in "
                    f"another (at {where}): {why}")
    return ""
