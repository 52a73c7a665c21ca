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

import contextlib
import functools
import inspect
import os
import sys
import time
import types
from typing import Any

import cloudpickle
import numpy as np

from fragflow import context
from fragflow.api.fragment import Fragment
from fragflow.compiler.optimizers import track_scheduled_steps
from fragflow.compiler.pytree import (
    NotAnArray,
    from_numpy,
    kind_change,
    leaf_paths,
    ordered_like,
    spec_of,
    structure,
    to_numpy,
)
from fragflow.context import InstanceNames
from fragflow.errors import ConfigError, FragflowError, SpecChangedError
from fragflow.lowering import ServiceProgram
from fragflow.runtime import calls, heap, kernels
from fragflow.runtime.gathering import IDLE_WAIT, Gathering, _Piece
from fragflow.runtime.loop import allow_nonfinite
from fragflow.runtime.outbox import Outbox
from fragflow.runtime.outgoing import Outgoing, owned
from fragflow.runtime.replicas import _same_value

KEPT_OUTPUTS = 64   # outputs of a fragment kept for later calls given one of them (see ServiceProgram.keeps)
KEPT_BYTES = 32 << 20   # and at most this many bytes of them (a sample a learner takes at once, kept for nothing) ...
KEPT_MIN = 8   # ... but for the last this many, whatever their size (two samples taken for one call)
STALL_WARN = 30.0   # seconds a call may wait for the other replicas' share before the run warns
DEFS_POLL = 0.01   # seconds between looks at the definitions queue that find nothing, without waiting (see _take_definition)


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


