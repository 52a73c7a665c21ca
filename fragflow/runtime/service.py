"""The service runner: the program of a service group, derived from the graph by lowering.

It takes the calls the loop replicas make into this group, each replica's in its own call order
(every piece carries its producer's call number), and executes a fragment once it holds one piece
from every replica: pieces are merged along the named batch axes of their leaves (a leaf without
one must be the same in every replica). ``ordered`` gathering goes round the replicas in order,
which makes the run independent of scheduling; ``arrival`` takes the oldest piece available. A
piece older than ``max_lag`` versions when taken goes to the channel's overflow discipline; with
served inference, so does one an update leaves waiting (an update takes the oldest pieces) that
the new version leaves more than ``max_lag`` behind.

Arguments are rebuilt from each call's skeleton: leaves from the pieces, versioned state from this
group's own copies, references to earlier outputs from the value table. After a call of the
clock fragment (the learner) the version advances and every broadcast state is published; the
outputs the graph sends to ``ff.log`` are reported with the update.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import types
from dataclasses import replace
from typing import Any

import cloudpickle
import numpy as np

from fragflow import context
from fragflow.api.fragment import Fragment
from fragflow.compiler.axes import address
from fragflow.compiler.pytree import (
    NotAnArray,
    flatten,
    from_numpy,
    leaf_paths,
    ordered_like,
    spec_of,
    structure,
    to_numpy,
    without_optimizers,
)
from fragflow.context import InstanceNames
from fragflow.errors import ConfigError, FragflowError, SpecChangedError
from fragflow.lowering import ServiceProgram
from fragflow.runtime import calls, heap
from fragflow.runtime.gathering import IDLE_WAIT, Gathering, _Piece
from fragflow.runtime.loop import allow_nonfinite
from fragflow.runtime.replicas import _same_value
from fragflow.runtime.scalars import non_scalar, scalars_in

KEPT_OUTPUTS = 64   # outputs of a fragment kept for later calls given one of them (see ServiceProgram.keeps)
KEPT_BYTES = 32 << 20   # and at most this many bytes of them (a sample a learner takes at once, kept for nothing) ...
KEPT_MIN = 8   # ... but for the last this many, whatever their size (two samples taken for one call)
STALL_WARN = 30.0   # seconds a call may wait for the other replicas' share before the run warns


def stall_warn() -> float:
    """Seconds a call may wait for the other replicas' share before the run warns:
    ``FRAGFLOW_STALL_WARN`` if set, else :data:`STALL_WARN`; a run checks it before it writes anything."""
    raw = os.environ.get("FRAGFLOW_STALL_WARN", "").strip()
    if not raw:
        return STALL_WARN
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"FRAGFLOW_STALL_WARN={raw!r} is not a number of seconds above 0",
                          fix=f"unset it ({STALL_WARN:g} s) or set e.g. FRAGFLOW_STALL_WARN=60")
    return seconds


def _size_of(tree: Any) -> int:
    """The bytes of a pytree's leaves, as their specs count them."""
    try:
        return sum(spec_of(leaf).nbytes for _, leaf in leaf_paths(tree))
    except NotAnArray:   # (refused where the output is checked; it counts nothing here)
        return 0


def _with_globals(fn: types.FunctionType, scope: dict[str, Any]) -> types.FunctionType:
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(out, fn, updated=())
    return out



