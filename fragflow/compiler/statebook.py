"""The tracer's book of the versioned state (a mixin of :class:`~fragflow.compiler.tracer.Tracer`):
each state made (``ff.versioned``), read by a fragment (its STATE_READ edge and the leaves a broadcast
carries) and written by a learner (its STATE_WRITE edge, its structure and finiteness checked as the
run checks them); and what the loop does to it between fragment calls: its own torch operations on
the state's tensors (``StateUse``), an array it changed in place through a variable of its own (the
checksums), module data a fragment reaches that the loop changed, memory a call changed in place that
a later call is given again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView, own_value
from fragflow.compiler.inplace import Changed, array_leaves, containers, memory_bounds, overlap
from fragflow.compiler.ir import EdgeKind, LeafSpec
from fragflow.compiler.pytree import (
    NotAnArray,
    is_static,
    leaf_paths,
    ordered_like,
    spec_of,
    structure,
    typed_key_fix,
    typed_key_note,
    without_optimizers,
)
from fragflow.compiler.reach import again, changed_part, objects_of, reached_now
from fragflow.compiler.recording import NodeRec
from fragflow.compiler.repeats import Repeats, _leaf_list
from fragflow.compiler.statecheck import check_new_state, fingerprint, grad_flags
from fragflow.compiler.watchers import StateUse
from fragflow.errors import NotArrayPytreeError, VersionedStateError
from fragflow.source import SourceLoc, user_callsite


@dataclass
class _StateRec:
    created_at: SourceLoc | None
    versions: int = 1
    shape: Any = None   # its structure as made (a learner's new state keeps it)


class StateBook(Repeats):
    """The versioned state's records and checks while tracing (the attributes below are the tracer's)."""

    state_use: StateUse
    begins_run: bool
    state_read: tuple[str, SourceLoc | None] | None
    state_printed: tuple[str, SourceLoc | None] | None
    remade_state: SourceLoc | None
    stale_state: Any
    changed_arg: Any
    _states: dict[str, _StateRec]
    _latest: dict[str, Versioned]
    _names: Callable[[str], str]
    _state_objects: dict[int, tuple[str, Any]]
    _state_prints: dict[str, tuple[int, list[tuple[str, list[int]]], list[bool]]]
    _readers: dict[str, set[str]]   # a state's readers (not learners) since its last watch
    _changed_args: list[Changed]
    _changed_data: dict[int, str]
    _rebound: dict[tuple[int, str], tuple[str, str, dict[str, Any]]]
    modes: Any   # the training modes fragments (and the loop) set (compiler.modes.ModeBook)

    def read_state(self, x: Versioned | VersionedView, what: str | None) -> tuple[bool, Any]:
        """The loop reads versioned state: as eagerly (the run may be one process), noted for placement
        (``what`` None: printed, not a read)."""
        name = x.name if isinstance(x, Versioned) else x.handle.name
        # (before any learner wrote it, every process holds the value the loop made: read as eagerly)
        if self.state_read is None and what is not None and name in self.state_use.written:
            self.state_read = (what, user_callsite())
        if self.state_printed is None and what is None and name in self.state_use.written:
            self.state_printed = (name, user_callsite())   # (printed: no read; where a learner runs apart, said)
        return True, own_value(x)

    def versioned(self, value: Any, name: str, where: SourceLoc | None) -> Versioned:
        try:
            leaf_paths(value)
        except NotAnArray as bad:
            raise NotArrayPytreeError(
                f"ff.versioned(...) got a value whose leaf {bad.path or '<root>'} is a {type(bad.value).__name__}"
                + typed_key_note(bad.value),
                where=where, fix=typed_key_fix(bad.value) or (
                    "a module's get_extra_state travels with its versions as a pytree: return arrays, numbers and "
                    "dicts/lists/tuples of them (set_extra_state gets the same back), or keep the value in a buffer"
                    if "_extra_state'" in bad.path else None) or
                "versioned state is a pytree (dict/list/tuple) of numpy, torch or jax arrays, "
                "torch modules, torch.optim optimizers and their learning-rate schedulers, random generators "
                "(torch.Generator, numpy's Generator or RandomState); keep "
                "anything else out of it",
            ) from None
        if where is not None and any(rec.created_at == where and rec.versions > 1 for rec in self._states.values()):
            self.remade_state = where   # run again at the line that made a state a learner has written: in the loop
        unique = self._names(name)
        self._states[unique] = _StateRec(where, shape=structure(value))
        for obj in objects_of(value):
            self._state_objects.setdefault(id(obj), (unique, obj))
        handle = self._latest[unique] = Versioned(unique, 0, value, where)
        on, self.state_use.on = self.state_use.on, False
        try:
            self._watch_states()
        finally:
            self.state_use.on = on
        return handle

    @contextlib.contextmanager
    def watching_state(self) -> Iterator[None]:
        """While the loop runs, its own torch operations on the state's tensors are watched (see
        StateUse), where the trace is not the run's beginning (in one process they are as eagerly)."""
        if self.begins_run:
            yield
            return
        with self.state_use.mode(), self.modes.watching_loop():
            self.state_use.on = True
            try:
                yield
            finally:
                self.state_use.on = False
                self.state_use.unwatch()

    def _watch_states(self) -> None:
        """The states' newest values: their tensors watched, their checksums kept (see state_use)."""
        if self.begins_run:
            return
        values = {name: handle.value for name, handle in self._latest.items()}
        self.state_use.watch(values)
        self._state_prints = {name: (id(v), _leaf_prints(v), grad_flags(without_optimizers(v)))
                              for name, v in values.items()}
        self._readers = {}

    def _state_changed(self, learner: tuple[str, SourceLoc | None] | None, when: str = "seen at") -> None:
        """Note a state the loop changed in place since the last learner call (or since it was made):
        what StateUse does not see, such as an array the state holds changed through a variable of the
        loop's own (``w *= 0.5``), at ``learner``'s call, which would have read the change."""
        if self.state_use.first is not None or any(r.mutates for r in self._nodes.values()):
            return   # (a fragment that changes the state it reads is refused by its own rule)
        for name, (ident, before, grads) in self._state_prints.items():
            handle = self._latest.get(name)
            if handle is None or id(handle.value) != ident:
                continue
            readers = sorted(self._readers.get(name, ()))
            if readers and grad_flags(without_optimizers(handle.value)) != grads:
                # a layer frozen (requires_grad_(False)) by a fragment that read the state, in a call after
                # those checked: the learner's copy, where it runs apart, would learn on (the loop's own
                # requires_grad_ is a torch operation StateUse sees)
                self._mutated(readers, name, "the requires_grad of its tensors")
                return
            after = _leaf_prints(handle.value)
            if after != before:
                changed = next((p for (p, a), (_, b) in zip(after, before) if a != b), "")
                leaf = dict(_leaf_list(without_optimizers(handle.value))).get(changed)
                if readers and type(leaf).__module__.startswith("torch"):
                    # a tensor the loop's own torch operations did not change (StateUse saw none): a fragment
                    # that read it since changed it, in a call after those checked (an actor's, once its
                    # exploration ends); the placement refuses it as one that changes the state it reads
                    self._mutated(readers, name, f"{name}{changed}")
                    return
                who, at = learner or ("", None)
                self.state_use.first = ("changed", name, f"{name}{changed}",
                                        f"{when} the call of learner '{who}'" if who else "", at)
                return

    def _mutated(self, readers: list[str], state: str, what: str) -> None:
        """``readers`` (fragments that read ``state`` since the last learner call, none a learner)
        changed it in place: each is refused as a fragment that changes the state it reads."""
        for rec in self._nodes.values():
            if rec.name in readers and not rec.mutates:
                others = [repr(r) for r in readers if r != rec.name]
                rec.mutates = (f"'{state}' ({what}, in a call after its first"
                               f"{', or that of ' + ', '.join(others) if others else ''})")

    def _read_changed(self, rec: NodeRec, bound: inspect.BoundArguments, where: SourceLoc | None) -> None:
        """Note the first call given memory that an earlier call changed in place and nothing has
        written since (the array, a view of it, a tensor sharing it): eagerly it sees the change;
        where the changer runs in another process (sent a copy), it would not."""
        values = [(p, v) for p, v in bound.arguments.items() if not isinstance(v, (Versioned, VersionedView))
                  and not is_static(v)]
        held = {id(box) for _, box in containers(values)}
        memory = [b for b in (memory_bounds(leaf) for _, leaf in array_leaves(values)) if b is not None]
        for c in list(self._changed_args):
            if not (id(c.value) in held if c.bounds is None else any(overlap(c.bounds, b) for b in memory)):
                continue
            if c.now() != c.after:   # written since (storage refilled, entries set again): not the change
                self._changed_args.remove(c)
                continue
            self.changed_arg = (c.changer, c.label, c.at, rec.name, where or user_callsite(), c.producer)
            return

    def _loop_changed(self) -> None:
        """Note module data a fragment's code reaches (a global dict, a closure's number) that changed
        since its first call, where no fragment changed it: the loop did (CFG["epsilon"] = 0.0)."""
        for rec in self._nodes.values():
            if rec.reached and not rec.loop_changes:
                for label, holder, name, value, before in rec.reached:
                    if id(value) in self._changed_data or id(value) in self._state_objects or \
                            (id(holder), name) in self._rebound:
                        continue   # (a fragment changes it, or it is versioned state's: each refused or kept by its own rule)
                    now = reached_now(holder, name)
                    after = again(now, before)   # (rebound to what holds the same: CFG = {**CFG, "x": 1})
                    if after != before:   # (an object rebound: another identity)
                        rec.loop_changes = label + changed_part(before, after)
                        break

    def _read_state(self, rec: NodeRec, frag: Fragment, pname: str, value: Versioned | VersionedView,
                    window: int, where: SourceLoc | None) -> Any:
        handle = value if isinstance(value, Versioned) else value.handle
        path = "" if isinstance(value, Versioned) else value.path_str
        state = self._states.get(handle.name)
        if state is not None and handle.version < state.versions - 1 and self.stale_state is None:
            # a version a learner has written since: the loop kept the old handle (``_, m = learn(state)``)
            self.stale_state = (handle.name, handle.version, state.versions - 1, rec.name,
                                where or user_callsite())
        edge = self._edge(handle.name, rec.name, EdgeKind.STATE_READ, path, pname)
        edge.crossings[window] += 1
        if rec.role != "learner":   # (who may have changed it in place, see _state_changed)
            readers = self._readers.get(handle.name)
            if readers is None:
                readers = self._readers[handle.name] = set()
            readers.add(rec.name)
        resolved = handle.value if isinstance(value, Versioned) else value.resolve(handle.value)
        if edge.read_version != handle.version:   # a version's leaves are read once (an actor reads it every step)
            edge.read_version = handle.version
            for p, leaf in leaf_paths(without_optimizers(resolved)):   # what a broadcast carries
                edge.leaves[(p, p)] = LeafSpec(p, p, spec_of(leaf))
        return resolved

    def _write_state(self, rec: NodeRec, handle: Versioned, out: Any, where: SourceLoc | None, window: int) -> Any:
        if isinstance(out, tuple) and not out:
            raise VersionedStateError(
                f"learner '{rec.name}' writes '{handle.name}' but returned an empty tuple",
                where=rec.defined_at, fix="return the next version of the state, or (new_state, ...) with it first")
        new_value = ordered_like(handle.value, out[0] if isinstance(out, tuple) else out)
        try:
            leaves = leaf_paths(new_value)
        except NotAnArray as bad:
            raise NotArrayPytreeError(
                f"learner '{rec.name}' returned new state whose leaf {bad.path or '<root>'} is a {type(bad.value).__name__}",
                where=rec.defined_at, fix="state must be a pytree (dict/list/tuple) of numpy, torch or jax arrays") from None
        from fragflow.runtime.calls import cast_expression, check_finite, check_structure

        edge = self._edge(rec.name, handle.name, EdgeKind.STATE_WRITE, "[0]", "")
        if not edge.leaves:   # its first write
            check_new_state(rec.name, handle, leaves, rec.defined_at)
        else:   # a later one keeps each leaf as the first had it (f64 made and written, then f32 at call 2)
            for p, leaf in leaves:
                was, now = edge.leaves[(p, p)].spec if (p, p) in edge.leaves else None, spec_of(leaf)
                if was is not None and (was.shape, was.dtype, was.backend) != (now.shape, now.dtype, now.backend):
                    raise VersionedStateError(
                        f"learner '{rec.name}' returned, as the next version of '{handle.name}' at its call "
                        f"{sum(rec.calls)}, {p} as {now.short()} {now.backend}, but the state holds {was.short()} "
                        f"{was.backend} (as made, and as its earlier calls returned it)", where=where or rec.called_at,
                        fix="keep every leaf's shape, dtype and array library (cast back: " +
                            (cast_expression(was) or "as made") + "), or create the state as the learner returns it")
        from fragflow.runtime.loop import allow_nonfinite

        made = self._states.get(handle.name)
        if made is not None and made.shape is not None:   # a later write too (a key added at the second update)
            check_structure(new_value, made.shape, rec.name, handle.name, sum(rec.calls), where or rec.called_at)

        if not allow_nonfinite():   # as the run checks it (the trace is single_process's first updates)
            check_finite(new_value, rec.name, sum(rec.calls), where or user_callsite(), leaves)
        edge.crossings[window] += 1
        for p, leaf in leaves:
            edge.leaves[(p, p)] = LeafSpec(p, p, spec_of(leaf))
        self._states[handle.name].versions += 1
        new = Versioned(handle.name, handle.version + 1, new_value, handle.created_at)
        latest = self._latest.get(handle.name)
        if latest is None or handle.version >= latest.version:   # (not a call on a version the loop kept)
            self._latest[handle.name] = new
        return (new, *out[1:]) if isinstance(out, tuple) else new


def _leaf_prints(value: Any) -> list[tuple[str, list[int]]]:
    """Each leaf of a state's value (but its optimizers': their own) with its checksum."""
    return [(p, fingerprint(leaf, counters=False)) for p, leaf in _leaf_list(without_optimizers(value))]
