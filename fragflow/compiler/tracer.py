"""The tracer: run the training loop concretely and record its fragmented dataflow graph.

The loop runs on real data inside a tracing context until the steady-state pattern is seen (two
learner updates, in whole trips of the loop: see :mod:`fragflow.compiler.window`; a loop without a
learner runs to its end). Every fragment call is executed and
recorded (:mod:`fragflow.compiler.recording`): which fragment, where the user called it, the specs
of what it took and returned. Data edges are found by identity: an array a fragment returned that later reaches another
fragment's argument is an edge between the two; arrays fragflow did not produce come from the
loop itself (the ``loop`` node). Mistakes that would break a distributed run fail here, with the
user's ``file:line``. Where the run is one process, it takes the loop over where tracing stops
(see ``trace_program``'s ``handover``): the trace is the run's beginning.

>>> from fragflow.algorithms import ppo                                 # doctest: +SKIP
>>> graph = trace(ppo.train, ppo.Args(num_envs=2, num_steps=8))          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow import context
from fragflow.api.events import EventSources
from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler import modes, probes
from fragflow.compiler.axes import loop_rows
from fragflow.compiler.binding import bind, one_jax_key, star_state
from fragflow.compiler.inplace import Changed, array_leaves, containers, entries, memory_bounds
from fragflow.compiler.ir import EdgeKind, Graph, LoopRead
from fragflow.compiler.logchecks import check_scalars, log_sources
from fragflow.compiler.optimizers import hyper_change, hyper_of, optimizers_of, schedulers_of
from fragflow.compiler.pytree import (
    TensorSpec,
    is_static,
)
from fragflow.compiler.reach import (
    _is_module,
    bound_globals,
    captured_objects,
    captured_state,
    handles_as_values,
    mutable_data,
    reached_data,
)
from fragflow.compiler.recording import LOOP, EdgeRec, NodeRec, Repeat, strong
from fragflow.compiler.repeats import _NOT_REPEATED, _leaf_list, _state_param
from fragflow.compiler.statebook import StateBook, _StateRec
from fragflow.compiler.statecheck import fingerprint, grad_flags
from fragflow.compiler.watchers import StateUse, ThreadsSet, torch_mode
from fragflow.compiler.window import TraceWindow
from fragflow.context import InstanceNames
from fragflow.errors import (
    VersionedStateError,
)
from fragflow.runtime import heap
from fragflow.source import SourceLoc, user_callsite

# After the first two updates the tracer goes on (up to this many updates) until every fragment the
# training function's module defines has been called once: a target-network sync every 500 steps
# must be seen to be placed.
MAX_TRACE_UPDATES = 200
_UNBOUND = object()   # a global not bound (yet)
QUICK_KEPT = 64   # a quick warm-up (see Tracer.quick) knows the outputs of this many of its last calls when it ends
CHANGED_KEPT = 16   # array arguments changed in place the trace holds (the newest), to see whether they are read again


class _StopTracing(BaseException):
    """Unwinds the user's loop once the steady state has been seen (BaseException: not caught by
    a user's ``except Exception``)."""