class ServiceRunner(Gathering):
    """Runs one service group (also the interpreter for fragment calls nested in its fragments)."""

    def __init__(self, program: ServiceProgram, endpoints: Any, checks: dict[str, Any],
                 saving: dict[str, Any] | None = None, driver: int = 0) -> None:
        self.program = program
        self.endpoints = endpoints
        self.checks = checks
        self.results = endpoints.results
        self.defs = endpoints.definitions(program.group)
        self.stop = endpoints.stop
        self.admission = endpoints.admission
        self.version = 0
        self.writes: dict[str, int] = {}   # writes of each state executed (the stamps of its broadcast)
        self.current = program.clock
        self.fragments: dict[str, Fragment] = {}
        self.instances: dict[str, Any] = {}
        self._module_globals: dict[str, dict[str, Any]] = {}   # a module's globals, as its first fragment brought them
        self.skeletons: dict[tuple[int, int], Any] = {}
        self.states: dict[str, Any] = {}
        self._shapes: dict[str, Any] = {}   # each state's structure, as it came (a learner's new state keeps it)
        self.outputs: dict[str, Any] = {}
        self._calls_made: dict[tuple[int, str], int] = {}   # (replica, fragment): the number of its last call taken
        self._answered: dict[str, list[str]] = {}   # a served fragment's output paths, as first answered
        self.kept: dict[tuple[str, int], dict[int, Any]] = {}   # (fragment, replica): its last calls' outputs
        self._kept_bytes: dict[tuple[str, int], dict[int, int]] = {}   # and their sizes
        self._replica = 0   # the loop replica of the call being built (whose kept outputs its references name)
        self.pools: dict[str, list[_Piece]] = {}
        self.rings: list[dict[str, Any]] = [{} for _ in range(program.producers)]
        self.ring_specs: dict[str, Any] = {}
        for ring in program.rings:
            self.rings[ring.replica - program.first][ring.fragment] = endpoints.rings[ring.name]
            self.ring_specs[ring.fragment] = ring
        self.replies: dict[str, dict[int, tuple[Any, Any]]] = {}
        for ring in program.replies:
            self.replies.setdefault(ring.fragment, {})[ring.replica] = (ring, endpoints.rings[ring.name])
        self.next_tag = [0] * program.producers
        self._cursor = 0
        self._ticket = 1      # the next admission ticket to consume (balanced admission)
        self._void: set[int] = set()   # replicas restarted and not heard from since: no ticket of theirs is coming
        self.finished = [False] * program.producers
        # served inference under arrival gathering: the version each replica's current rollout was
        # first answered with (None between its clock call and its next request)
        self.started: list[int | None] = [None] * program.producers
        self.delivered: list[tuple[int, int]] = []
        self.instance_name = InstanceNames()
        self.reducer: Any = None
        if program.world > 1:
            from fragflow.runtime.allreduce import GradientAllReduce

            self.reducer = GradientAllReduce(program.rank, program.world, (saving or {}).get("rendezvous"),
                                             getattr(endpoints, "sums", ""), endpoints.stop)
        # checkpoints: where parts go, the newest request served, objects to load on resume
        self.saving = saving or {}
        self.driver = driver
        self.saved_seq = 0
        self.cuts: dict[int, dict[int, int]] = {}   # checkpoint -> replica -> its calls before its part
        self._seeded = False
        self._seed_random: tuple[dict[str, Any], dict[str, Any]] | None = None   # its random states as seeded
        self._own: dict[int, int] = {}   # replica -> clock calls learned from on its current rollout
        self.given: dict[tuple[int, str, int], dict[str, Any]] = {}   # see _take_definition
        # calls gathered on arrival: each fragment's unbatched leaves at a call, as the first replica sent them
        self._apart: dict[str, dict[int, tuple[int, list[Any], int]]] = {}
        self._gifts: dict[str, Any] = {}   # the current call's
        self._names_given: dict[tuple[int, int], bool] = {}   # (replica, skeleton) -> whether it names any
        self._stalled_since = time.monotonic()
        self._stall_warned = False
        self._stall_warn = stall_warn()
        self.resume_objects: tuple[Any, Any] | None = None
        self.resume_random: tuple[Any, Any] | None = None
        self.acting_before: dict[str, dict[int, list[Any]]] = {}   # (resumed) the acting views before its version 0
        if self.saving.get("resume"):
            from fragflow.runtime import checkpoint, snapshot

            ckpt = checkpoint.resumed(self.saving)
            assert ckpt is not None
            if f"objects.{program.group}" in ckpt.manifest["parts"]:
                self.resume_objects = ckpt.part(f"objects.{program.group}")
            if f"states.{program.group}" in ckpt.manifest["parts"]:   # (this group's random states, saved with them)
                meta, arrays = ckpt.part(f"states.{program.group}")
                if snapshot.RANDOM in meta:
                    self.resume_random = (meta[snapshot.RANDOM], arrays)
                self.acting_before = snapshot.acting_views((meta, arrays))
            elif "states" in ckpt.manifest["parts"] and "loop0" in ckpt.manifest["parts"]:
                # written in one process, whose learner drew from the generators the loop's part saved
                # (it drew the run's first numbers again, as from a program's seed, resumed here)
                meta, arrays = ckpt.part("loop0")
                self.resume_random = (meta["random"], arrays)

    # -- interpreter protocol for calls nested inside a fragment -----------------------------
    def call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return frag.fn(*args, **kwargs)

    def replica(self) -> tuple[int, int]:
        return 0, 1

    def env_ids(self, num_envs: int) -> np.ndarray:
        return np.arange(num_envs)

    def adopt(self, resource: Any) -> None:
        pass

    def versioned(self, value: Any, name: str, where: Any) -> Any:
        return value

    # -- definitions from the loop ---------------------------------------------------------------
    def _take_definition(self, block: bool) -> bool:
        try:
            msg = self.defs.get(timeout=IDLE_WAIT) if block else self.defs.get_nowait()
        except Exception:
            if self.stop.is_set():
                from fragflow.backends import Stopped

                raise Stopped from None
            return False
        kind = msg[0]
        if kind == "fragment":
            self.fragments.setdefault(msg[1], self._bind(cloudpickle.loads(msg[2])))
        elif kind == "restarted":   # (the driver) a loop replica's process died: what it was admitted to make will not come
            k = msg[1] - self.program.first
            if 0 <= k < self.program.producers:
                self._void.add(k)
        elif kind == "cut":   # a loop replica saved its part of checkpoint msg[2] after its call msg[3] - 1
            k = msg[1] - self.program.first
            if 0 <= k < self.program.producers:
                self.cuts.setdefault(msg[2], {})[k] = msg[3]
        elif kind == "skeleton":
            skel = self.skeletons[(msg[1] - self.program.first, msg[2])] = cloudpickle.loads(msg[3])
            self._names_given[(msg[1] - self.program.first, msg[2])] = _names_given(skel)
        elif kind == "given":   # the leaves a call names ("given", path): (replica, fragment, call) -> values
            self.given[(msg[1] - self.program.first, msg[2], msg[3])] = cloudpickle.loads(msg[4])
        elif kind == "state":
            if msg[1] in self.states:   # (again, from a first loop replica restarted: the learner's own goes on)
                return True
            if not self._seeded:   # the loop's random states when it made its first state (see LoopInterpreter.versioned)
                from fragflow.runtime.snapshot import global_random, set_global_random

                set_global_random(*msg[3])
                if self.resume_random is not None:   # a resumed run's learner draws on from where it was
                    set_global_random(*self.resume_random)
                self._seeded = True
                self._seed_random = global_random()
            self.states[msg[1]] = cloudpickle.loads(msg[2])
            self._shapes[msg[1]] = structure(self.states[msg[1]])
            _track_scheduled_steps(self.states[msg[1]])
            if self.program.world > 1:
                self.reducer.watch(self.states[msg[1]], msg[1])
            if msg[1] in {b.state for b in self.program.publish}:
                self._publish(msg[1])
        return True

    def _shared_globals(self, fn: types.FunctionType) -> types.FunctionType:
        """Fragments of one module arrive pickled one by one, each (where its module is pickled by
        value, a file the driver imported) with its own copy of the module's globals: one learner
        writing a module dict another reads would not see each other's. The first copy is kept, and
        later fragments (and the functions they brought) are bound to it."""
        old = fn.__globals__
        module = sys.modules.get(fn.__module__)
        if module is not None and vars(module) is old:   # (imported by name here: one module already)
            return fn
        shared = self._module_globals.setdefault(fn.__module__, old)
        if shared is old:
            return fn
        for k, v in old.items():
            if k not in shared:
                shared[k] = _with_globals(v, shared) if isinstance(v, types.FunctionType) and v.__globals__ is old else v
        return _with_globals(fn, shared)

    def _bind(self, frag: Fragment) -> Fragment:
        """The fragments of one object (a replay buffer's add and sample) arrive pickled one by one:
        each would bring its own copy of the object. Keep the first copy and use its fragments."""
        inst = frag.instance
        if inst is None:
            if isinstance(frag.fn, types.FunctionType):
                frag.fn = self._shared_globals(frag.fn)
            return frag
        key = getattr(inst, "name", None) or type(inst).__name__
        held = self.instances.setdefault(key, inst)
        if held is inst:
            served = getattr(inst, "_ff_served", None)
            if callable(served):   # the same numbers whichever replica's copy came first
                served()
            if self.resume_objects is not None and key in self.resume_objects[0]:
                from fragflow.runtime.checkpoint import CheckpointError, decode

                try:
                    inst.load_state_dict(decode(self.resume_objects[0][key], self.resume_objects[1], path=key))
                except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                    raise CheckpointError(f"the checkpoint does not fit this program: {key!r}: {exc}",
                                          fix="resume with the algorithm and arguments that wrote it") from None
            return frag
        # an object's own fragments (a buffer's), or its class's methods bound to it (a user's class)
        for v in vars(held).values():
            if isinstance(v, Fragment) and v.name == frag.name:
                return v
        for klass in type(held).__mro__:
            for v in vars(klass).values():
                if isinstance(v, Fragment) and (bound := v.__get__(held, type(held))).name == frag.name:
                    return bound
        return frag   # (not found on the first copy: this copy's own)

    def _wait_for(self, ready: Any) -> None:
        """Take definitions from the loop until ``ready()``: a call's fragment and skeleton are sent
        before its first piece, but through another queue."""
        while not ready():
            self._take_definition(block=True)

    # -- executing -------------------------------------------------------------------------------
    def _merge(self, fragment: str, pieces: list[_Piece]) -> list[Any]:
        if not self.program.ordered:
            self._compare_apart(fragment, pieces)
        if len(pieces) == 1:
            return pieces[0].leaves
        ring = self.ring_specs[fragment]
        out = []
        for j, (axis, spec) in enumerate(zip(ring.axes, ring.specs)):
            if j in ring.counts:   # each replica's env.num_envs: the merged call has all their environments
                out.append(sum(int(p.leaves[j]) for p in pieces))
                continue
            if axis is None:
                first = pieces[0].leaves[j]
                for p in pieces[1:]:
                    other = p.leaves[j]
                    # replicas at different updates send their own per-update values (a learning-rate
                    # schedule): where calls are gathered on arrival, the call takes the oldest piece's, whose
                    # version ff.delivered() lists first; values that differ at the same call are the
                    # replicas' own data, never one replica's alone (see _compare_apart)
                    if self.program.ordered and not _same_value(first, other, spec.backend):
                        raise self._differs(fragment, j)
                out.append(first)
                continue
            joined = np.concatenate([to_numpy(p.leaves[j]) for p in pieces], axis=axis)
            out.append(from_numpy(joined, spec.backend, spec.device))
        return out

    def _resolve(self, skel: Any) -> Any:
        if skel[0] == "given":
            return self._gifts[skel[1]]
        if skel[0] == "state":
            name = skel[1]
            while name not in self.states:
                self._take_definition(block=True)
            value = self.states[name]
            for k in skel[2]:
                value = value[k]
            return value
        _, fragment, index, keys, made_by = skel
        if made_by is not None:
            value = self._kept_output(fragment, self._gifts[made_by])
        else:   # its latest call: of this call's replica, where its outputs are kept (gathered as they arrive,
            kept = self.kept.get((fragment, self._replica))   # the process's latest may be another replica's)
            value = kept[max(kept)] if kept else self.outputs[fragment]
        value = value if index < 0 else value[index]
        for k in keys:
            value = value[k]
        return value

    def _kept_output(self, fragment: str, call: int) -> Any:
        """The output of ``fragment``'s ``call``-th call in the loop replica of the call being built,
        which the loop kept past its later calls; under a policy that drops stale calls, of the
        latest call before it that ran."""
        kept = self.kept.get((fragment, self._replica), {})
        ran = [c for c in kept if c <= call]
        if not ran:
            raise ConfigError(
                f"'{self.current}' is given the output of call {call + 1} of '{fragment}', which the learner's process "
                f"no longer holds: it keeps the outputs of the last {KEPT_OUTPUTS} calls of a fragment for later "
                f"calls, at most {KEPT_BYTES >> 20} MB of them but for the last {KEPT_MIN} whatever their size, and "
                "none of a call dropped as stale",
                where=self.checks.get("called_at", {}).get(self.current),
                fix=f"keep fewer of them, or have '{fragment}' put what later calls need in versioned state (a "
                    "buffer of its own that it appends to), or run with --policy single_process")
        return kept[max(ran)]

    def _execute(self, fragment: str) -> None:
        pieces = self.pools.pop(fragment)
        if not self.program.ordered:
            pieces.sort(key=lambda p: (p.version, p.tag))
            if len(pieces) > self.program.producers:   # an update held for a late rollout: the oldest go now
                self.pools[fragment] = pieces[self.program.producers:]
                pieces = pieces[:self.program.producers]
        else:
            pieces.sort(key=lambda p: p.replica)
            if len({p.replica for p in pieces}) < len(pieces):   # (one replica's two calls: see _diverged)
                raise self._diverged(fragment, pieces)
            if len({p.steps for p in pieces}) > 1:
                self._refuse_unpaired(fragment, pieces)
        self._wait_for(lambda: fragment in self.fragments and
                       all((p.replica, p.sid) in self.skeletons for p in pieces) and
                       all(st in self.states for st in self.program.states))
        frag = self.fragments[fragment]
        skel = self.skeletons[(pieces[0].replica, pieces[0].sid)]
        self._gifts = {}
        if self._names_given[(pieces[0].replica, pieces[0].sid)]:   # (the same in every replica, no batch axis)
            key = (pieces[0].replica, fragment, pieces[0].call)
            self._wait_for(lambda: key in self.given)
            self._gifts = self.given[key]
            for p in pieces:
                self.given.pop((p.replica, fragment, p.call), None)
        leaves = self._merge(fragment, pieces)
        self.current, self._replica = fragment, pieces[0].replica
        arguments = calls.build(skel, iter(leaves), self._resolve)
        bound = inspect.BoundArguments(frag.signature, arguments)
        self.current = fragment
        # a request is answered with the newest parameters: it is never stale, whatever its stamp
        lags = [0 if fragment in self.replies else self.version - p.version - p.own for p in pieces]
        self.delivered = [(p.version, lag) for p, lag in zip(pieces, lags)]
        t0 = time.perf_counter_ns()
        clock = fragment == self.program.clock
        lead = self.program.rank == 0        # of several learners, one speaks for them all
        if clock and lead:
            self.admission.set_busy(True)
        try:
            with context.using(self):
                if self.reducer is not None and frag.writes is not None:   # every update of the learners' state
                    with self.reducer.update(fragment, required=clock, where=frag.defined_at,
                                             steps=pieces[0].steps if self.program.ordered else -1,
                                             called_at=self.checks.get("called_at", {}).get(fragment),
                                             given=self._unbatched(fragment, leaves) if self.program.ordered else ()) \
                            as written:
                        t1 = time.perf_counter_ns()
                        out = frag.fn(*bound.args, **bound.kwargs)
                        self.reducer.timing["call_ns"] += time.perf_counter_ns() - t1
                        # (the learners compare the new states they made as the update ends)
                        written.state = out[0] if isinstance(out, tuple) else out
                        written.name = skel_state_name(skel, frag.writes)
                else:
                    out = frag.fn(*bound.args, **bound.kwargs)
        except FragflowError:
            raise
        except Exception as exc:   # (the line single_process's error carries: where the loop called it)
            called_at = self.checks.get("called_at", {}).get(fragment)
            exc.add_note(f"(while executing fragment '{fragment}'" + (f" called at {called_at})" if called_at else ")"))
            raise
        rings = [span() for span in {id(p.ring): getattr(p.ring, "memory", None) for p in pieces}.values()
                 if span is not None]
        if rings:   # what the call keeps must outlive its pieces' slots (a learner's state may view its batch)
            out = _owned(out, rings)
        writes = frag.writes
        if writes is not None:
            state = skel_state_name(skel, writes)
            new_value = ordered_like(self.states.get(state), out[0] if isinstance(out, tuple) else out)
            traced = self.checks.get("state", {}).get((fragment, state))
            where = self.checks.get("called_at", {}).get(fragment)
            calls.check_write(new_value, traced, fragment, state, self.version + 1, where, not allow_nonfinite(),
                              self._shapes.get(state))
            self.states[state] = new_value
            self.writes[state] = self.writes.get(state, 0) + 1
            if clock:
                self.version += 1
                if self.version == 1:
                    heap.settle()
                for b in self.program.publish:
                    self._publish(b.state)
            elif state in {b.state for b in self.program.publish}:
                self._publish(state)
        self.outputs[fragment] = out
        if fragment in self.program.keeps:
            # (a writer's new state is not kept: the loop holds it as a state handle, never by reference)
            data = out if writes is None else (None, *out[1:]) if isinstance(out, tuple) else None
            size = _size_of(data)
            for p in pieces:
                kept = self.kept.setdefault((fragment, p.replica), {})
                sizes = self._kept_bytes.setdefault((fragment, p.replica), {})
                kept[p.call], sizes[p.call] = data, size
                while len(kept) > KEPT_OUTPUTS or (len(kept) > KEPT_MIN and sum(sizes.values()) > KEPT_BYTES):
                    oldest = min(kept)
                    del kept[oldest], sizes[oldest]
        if fragment in self.replies:
            self._answer(fragment, out, pieces)
        if clock and lead:
            self.admission.set_busy(False)
        for p, lag in zip(pieces, lags):
            p.ring.release(lag=lag)
        if clock and not self.program.ordered and self.replies:   # served inference, bounded (see _held)
            self._expire(fragment)
        logged = self._logged(fragment, out)
        # the call's number in loop replica 0, which logs: the driver writes what it logged of it
        call = next((p.call for p in pieces if p.replica == 0), None)
        if self.reducer is not None and frag.writes is not None:   # (every update's, as its calls' and all-reduces')
            self.reducer.timing["busy_ns"] += time.perf_counter_ns() - t0
            self.reducer.timing["updates"] += int(clock)
        if clock and lead:
            self.admission.add_busy(time.perf_counter_ns() - t0)
            self.results.put(("update", self.version, fragment, call, logged))
        elif logged and lead:
            self.results.put(("logs", fragment, call, logged))

    def _accept(self, fragment: str, lag: int) -> bool:
        """Whether a piece ``lag`` versions behind is learned from. Served inference with a bound keeps
        its bound whatever the channel's discipline: a fast worker's rollouts acted while an update was
        held all carry that version, and those an update leaves waiting would be learned from
        ``max_lag + 1`` behind; they are dropped (and counted) instead."""
        if self.replies and fragment == self.program.clock and not self.program.ordered:
            return lag <= self.program.max_lag
        return bool(self.program.overflow.accept(lag, self.program.max_lag))

    def _expire(self, fragment: str) -> None:
        """The pieces of ``fragment`` still waiting after an update (it took the oldest) that the new
        version leaves more than ``max_lag`` behind go to the overflow discipline, as they would had
        they been taken now. Within a ring the older pieces go first: its slots are freed in order."""
        pool = self.pools.get(fragment)
        if not pool:
            return
        keep = []
        for p in pool:
            if self._accept(fragment, self.version - p.version - p.own):
                keep.append(p)
            else:
                p.ring.release(dropped=True)
        self.pools[fragment] = keep

    def _answer(self, fragment: str, out: Any, pieces: list[_Piece]) -> None:
        """Send each requesting replica its part of a request's outputs (split along their batch axes)."""
        named = leaf_paths(out)
        leaves = [leaf for _, leaf in named]
        first = self.replies[fragment][pieces[0].replica][0]
        if len(leaves) != len(first.specs):   # (zip below would drop the extra ones)
            self._check_answer(fragment, leaves, first, len(pieces))
        paths = [path for path, _ in named]
        known = self._answered.setdefault(fragment, paths)
        if paths != known:   # (the loop rebuilds the answer in the traced structure: other keys would be misnamed)
            raise SpecChangedError(
                f"fragment '{fragment}' returned outputs {paths}, where its earlier calls returned {known}",
                where=self.checks.get("called_at", {}).get(fragment),
                fix="return the same structure (the same keys) at every call")
        for leaf, axis, spec in zip(leaves, first.axes, first.specs):   # (a longer batch axis would be cut silently)
            shape = getattr(leaf, "shape", ())
            if axis is not None and (len(shape) <= axis or shape[axis] != spec.shape[axis] * len(pieces)):
                self._check_answer(fragment, leaves, first, len(pieces))
                raise SpecChangedError(
                    f"fragment '{fragment}' returned an output of shape {tuple(shape)} for a batch of {len(pieces)} "
                    f"requests of {spec.shape[axis]} rows each", where=self.checks.get("called_at", {}).get(fragment),
                    fix="keep every output's shape fixed across calls: one row per environment it acted for")
        try:
            for i, p in enumerate(pieces):   # the batch holds the pieces' rows in this order (see _merge)
                ring_spec, ring = self.replies[fragment][p.replica]
                part = []
                for leaf, axis, spec in zip(leaves, ring_spec.axes, ring_spec.specs):
                    if axis is None:
                        part.append(leaf)
                    else:
                        n = spec.shape[axis]
                        part.append(to_numpy(leaf).take(range(i * n, (i + 1) * n), axis=axis))
                ring.put(part, self.version)   # (the ring refuses another shape or dtype)
                if self.started[p.replica] is None:
                    self.started[p.replica] = self.version
        except (SpecChangedError, TypeError, ValueError, IndexError):
            self._check_answer(fragment, leaves, first, len(pieces))   # which output, at the actor's line
            raise

    def _check_answer(self, fragment: str, leaves: list[Any], ring_spec: Any, pieces: int) -> None:
        """Refuse outputs of a request that do not match the traced specs the replies were sized for
        (with the batch of ``pieces`` requests along their batch axes), naming the output and the
        loop's line; called where the reply channel refused them."""
        where = self.checks.get("called_at", {}).get(fragment)
        fix = "keep every output's shape and dtype fixed across calls (pad or bucket variable-size data)"
        if len(leaves) != len(ring_spec.specs):
            raise SpecChangedError(f"fragment '{fragment}' returned {len(leaves)} array leaves, but it was traced "
                                   f"returning {len(ring_spec.specs)}", where=where, fix=fix)
        for j, (leaf, axis, spec) in enumerate(zip(leaves, ring_spec.axes, ring_spec.specs)):
            shape = list(spec.shape)
            if axis is not None:
                shape[axis] *= pieces
            got = spec_of(leaf)
            if got.shape != tuple(shape) or (got.dtype != spec.dtype and spec.backend != "python"):
                want = replace(spec, shape=tuple(shape))
                raise SpecChangedError(f"fragment '{fragment}' returned output leaf {j} as {got.short()} "
                                       f"{got.backend}, but it was traced as {want.short()} {want.backend}",
                                       where=where, fix=fix)

    def _logged(self, fragment: str, out: Any) -> dict[int, dict[str, float]]:
        """The scalars of each part of the call's output the loop may log (see lowering's _logged),
        by their path in the part ("" for a part that is one scalar)."""
        logged: dict[int, dict[str, float]] = {}
        for part, item in enumerate(self.program.logs.get(fragment, ())):
            value = out if item.index < 0 else out[item.index]
            try:
                for k in item.keys:
                    value = value[k]
            except (KeyError, IndexError, TypeError):
                continue   # a metric this call did not return (the learner reports it now and then)
            bad = non_scalar(value) if item.names else None   # (a part the loop sent to ff.log while traced)
            if bad is not None:
                where = "".join(f"[{k!r}]" for k in (*item.keys, *(bad[0].split("/") if bad[0] else ())))
                raise ConfigError(
                    f"output {'' if item.index < 0 else f'[{item.index}]'}{where} of fragment '{fragment}', which "
                    f"the loop logs, has shape {bad[1]}, not a scalar (it was one while the program was traced)",
                    where=self.checks.get("called_at", {}).get(fragment),
                    fix="return scalars to log: reduce it first (x.mean(), x.max()) or return its elements under "
                        "names of their own")
            logged[part] = scalars_in(value)
        return logged

    def _publish(self, state: str) -> None:
        b = next(b for b in self.program.publish if b.state == state)
        leaves: list[Any] = []
        value = self.states[state]
        for path in b.paths:
            sub = value
            for k in path:
                sub = sub[k]
            leaves.extend(flatten(without_optimizers(sub))[0])
        try:
            self.endpoints.broadcasts[state].publish(leaves, self.version, self.writes.get(state, 0))
        except (SpecChangedError, TypeError, ValueError) as exc:   # (the channel's own words name no fragment)
            raise self._unfit(state, exc) from None

    def _unfit(self, state: str, exc: Exception) -> Exception:
        """The broadcast, sized from the state's traced specs, refused the state a learner just wrote:
        the learner changed a leaf's dtype or shape (or the state's structure) at an update the
        periodic check skips. Named as that check names it: the learner, its line, the leaf."""
        writer = self.current
        traced = self.checks.get("state", {}).get((writer, state))
        if traced is None:   # (published as it came: no learner wrote it)
            return exc
        where = self.checks.get("called_at", {}).get(writer)
        update = self.version if writer == self.program.clock else self.version + 1
        try:
            calls.check_state(self.states[state], traced, writer, state, where, update=update)
        except SpecChangedError as found:
            return found
        return SpecChangedError(
            f"learner '{writer}' returned state '{state}' in update {update} that no longer fits the channel "
            f"sized from its traced specs, which carries it to the acting side: {exc}", where=where,
            fix="keep the state's shapes, dtypes and structure fixed (cast back, e.g. x.astype(np.float32))")

    def _save(self, seq: int) -> None:
        """This group's part of checkpoint ``seq``: the states it writes and its objects' state_dicts."""
        from fragflow.runtime import checkpoint, snapshot

        self.saved_seq = seq
        for old in [s for s in self.cuts if s <= seq]:
            del self.cuts[old]
        group = self.program.group
        objects: dict[str, Any] = {}
        arrays: dict[str, Any] = {}
        for key, inst in self.instances.items():
            if callable(getattr(inst, "state_dict", None)) and callable(getattr(inst, "load_state_dict", None)):
                try:
                    objects[key] = checkpoint.encode(inst.state_dict(), f"object.{key}", arrays)[0]
                except checkpoint.Unsupported as exc:
                    raise checkpoint.CheckpointError(
                        f"cannot save {key!r} in the {group} process: its state_dict() holds {exc}",
                        fix="return arrays, numbers, strings and dicts/lists of them from state_dict()") from None
        if objects:   # before the states part: the driver commits once every expected part is in
            checkpoint.deliver(self.results, self.saving, seq, self.driver, f"objects.{group}", objects, arrays, {})
        owned = set(self.program.writes) | set(self.writes) | {b.state for b in self.program.publish}
        meta, arrays = snapshot.encode_states({n: (self.version, v) for n, v in self.states.items() if n in owned})
        rng, rng_arrays = snapshot.global_random()   # what the learner draws next (torch.randperm, dropout)
        # ... and which of them it drew from (in this run, or in the one it resumed): a resumed run in
        # one process goes on from these where its loop did not draw (see snapshot.drawn_apart)
        before = (self.resume_random or ({}, {}))[0].get("drew", [])
        since = snapshot.drawn((rng, rng_arrays), self._seed_random) if self._seed_random is not None else []
        rng["drew"] = [g for g in snapshot.GENERATORS if g in before or g in since]
        meta[snapshot.RANDOM] = rng
        arrays.update(rng_arrays)
        if self.program.max_lag and self.program.ordered and self.program.publish:
            meta[snapshot.ACTING] = snapshot.encode_acting(self._acting_views(), arrays)
        checkpoint.deliver(self.results, self.saving, seq, self.driver, f"states.{group}", meta, arrays,
                           {"version": self.version})

    def _acting_views(self) -> dict[str, dict[int, list[Any]]]:
        """What the acting side reads of each state it is sent, at the ``max_lag`` versions before
        this one: under an exact version choice the loop's next trips act with them (update ``i``
        with version ``i - max_lag``), so a run resumed from this checkpoint must have them. Keyed by
        how many versions before; none before the run's first (acted with version 0, saved)."""
        out: dict[str, dict[int, list[Any]]] = {}
        for b in self.program.publish:
            views = out[b.state] = {}
            for k in range(1, self.program.max_lag + 1):
                v = self.version - k
                if v >= 0:   # (still in the broadcast, max_lag + 3 versions deep; complete: a newer one is out)
                    views[k] = self.endpoints.broadcasts[b.state].read(v)[1]
                elif v in self.acting_before.get(b.state, {}):   # (this run is resumed: before its version 0)
                    views[k] = self.acting_before[b.state][v]
        return out

    def run(self) -> None:
        ended = False
        try:
            self._run()
            ended = True
        finally:
            if self.reducer is not None:   # (one that failed does not say it ended: its own error is the run's)
                self.reducer.close(ended)

    def _run(self) -> None:
        while True:
            t0 = time.perf_counter_ns()
            fragment = self._next()
            if self.program.rank == 0:
                self.admission.add_wait(time.perf_counter_ns() - t0)
            if fragment is None:
                break
            self._execute(fragment)
        for pieces in self.pools.values():   # calls no replica completed (arrival gathering at the end)
            for p in pieces:
                p.ring.release(dropped=True)
        if self.reducer is not None:   # (before "final": the driver reads it once every process has ended)
            self.reducer.report()
        self.results.put(("final", self.program.group,
                          {name: cloudpickle.dumps(value) for name, value in self.states.items()}))