class ServiceRunner(Outgoing, Gathering):
    """Runs one service group (also the interpreter for fragment calls nested in its fragments)."""

    def __init__(self, program: ServiceProgram, endpoints: Any, checks: dict[str, Any],
                 saving: dict[str, Any] | None = None, driver: int = 0) -> None:
        self.program = program
        self.endpoints = endpoints
        self.checks = checks
        self.results = endpoints.results
        self.defs = endpoints.definitions(program.group)
        self._defs_polled = 0.0   # when a look at the definitions without waiting last found none (see _take_definition)
        self.stop = endpoints.stop
        self.admission = endpoints.admission
        self.version = 0
        self.writes: dict[str, int] = {}   # writes of each state executed (the stamps of its broadcast)
        self.current = program.clock
        self._outbox = Outbox(self.results)   # reports to the driver not sent yet (its updates, what it logs)
        self.fragments: dict[str, Fragment] = {}
        self.instances: dict[str, Any] = {}
        self._module_globals: dict[str, dict[str, Any]] = {}   # a module's globals, as its first fragment brought them
        self.skeletons: dict[tuple[int, int], Any] = {}
        self.states: dict[str, Any] = {}
        self._shapes: dict[str, Any] = {}   # each state's structure, as it came (a learner's new state keeps it)
        self._every = calls.check_every()   # (read once: a learner's writes are checked at each update)
        self._finite = not allow_nonfinite()
        self.outputs: dict[str, Any] = {}
        self._calls_made: dict[tuple[int, str], int] = {}   # (replica, fragment): the number of its last call taken
        self._calls_saved: dict[tuple[int, str], int] = {}   # ... (resumed) as the checkpoint has them
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
        # each replica's env steps at its latest clock call taken (learned from, or dropped as stale): where
        # calls are gathered on arrival, an update's metrics row counts these (see Monitor.arrived_update)
        self.taken_steps = [0] * program.producers
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
            self.reducer.left_loop = checks.get("left_loop", {})   # (where the loop replicas may leave apart)
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
        # calls gathered on arrival of a fragment given no batch axis: each replica's last call's values
        self._whole: dict[tuple[str, int], tuple[int, list[Any]]] = {}
        self._changed: dict[str, tuple[int, int, int]] = {}   # (leaf, call, next call) whose values changed
        self._alike: dict[str, set[int]] = {}   # the calls at which two replicas were seen to send the same values
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
            # each loop replica's calls of this group's fragments before the checkpoint: replicas saved at
            # different trips resume at different calls, and whole-run counts are what must agree at the end
            # (one saved past a call every replica makes once, the others before it, made it already)
            for k in range(program.producers):
                meta = ckpt.manifest["parts"].get(f"loop{program.first + k}") or {}
                for fragment, last in meta.get("calls", {}).items():
                    if fragment in program.fragments:
                        self._calls_made[(k, str(fragment))] = self._calls_saved[(k, str(fragment))] = int(last)
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

    def _same_generators(self, state: str) -> None:
        """Said once per state: a random generator the state holds is the same in every learner, which
        draw the same numbers for their different shares of the batch."""
        from fragflow.compiler.pytree import is_generator
        from fragflow.compiler.reach import objects_of

        found = sorted({type(o).__module__.split(".")[0] + "." + type(o).__name__
                        for o in objects_of(self.states[state]) if is_generator(o)})
        if found:
            self.results.put(("warn", (
                f"versioned state '{state}' holds a random generator ({', '.join(found)}), the same in each of the "
                f"{self.program.world} learners: they draw the same numbers for their different shares of the batch "
                "(per-sample noise repeats across the learners, and the update is not one learner's on the whole "
                "batch); offset it by the learner's place (`torch.distributed.get_rank()` where `ff.learners() > 1`), "
                "or run with a single-learner policy")))

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
        """Take one message from the loop or the driver (waiting for it where ``block``); whether one
        was taken. Without waiting, a look finds what has come at most every ``DEFS_POLL`` seconds:
        messages are rare (a fragment's code and skeleton once, a restarted replica, a checkpoint's cut),
        a call's own definitions are waited for where it needs them (:meth:`_wait_for`), and a look
        costs ~10 us (a queue's lock and poll, the run's stop flag), which gathering took twice an update."""
        if not block:
            now = time.monotonic()
            if now - self._defs_polled < DEFS_POLL:
                return False
        try:
            msg = self.defs.get(timeout=IDLE_WAIT) if block else self.defs.get_nowait()
        except Exception:
            if not block:
                self._defs_polled = now
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
            track_scheduled_steps(self.states[msg[1]])
            if self.program.world > 1:
                self.reducer.watch(self.states[msg[1]], msg[1])
                if self.program.rank == 0 and msg[1] in self.program.writes:
                    self._same_generators(msg[1])
            if msg[1] in {b.state for b in self.program.publish}:
                self._publish(msg[1], made=True)
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

    def _torch_mode(self, fragment: str) -> Any:
        """The mode the loop called ``fragment`` in, where it turned gradients off around every call (a
        served actor called inside ``with torch.no_grad():``, as CleanRL acts): its calls run in it
        here too, as eagerly (the placement refuses an autocast, or a mode some calls had and some not)."""
        mode = self.checks.get("torch_mode", {}).get(fragment)
        if not mode or "autocast" in mode:
            return contextlib.nullcontext()
        import torch

        return torch.inference_mode() if mode == "torch.inference_mode()" else torch.no_grad()

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
                        with kernels.in_fragment, self._torch_mode(fragment):
                            out = frag.fn(*bound.args, **bound.kwargs)
                        self.reducer.timing["call_ns"] += time.perf_counter_ns() - t1
                        # (the learners compare the new states they made as the update ends)
                        written.state = out[0] if isinstance(out, tuple) else out
                        written.name = skel_state_name(skel, frag.writes)
                else:
                    with kernels.in_fragment, self._torch_mode(fragment):
                        out = frag.fn(*bound.args, **bound.kwargs)
        except FragflowError:
            raise
        except Exception as exc:   # (the line single_process's error carries: where the loop called it)
            called_at = self.checks.get("called_at", {}).get(fragment)
            exc.add_note(f"(while executing fragment '{fragment}'" + (f" called at {called_at})" if called_at else ")"))
            raise
        traced, got = self.checks.get("arity", {}).get(fragment), len(out) if isinstance(out, tuple) else 0
        if traced is not None and got != traced:
            raise SpecChangedError(   # (the loop holds the traced count of outputs: it unpacks those)
                f"fragment '{fragment}' returned {_outputs(got)} at its call {pieces[0].call + 1}, where the traced "
                f"calls returned {_outputs(traced)}: the loop, in another process, takes its outputs as traced",
                where=self.checks.get("called_at", {}).get(fragment),
                fix="return the same number of outputs at every call (put what changes in a dict of one output)")
        kinds = self.checks.get("kinds", {}).get(fragment)
        if kinds is not None:
            changed = kind_change(kinds, out, "outputs" if isinstance(out, tuple) else "", 1 if isinstance(out, tuple) else 0)
            if changed:   # (a dict of metrics the loop tests with isinstance, a list now: it holds the traced kind)
                raise SpecChangedError(
                    f"fragment '{fragment}' returned another kind of output at its call {pieces[0].call + 1} than "
                    f"its traced calls ({changed}): the loop, in another process, takes its outputs as traced",
                    where=self.checks.get("called_at", {}).get(fragment),
                    fix="return the same kinds at every call (a dict of metrics every time, its values changing; "
                        "a list of the same length), or run with --policy single_process")
        rings = [span() for span in {id(p.ring): getattr(p.ring, "memory", None) for p in pieces}.values()
                 if span is not None]
        if rings:   # what the call keeps must outlive its pieces' slots (a learner's state may view its batch)
            out = owned(out, rings)
        writes = frag.writes
        if writes is not None:
            state = skel_state_name(skel, writes)
            new_value = ordered_like(self.states.get(state), out[0] if isinstance(out, tuple) else out)
            traced = self.checks.get("state", {}).get((fragment, state))
            where = self.checks.get("called_at", {}).get(fragment)
            calls.check_write(new_value, traced, fragment, state, self.version + 1, where, self._finite,
                              self._shapes.get(state), self._every)
            self.states[state] = new_value
            if self.reducer is not None:   # (a module the learner made anew has parameters of its own to average)
                self.reducer.watch(new_value, state, self.states)
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
            if clock:
                self.taken_steps[p.replica] = max(self.taken_steps[p.replica], p.steps)
        if clock and not self.program.ordered:
            if self.replies:   # served inference, bounded (see _held)
                self._expire(fragment)
            # another learner's pieces waiting for every replica's (a learner called every few trips, each
            # replica's call arriving apart) are held to the bound as the clock's are, not only when taken
            for other in list(self.pools):
                if other != fragment and other not in self.replies:
                    self._expire(other)
        logged = self._logged(fragment, out)
        # the call's number in loop replica 0, which logs: the driver writes what it logged of it
        call = next((p.call for p in pieces if p.replica == 0), None)
        mine = tuple(p.call for p in pieces if p.replica == 0)   # (gathered on arrival: one, several or none)
        if self.reducer is not None and frag.writes is not None:   # (every update's, as its calls' and all-reduces')
            self.reducer.timing["busy_ns"] += time.perf_counter_ns() - t0
            self.reducer.timing["updates"] += int(clock)
        if clock and lead:
            self.admission.add_busy(time.perf_counter_ns() - t0)
            self._report(("update", self.version, fragment, call, logged, tuple(self.taken_steps)))
        elif logged and lead:
            self._report(("logs", fragment, call, logged, mine))

    def _report(self, msg: tuple[Any, ...]) -> None:
        """A report to the driver, into the outbox (see :meth:`flush_reports`)."""
        self._outbox.add(msg)
        self._reports_due()

    def _reports_due(self) -> None:
        # (a run cut into checkpoints by updates: the driver asks for the next one as it hears of them)
        if self._outbox.items and (self._outbox.due() or self.saving.get("root")):
            self.flush_reports()

    def flush_reports(self) -> None:
        """Send the reports not sent yet, in order, in one put (see :mod:`fragflow.runtime.outbox`):
        every ``REPORT_EVERY`` seconds, while the group waits for calls, and where the driver must have
        them all (a checkpoint part, the end); at once where the run is checkpointed."""
        self._outbox.send()

    def _accept(self, fragment: str, lag: int) -> bool:
        """Whether a piece ``lag`` versions behind is learned from. Served inference with a bound keeps
        its bound whatever the channel's discipline: a fast worker's rollouts acted while an update was
        held all carry that version, and those an update leaves waiting would be learned from
        ``max_lag + 1`` behind; they are dropped (and counted) instead."""
        if self.replies and fragment not in self.replies and not self.program.ordered:   # (every learner's)
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
                self._dropped(fragment, p.replica, p.call)
        self.pools[fragment] = keep

    def _dropped(self, fragment: str, replica: int, call: int) -> None:
        """A call dropped as stale: where loop replica 0 made it and may log its outputs, the driver
        hears that it will have none (a row waiting for them is written without them)."""
        if replica == 0 and self.program.rank == 0 and fragment != self.program.clock and self.program.logs.get(fragment):
            self._report(("dropped", fragment, call))

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
        for fragment, pieces in self.pools.items():   # calls no replica completed (arrival gathering at the end)
            for p in pieces:
                p.ring.release(dropped=True)
                self._dropped(fragment, p.replica, p.call)
        if self.reducer is not None:   # (before "final": the driver reads it once every process has ended)
            self.reducer.report()
        self.flush_reports()
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


def _outputs(n: int) -> str:
    """A fragment's count of outputs in words (0: one value, not a tuple)."""
    return "one value (not a tuple)" if n == 0 else f"a tuple of {n}"