class Tracer(StateBook):
    """The tracing interpreter (see :mod:`fragflow.context`)."""

    def __init__(self, max_updates: int = 2, expected: tuple[Fragment, ...] = (),
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        self.max_updates = max_updates
        self.on_progress = on_progress   # (env steps, updates) so far, every quarter second
        self._reported = time.monotonic()
        self._expected = {id(f) for f in expected}
        self._primary: int | None = None     # the first learner fragment called: its calls are updates
        # the training function's loops ((first line, last line), its file), and, where the first update
        # is inside a loop nested in another, those two: tracing goes on until a call in the outer
        # loop's body outside the inner one has run after it (a buffer collected and learned from
        # once per outer trip, after an inner loop that learns every step)
        self.loop_ranges: list[tuple[int, int]] = []
        self.loop_file = ""
        self._nested: tuple[tuple[int, int], tuple[int, int]] | None = None
        self.window = TraceWindow(max_updates, MAX_TRACE_UPDATES)
        self.remade_state: SourceLoc | None = None   # a line that made versioned state more than once
        # the first update made with no env step since the previous one (several learner steps on one
        # rollout or trip); the env steps at the last update
        self.learner_again: tuple[str, SourceLoc | None] | None = None
        self._steps_at_update: dict[str, int] = {}
        self.events = EventSources()
        # optimizers in learners' state: their hyper-parameters as the last learner call left them, and
        # (state, learner, its call, what changed) where the loop changed them between two calls
        self._hyper: dict[int, tuple[Any, Any]] = {}
        self.changed_optimizer: tuple[str, str, SourceLoc | None, str] | None = None
        self.nested_learner: tuple[str, str, SourceLoc | None] | None = None
        # (state, version passed, newest version, fragment, its call) where the loop passed an old version
        self.stale_state: tuple[str, int, int, str, SourceLoc | None] | None = None
        self.state_read: tuple[str, SourceLoc | None] | None = None   # the loop's first read of versioned state
        self.state_printed: tuple[str, SourceLoc | None] | None = None   # ... and its first print of a written one
        # the loop's own use of the state's tensors through a reference of its own (see StateUse), and
        # where the trace is not the run's beginning, each state's checksum as the last learner call (or
        # ff.versioned) left it: changed before the next learner call, by the loop (an array the state
        # holds, changed through a variable of the loop's; what StateUse does not see)
        self.state_use = StateUse()
        self._state_prints: dict[str, tuple[int, list[tuple[str, list[int]]], list[bool]]] = {}
        self._readers: dict[str, set[str]] = {}
        self._learned_at: tuple[str, SourceLoc | None] | None = None   # the last learner call: which, where
        self.star_state: tuple[str, str, SourceLoc | None] | None = None   # state given through *args: what, who, where
        self._changed_data: dict[int, str] = {}   # module data a fragment changed in place: id -> its label
        # globals a fragment rebound while it ran (``global SHIFT; SHIFT = ...``): (id(globals), name) -> (who, label, globals)
        self._rebound: dict[tuple[int, str], tuple[str, str, dict[str, Any]]] = {}
        self.modes = modes.ModeBook()   # the training modes fragments set and act in
        self.threads_set: ThreadsSet | None = None   # torch.set_num_threads while tracing (did the program call it?)
        self.blas_set: list[int] | None = None   # numpy's BLAS thread counts as the trace set them
        self._env_sizes: set[int] = set()   # how many environments a training env's step steps (each env's)
        # array arguments a fragment changed in place, and containers (a batch dict) it replaced entries
        # of (checked in a learner's every recorded call and another fragment's first two, where the
        # trace is not the run's beginning), and the first later call given their memory again,
        # unchanged since: (changer, argument, its call, reader, its call, the fragment that made the
        # array, or None for the loop)
        self._changed_args: list[Changed] = []
        self.changed_arg: tuple[str, str, SourceLoc | None, str, SourceLoc | None, str | None] | None = None
        self._last_on_instance: dict[int, str] = {}
        self.instance_name = InstanceNames()
        self._names = InstanceNames()
        self._states: dict[str, _StateRec] = {}
        self._state_objects: dict[int, tuple[str, Any]] = {}   # id -> (state, object): what versioned state holds
        self.fragments: dict[str, Fragment] = {}
        self._resources: list[Any] = []
        self._instances: dict[int, str] = {}
        self.env_steps = 0
        self.sized_by_ids = False   # the program asked ff.envs.ids(...) for its slice of environments
        self.env_counts: set[int] = set()   # ... of how many
        self.env_sizes: set[int] = set()    # the sizes of the training envs made so far (see env_rows)
        self.loop_reads: list[LoopRead] = []   # learner outputs the loop itself reads (see probes)
        # trace as run (one process): what the run's monitor would have heard, with when ("steps", t, n,
        # episodes, evaluation), ("learn", t, fragment), ("log", t, scalars), ("clock", t: the loop's first
        # env call about to run); and, at the point tracing
        # would stop, the interpreter that goes on running the loop where the trace leaves it (None:
        # the trace unwinds, the run starts again), or the error placing the graph raised (raised
        # after unwinding, outside the user's code)
        self.journal: list[tuple[Any, ...]] | None = None
        self._clock_due = True   # the loop's first env call is to come (its time goes into the journal)
        self.log_columns: dict[str, None] = {}   # names ff.log was given, in the order first seen
        self._logged_by: dict[str, tuple[str, SourceLoc | None]] = {}   # name -> (the learner whose output, or ""; where)
        self._tags: dict[str, tuple[str, SourceLoc | None]] = {}   # TensorBoard tag -> the logged name, where
        self.log_clash: tuple[str, str, SourceLoc | None, SourceLoc | None] | None = None   # see Graph.log_clash
        self.shared_key: tuple[str, str, SourceLoc | None] | None = None   # see Graph.shared_key
        self.handover: Callable[[Tracer], Any] | None = None
        self.module_data: Any = None   # the user's module data before the trace (moduledata.ModuleData)
        self.taken_by: Any = None
        self.failed: BaseException | None = None
        self.on_taken: Callable[[], None] | None = None
        self._latest: dict[str, Versioned] = {}   # each state's newest handle
        self.traced: tuple[Graph, dict[str, Fragment]] | None = None
        self.value: Any = None
        # Quick warm-up: before the first update, once the loop's trips (from one training env step to
        # the next) have repeated, each a call of fragments already recorded as repeating, the trips
        # that follow run without recording their arguments or outputs, counted as their last recorded
        # one was; any other call (the first learner's, a log, a fragment called now and then) ends
        # that, and the outputs of the calls run so, still alive in the loop, are known as those
        # fragments' before it is recorded. Only where the trace is a single_process run's beginning:
        # an edge crossed only in those trips (a final_obs at an episode's end) is not recorded, which
        # a placement over several processes must know of, and graph.txt shows without it.
        # FRAGFLOW_TRACE_EVERY_CALL=1 records every call.
        self.quick = False
        # where the trace is the run's beginning: whether the episodes just finished reach the run's
        # target (with --stop-on-target), so that the run stops at that step, as eagerly
        self.reached: Callable[[list[tuple[float, int]]], bool] | None = None
        # the trace is the run's beginning whatever the graph (single_process): the loop reads its
        # learners' outputs as eagerly, no probe notes where
        self.begins_run = False
        self._trip: list[Fragment] = []
        self._trips: list[tuple[Fragment, ...]] = []
        self._cycle: tuple[Fragment, ...] | None = None
        self._pos = 0
        self._unrecorded: deque[tuple[NodeRec, Fragment, dict[str, Any], Any]] = deque(maxlen=QUICK_KEPT)

    # -- interpreter protocol -------------------------------------------------------------
    def env_ids(self, num_envs: int) -> np.ndarray:
        self.env_sizes.add(num_envs)
        return np.arange(num_envs)

    def env_rows(self, ids: Any) -> bool:
        """Whether random keys made from ``ids`` are one per environment of the run (a policy that
        splits the environments splits them): as many as a training env made so far has, or any
        where none is made yet. A learner's own noise key, ``ff.random.keys(seed, np.arange(1))``
        beside two environments, is not."""
        return not self.env_sizes or int(np.size(ids)) in self.env_sizes | self.env_counts

    def asked_ids(self, num_envs: int) -> None:
        self.sized_by_ids = True
        if num_envs not in self.env_counts:   # outputs of that size are env rows from now on: record calls again
            for rec in self._nodes.values():
                rec.repeat = None
        self.env_counts.add(num_envs)

    def replica(self) -> tuple[int, int]:
        return 0, 1

    def hint_axis(self, leaf: Any, axis: tuple[str, int]) -> None:
        """A value made in the loop whose batch axis is known (per-environment random keys): known
        while it lives (a warm-up's keys, one per step, are not kept)."""
        if getattr(leaf, "ndim", 0) >= 1:
            try:
                ref: Callable[[], Any] = weakref.ref(leaf)
            except TypeError:
                ref = strong(leaf)
            self._axis_hint[id(leaf)] = (axis, ref)

    def nested(self, frag: Fragment, outer: Fragment) -> None:
        """A learner called inside another fragment (it runs as part of that one's work)."""
        if self.nested_learner is None:
            self.nested_learner = (frag.name, outer.name, user_callsite())

    def adopt(self, resource: Any) -> None:
        self._resources.append(resource)

    def call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cycle = self._cycle
        if cycle is not None and cycle[self._pos] is frag and self._nested is None and not self._changed_args \
                and self.quick and self.window.updates == 0:
            return self._express(frag, args, kwargs)   # a quick warm-up's call (see Repeats)
        if self._clock_due and frag.role == "env" and not frag.evaluation:
            self._clock_due = False
            if self.journal is not None:   # (the loop's start, the run's rate counts from: Monitor.loop_begins)
                self.journal.append(("clock", time.perf_counter()))
        use = self.state_use
        on, use.on = use.on, False   # (what a fragment does with the state's tensors is its own)
        sink = probes.swap_sink(None)   # what a fragment does with a probe is not the loop's read
        try:
            out = self._call(frag, args, kwargs)
        finally:
            probes.swap_sink(sink)
            use.on = on
        if frag.role == "buffer" and frag.instance is not None and out is not None and not self.begins_run:
            rec = self._nodes.get(id(frag))
            if rec is not None:
                return self._buffer_out(rec, out)
        return out

    def _buffer_out(self, rec: NodeRec, out: Any) -> Any:
        if not any(axis == "env" for _, axis, _ in rec.out_axes or ()):
            # a replay buffer's sample, which a policy may move beside the learner (learner_replay):
            # the loop's own reads of it are refused there at placement, as a learner output's are
            return self._probed(rec.name, out)
        return out

    def _call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self._node(frag)   # (a quick warm-up's repeating call was taken by call: Repeats._express)
        where = user_callsite() if rec.repeat is None else None
        if rec.called_at is None:
            rec.called_at = where
        self._expected.discard(id(frag))
        scalars = check_scalars(args[0] if args else kwargs, where, self._tags) if frag.role == "logger" else {}
        if self._nested is not None:
            here = where or user_callsite()
            (o0, o1), (i0, i1) = self._nested
            if here is not None and here.file == self.loop_file and o0 <= here.line <= o1 and not i0 <= here.line <= i1:
                self._nested = None
        self.window.unseen = bool(self._expected) or self._nested is not None
        if self.window.call(rec.name, frag.role, frag.evaluation):
            interp = self._take_over()
            if interp is None:
                raise _StopTracing
            return interp.call(frag, args, kwargs)
        window = self.window.window
        rec.calls[window] += 1
        mode = torch_mode()
        if mode is not None or rec.torch_mode[0] is not None:   # (torch's mode around the call, where not the default)
            if sum(rec.calls) == 1:
                rec.torch_mode = (mode, where or user_callsite())
            elif mode != rec.torch_mode[0]:
                rec.torch_mode = ("", rec.torch_mode[1] or where or user_callsite())
        if frag.role == "logger":
            # metrics.csv's columns in the order the loop logs them, whichever process's values reach
            # the driver first in a run over several
            self.log_columns.update(dict.fromkeys(scalars))
            clash = log_sources(args[0] if args else kwargs, where, self._origin, self._logged_by)
            if self.log_clash is None:
                self.log_clash = clash
            if scalars and self.journal is not None:
                self.journal.append(("log", time.perf_counter(), scalars))
        try:
            bound = bind(frag, args, kwargs)
        except TypeError:
            return frag.fn(*args, **kwargs)   # let Python report the bad call the usual way
        if self._changed_args and self.changed_arg is None:
            self._read_changed(rec, bound, where)
        if frag.role == "learner" and not self.begins_run:
            self._loop_changed()
            self._state_changed((rec.name, where or user_callsite()))
        if self.quick and self.window.updates == 0:
            if self._cycle is not None:
                if self._cycle[self._pos] is frag and rec.repeat is not None:
                    self._pos = (self._pos + 1) % len(self._cycle)
                    return self._unrecorded_call(rec, frag, bound, window)
                self._record_again()
            self._follow(frag)
            if self._cycle is not None:
                self._pos = 1 % len(self._cycle)
                return self._unrecorded_call(rec, frag, bound, window)
        elif self._cycle is not None:
            self._record_again()
        if rec.repeat is not None:
            repeated = self._repeated(rec, frag, bound, window)
            rec.repeated = repeated is not _NOT_REPEATED
            if rec.repeated:
                return repeated
            where = user_callsite()
        written: Versioned | None = None
        params: list[tuple[Any, ...]] = []
        crossed: list[EdgeRec] = []
        self._input_ids = set()
        self._input_backends = set()
        self._inputs, self._input_srcs = [], []
        self._loop_made = []
        static = []
        state_args: list[tuple[str, str]] = []
        data_args: list[tuple[str, Any]] = []
        for pname, value in list(bound.arguments.items()):
            if isinstance(value, (Versioned, VersionedView)):
                params.append(_state_param(pname, value))
                bound.arguments[pname] = self._read_state(rec, frag, pname, value, window, where)
                state_args.append((pname, (value if isinstance(value, Versioned) else value.handle).name))
                if pname == frag.writes:
                    if not isinstance(value, Versioned):
                        raise VersionedStateError(
                            f"learner '{rec.name}' writes '{pname}' but was given the view {value!r}",
                            where=where, fix=f"pass the whole versioned state as '{pname}'")
                    written = value
                continue
            if is_static(value):
                params.append(("static", pname))
                static.append(pname)
                continue
            resolved = star_state(frag, pname, value)
            if resolved is not None:   # state through *args or **kwargs: as eagerly, noted for placement
                bound.arguments[pname] = resolved
                params.append(("star", pname))
                if self.star_state is None:
                    star = "*" if isinstance(value, tuple) else "**"
                    shown = next(v for v in (value if isinstance(value, tuple) else value.values())
                                 if isinstance(v, (Versioned, VersionedView)))
                    self.star_state = (f"versioned state {shown!r} reached fragment '{rec.name}' through its "
                                       f"{star}{pname}", rec.name, where or user_callsite())
                continue
            params.append(("data", pname, self._record_inputs(rec, pname, value, window, where, frag.in_axes, crossed)))
            data_args.append((pname, value))
        if self._loop_made and frag.in_axes is None:
            loop_rows(self._inputs, self._loop_made, self._per_env())
        if rec.inputs is not None and not rec.other_inputs:
            self._other_inputs(rec, where)
        rec.static = tuple(static)
        if frag.writes is not None and written is None:
            raise VersionedStateError(
                f"learner '{rec.name}' writes '{frag.writes}', but that argument is not versioned state",
                where=where, fix=f"create it with state = ff.versioned(initial_value) and pass it as '{frag.writes}'")
        self._effects(rec, frag, window)
        optimizers = optimizers_of(bound.arguments[frag.writes]) if written is not None and frag.writes else []
        schedulers = schedulers_of(optimizers) if optimizers else []
        if optimizers and self.changed_optimizer is None:
            assert written is not None
            for opt in optimizers:
                after = self._hyper.get(id(opt))
                if after is not None and after[0] is opt and after[1] != hyper_of(opt):
                    self.changed_optimizer = (written.name, rec.name, where, hyper_change(after[1], hyper_of(opt)))
            for sched in schedulers:   # a schedule may change the rate only every so many steps: its steps
                after = self._hyper.get(id(sched))
                if after is not None and after[0] is sched and after[1] != sched.last_epoch:
                    self.changed_optimizer = (written.name, rec.name, where,
                                              f"its scheduler {type(sched).__name__} stepped")

        read: list[tuple[str, str, Any]] = []
        if frag.role != "learner" and not rec.mutates and sum(rec.calls) <= 2:
            read = [(pname, handle, bound.arguments[pname]) for pname, handle in state_args
                    if pname != frag.writes]
        fingerprints = [fingerprint(value) for _, _, value in read]
        grads = [grad_flags(value) for _, _, value in read]
        # a learner changing in place state it reads but does not write (target["w"] += 1): eagerly an
        # actor acting with that state sees the change; apart, no version carries it (every traced call)
        others: list[tuple[str, str, Any]] = []
        if frag.role == "learner" and not self.begins_run and rec.changes_read is None:
            others = [(pname, handle, bound.arguments[pname]) for pname, handle in state_args
                      if pname != frag.writes and (written is None or handle != written.name)]
        others_before = [fingerprint(value) for _, _, value in others]
        # the globals its code rebinds, as they were (a change seen after the call)
        binds = bound_globals(frag.fn) if not self.begins_run and (sum(rec.calls) <= 2 or frag.role == "learner") else []
        binds_before = [scope.get(name, _UNBOUND) for scope, name in binds]
        first = sum(rec.calls) == 1
        watched = mutable_data(frag.fn) if sum(rec.calls) <= 2 else []
        if first:
            rec.names_data = {id(v): label for label, v in watched}
        watched_before = [fingerprint(v) for _, v in watched]
        elsewhere = self._reached_elsewhere(rec, watched) if frag.role == "learner" and not self.begins_run else []
        elsewhere_before = [fingerprint(v) for _, v in elsewhere]
        reached_before = reached_data(frag.fn) if not self.begins_run and (first or frag.role == "learner") else None
        # (in one process the loop and every fragment share the arrays, as eagerly: only checked elsewhere)
        checked = (sum(rec.calls) <= 2 or frag.role == "learner") and not self.begins_run
        given = array_leaves(data_args) if checked else []
        given_before = [fingerprint(leaf) for _, leaf in given]
        boxes = containers(data_args) if checked else []
        boxes_before = [(entries(box), self._maker(box)) for _, box in boxes]
        if first and frag.role == "actor" and self.shared_key is None:
            # one jax.random key for all the environments: replicas that split them would draw alike
            key = next((p for p, v in bound.arguments.items() if one_jax_key(v)), None)
            if key is not None:
                self.shared_key = (rec.name, key, where or user_callsite())
        if first:
            shared = captured_objects(frag.fn, self._state_objects)
            if shared is not None:
                rec.captures = f"'{shared[2]}' through the {shared[0]} '{shared[1]}'"
        if first:
            captured = captured_state(frag.fn)
            if captured is not None:   # runs as eagerly in one process; other placements refuse it
                rec.reads_captured = f"'{captured[2]}' through the {captured[0]} '{captured[1]}'"
        with self.modes.call(rec.name, frag.role, state_args, bound.arguments, read):
            if rec.reads_captured:
                with handles_as_values(frag.fn):
                    out = self._traced(rec, frag, bound, where)
            else:
                out = self._traced(rec, frag, bound, where)

        for (pname, state, value), before, grad in zip(read, fingerprints, grads):
            if fingerprint(value) != before:
                rec.mutates = f"'{state}' (argument '{pname}')"
            elif grad_flags(value) != grad:   # (requires_grad_(False) to freeze a layer: the learner's copy learns on)
                rec.mutates = f"'{state}' (argument '{pname}': the requires_grad of its tensors)"
        for (pname, state, value), before in zip(others, others_before):
            if fingerprint(value) != before:
                rec.changes_read = (state, pname)
                self.state_use.written.add(state)   # (the loop reading it after: as a written state's read)
                break
        for (scope, name), before in zip(binds, binds_before):
            if scope.get(name, _UNBOUND) is not before:
                label = f"global '{name}'"
                rec.rebinds[(id(scope), name)] = label
                self._rebound.setdefault((id(scope), name), (rec.name, label, scope))
        for (label, value), before in zip(watched, watched_before):
            if fingerprint(value) != before:   # changed data the module holds: who else reads it?
                rec.changes_data[id(value)] = label
                self._changed_data[id(value)] = label
        for (label, value), before in zip(elsewhere, elsewhere_before):
            if fingerprint(value) != before:   # ... and what it changed without naming it
                rec.changes_data[id(value)] = rec.changes_through[id(value)] = label
                self._changed_data[id(value)] = label
        changed = []   # (held, so that its memory is not another array's later: a view's base stays too)
        for (label, leaf), before in zip(given, given_before):
            changed_print = fingerprint(leaf)
            bounds = memory_bounds(leaf)
            if changed_print != before and bounds is not None:   # an argument changed in place: is it read again?
                changed.append(Changed(leaf, bounds, changed_print, rec.name, label, where or user_callsite(),
                                       self._maker(leaf)))
        for (label, box), (before, maker) in zip(boxes, boxes_before):
            after = entries(box)
            if after != before:   # a container argument whose entries it replaced: is it read again?
                changed.append(Changed(box, None, after, rec.name, label, where or user_callsite(), maker))
        if changed:
            self._changed_args = [*self._changed_args, *changed][-CHANGED_KEPT:]
        if reached_before is not None:   # what it changed itself while it ran is its own, not the loop's
            reached = reached_data(frag.fn)
            own = {label for (label, _, _, value, snap), (_, _, _, old, old_snap) in zip(reached, reached_before)
                   if value is not old or snap != old_snap} if len(reached) == len(reached_before) else set()
            rec.own_data |= own
            rec.reached = [r for r in reached if r[0] not in rec.own_data]
        for opt in optimizers:   # as the learner left them: a change before its next call is the loop's
            self._hyper[id(opt)] = (opt, hyper_of(opt))
        for sched in schedulers:
            self._hyper[id(sched)] = (sched, sched.last_epoch)
        self._count_events(frag, out)
        if rec.inputs is None:
            rec.inputs, rec.input_srcs = self._inputs, self._input_srcs
        written_specs: list[TensorSpec] = []
        if written is not None:
            out = self._write_state(rec, written, out, where, window)
            written_specs = [leaf.spec for leaf in self._edges[(rec.name, written.name, EdgeKind.STATE_WRITE, "[0]", "")].leaves.values()]
        axes = self._record_outputs(rec, frag, out, where, written_specs)
        if frag.role not in ("learner", "logger") and sum(rec.calls) >= 3 and not rec.reads_captured:
            # from its third call on (the first two are checked for in-place writes to state)
            rec.repeat = Repeat(tuple(params), tuple(crossed), axes,
                                 {path: axes(path) if axes is not None else None for path, _ in rec.out_specs or ()})
        if frag.role == "learner":
            plain = out
            if not self.begins_run:   # (the state as this call left it: a change before the next is the loop's)
                if written is not None:
                    self.state_use.written.add(written.name)
                self._learned_at = (rec.name, where or user_callsite())
                self._watch_states()
            if self.journal is not None:
                self.journal.append(("learn", time.perf_counter(), rec.name))
            if not self.begins_run:
                out = self._probed(rec.name, out)
            if self._primary is None:
                self._primary = id(frag)
                around = [r for r in self.loop_ranges if where is not None and where.file == self.loop_file
                          and r[0] <= where.line <= r[1]]
                if len(around) > 1:
                    self._nested = (min(around), max(around))
            # any learner, not only the clock: a second learner called several times a trip (a value
            # function's steps after the policy's) is gathered on arrival the same way
            if self.learner_again is None and self.env_steps and self._steps_at_update.get(rec.name) == self.env_steps:
                self.learner_again = (rec.name, where or user_callsite())
            self._steps_at_update[rec.name] = self.env_steps
            if self.window.learned(rec.name, self._primary == id(frag)):
                if self._take_over() is None:
                    raise _StopTracing
                return plain   # the run goes on from here, with the values themselves
        return out

    def _reached_elsewhere(self, rec: NodeRec, watched: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The modules, arrays and tensors other fragments' code reaches (globals, closures) that a
        learner's call may change without naming them: a global network a global optimizer steps
        (``OPT = SGD(NET.parameters())`` in the learner, ``NET`` in the actor). Versioned state's
        objects are checked by their own rules."""
        mine = {id(v) for _, v in watched}
        out: list[tuple[str, Any]] = []
        for other in self._nodes.values():
            if other is rec:
                continue
            for label, _, _, value, _ in other.reached or ():
                i = id(value)
                if i in mine or i in self._state_objects or i in self._changed_data or not (
                        _is_module(value) or isinstance(value, np.ndarray) or type(value).__name__ == "Tensor"):
                    continue
                mine.add(i)
                out.append((label, value))
        return out

    def _take_over(self) -> Any:
        """Where tracing would stop: hand the loop to the interpreter the handover makes of the
        graph traced so far, which runs it from this call on (None: unwind)."""
        if self.handover is None:
            return None
        try:
            interp = self.handover(self)
        except BaseException as exc:   # raised by trace_program once the user's loop is unwound
            self.failed = exc
            return None
        if interp is not None:
            self.taken_by = interp
            heap.settle()   # (the program has made its state: its objects are out of the collector's walks)
            probes.unwatch()
            context.swap(self, interp)
            if self.on_taken is not None:
                self.on_taken()
        return interp

    def _maker(self, value: Any) -> str | None:
        """The fragment an array (or a container's first array) came from (None: the loop made it)."""
        leaves = array_leaves([("", value)])
        origin = self._origin(leaves[0][1]) if leaves else None
        return None if origin is None or origin.node == LOOP else origin.node

    def _other_inputs(self, rec: NodeRec, where: SourceLoc | None) -> None:
        """Note an argument leaf given in another shape than at the first call (what a channel
        between processes, sized from the first, cannot carry)."""
        first = {leaf.dst_path: leaf.spec for leaf in rec.inputs or ()}
        # The leaves that travel through the channel (Python lists of another length, an episode as a
        # list, change their count; ff.log's calls take what each logs). A learner's output given
        # back stays in its process, and an argument the loop gives at one call and a learner's
        # output at another travels with the call's definitions: neither is counted.
        learners = {r.name for r in self._nodes.values() if r.role == "learner"}
        calls = (list(zip(self._inputs, self._input_srcs)), list(zip(rec.inputs or (), rec.input_srcs or ())))
        kept = {leaf.dst_path for pairs in calls for leaf, src in pairs if src in learners}
        sent_now, sent_first = (sum(leaf.dst_path not in kept for leaf, _ in pairs) for pairs in calls)
        if sent_now != sent_first and rec.role != "logger":
            only = sorted({leaf.dst_path for leaf in self._inputs} ^ set(first))
            rec.other_inputs = (f"{sent_now} array leaves at {where or user_callsite()} as well as "
                                f"{sent_first} at {rec.called_at}" + (f" ({only[0]} in one call only)" if only else ""))
            return
        for leaf in self._inputs:
            spec = first.get(leaf.dst_path)
            if spec is not None and spec.shape != leaf.spec.shape:
                rec.other_inputs = (f"{leaf.dst_path} of shape {leaf.spec.short()} at {where or user_callsite()} as "
                                    f"well as {spec.short()} at {rec.called_at}")
                return

    def _effects(self, rec: NodeRec, frag: Fragment, window: int) -> None:
        """Calls on one object (an env's reset and step) are ordered: an effect edge between them."""
        if frag.instance is not None:
            last = self._last_on_instance.get(id(frag.instance))
            if last is not None and last != rec.name:
                self._edge(last, rec.name, EdgeKind.EFFECT, "", "").crossings[window] += 1
            self._last_on_instance[id(frag.instance)] = rec.name

    def _count_events(self, frag: Fragment, out: Any) -> None:
        events = self.events.of(frag)
        if events is None or (frag.evaluation and self.journal is None):
            return   # (an evaluation env's episodes count only where the trace is the run's beginning)
        n, finished = events(out)
        if n and not frag.evaluation:
            self._env_sizes.add(n)
        if self.journal is not None:
            last = self.journal[-1] if self.journal else None
            if not finished and last is not None and last[0] == "steps" and not last[3] and last[4] == frag.evaluation:
                self.journal[-1] = ("steps", time.perf_counter(), last[2] + n, finished, frag.evaluation)
            else:   # (steps without an episode's end, one after another, are one entry: a warm-up is not kept step by step)
                self.journal.append(("steps", time.perf_counter(), n, finished, frag.evaluation))
            if finished and not frag.evaluation and self.reached is not None and self.reached(finished):
                # the run's target reached while traced (--stop-on-target): the run begins here, and
                # stops at this step as its monitor hears of it
                if self._take_over() is None:
                    raise _StopTracing
        if not frag.evaluation:
            self.env_steps += n
            if self.on_progress is not None and time.monotonic() - self._reported >= 0.25:
                self._reported = time.monotonic()
                self.on_progress(self.env_steps, self.window.updates)

    def _probed(self, name: str, out: Any) -> Any:
        """The learner's outputs as probes (its new state excepted), each known as its original's
        output so that passing one on to a fragment is still an edge from this learner."""
        if isinstance(out, Versioned):
            return out
        first = 1 if isinstance(out, tuple) and out and isinstance(out[0], Versioned) else 0
        items = list(out) if isinstance(out, tuple) else [out]
        for i in range(first, len(items)):
            before = [leaf for _, leaf in _leaf_list(items[i])]
            items[i] = probes.probed(items[i], name, f"[{i}]" if isinstance(out, tuple) else "")
            for (_, new), old in zip(_leaf_list(items[i]), before):
                origin = self._origin(old)
                if origin is not None and new is not old:   # the strong ref keeps the probe (and its id) alive
                    self._origins[id(new)] = dataclasses.replace(origin, ref=strong(new))
        return tuple(items) if isinstance(out, tuple) else items[0]

    # -- recording ------------------------------------------------------------------------
    def _node(self, frag: Fragment) -> NodeRec:
        rec = self._nodes.get(id(frag))
        if rec is None:
            instance = None
            if frag.instance is not None:   # an object's fragments are named by the object
                instance = getattr(frag.instance, "name", None)
                if not isinstance(instance, str):
                    instance = self._instances.get(id(frag.instance))
                    if instance is None:
                        instance = self._instances[id(frag.instance)] = self._names(type(frag.instance).__name__.lower())
            rec = NodeRec(self._names(frag.name), frag.role, frag.defined_at, instance)
            self._nodes[id(frag)] = rec
            self.fragments[rec.name] = frag
        return rec

    # -- result ---------------------------------------------------------------------------
    def graph(self, name: str, defined_at: SourceLoc | None) -> Graph:
        from fragflow.compiler.graphout import graph_of

        return graph_of(self, name, defined_at)

    def close(self) -> None:
        for resource in self._resources:
            resource.close()