def _names_given(skel: Any) -> bool:
    """Whether a call's skeleton names leaves the loop sent with the call (``("given", path)``)."""
    kind = skel[0]
    if kind == "given" or (kind == "ref" and skel[4] is not None):
        return True
    if kind == "dict" or kind == "namedtuple":
        return any(_names_given(c) for c in skel[2])
    if kind in ("list", "tuple"):
        return any(_names_given(c) for c in skel[1])
    return False


def skel_state_name(skel: Any, param: str) -> str:
    """The versioned state a call passes as ``param`` (the skeleton of the call's arguments)."""
    keys, kids = skel[1], skel[2]
    ref = kids[keys.index(param)]
    return str(ref[1])


def _owned(tree: Any, spans: list[tuple[int, int]]) -> Any:
    """``tree`` with each array leaf whose memory lies in one of ``spans`` (ring slots about to be
    freed for the next piece) replaced by a copy: a batch's zero-copy views are the call's to read,
    not to keep (``torch.as_tensor(batch["obs"])[-1]`` in the state it returns). Dicts and lists are
    changed in place; modules and optimizers hold their own tensors and are not walked."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            new = _owned(v, spans)
            if new is not v:
                tree[k] = new
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            new = _owned(v, spans)
            if new is not v:
                tree[i] = new
        return tree
    if isinstance(tree, tuple):
        kids = [_owned(v, spans) for v in tree]
        if all(a is b for a, b in zip(kids, tree)):
            return tree
        return type(tree)(*kids) if hasattr(tree, "_fields") else tuple(kids)
    at = address(tree)
    if at is not None and any(lo <= at[0] < hi for lo, hi in spans):
        return tree.copy() if isinstance(tree, np.ndarray) else tree.clone()
    return tree


def _track_scheduled_steps(state: Any) -> None:
    """Wrap again the ``step`` of every optimizer a learning-rate scheduler in ``state`` steps, as
    the scheduler did when it was made: an optimizer is sent without its instance attributes, and
    its scheduler's first step then warned that ``optimizer.step()`` had been overridden."""
    import functools
    import weakref

    from fragflow.compiler.pytree import is_scheduler
    from fragflow.compiler.reach import objects_of

    for sched in (x for x in objects_of(state) if is_scheduler(x)):
        opt = getattr(sched, "optimizer", None)
        if opt is None or hasattr(opt.step, "_wrapped_by_lr_sched"):
            continue
        step, ref = type(opt).step, weakref.ref(opt)

        def wrapper(*args: Any, _step: Any = step, _ref: Any = ref, **kwargs: Any) -> Any:
            held = _ref()
            held._opt_called = True
            return _step(held, *args, **kwargs)

        wrapper = functools.wraps(step)(wrapper)
        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = wrapper
