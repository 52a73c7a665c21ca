"""The trace's repeated calls: a call like its fragment's last recorded one is run and counted
where that one was, not recorded again, and a warm-up's identical trips run unrecorded.

A trace records each fragment call in full (its arguments' sources, specs and batch axes, its
outputs' origins) until the calls repeat. A call whose arguments come from where the last recorded
call's came from, with the same specs, is then only run and counted on that call's edges
(:meth:`Repeats._repeated`); once a warm-up's trips repeat (a replay buffer's 10k random steps), its
calls are not even compared (:meth:`Repeats._unrecorded_call`), their outputs' specs checked every
``QUICK_CHECK_EVERY`` calls; anything else ends that (:meth:`Repeats._record_again`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler import probes
from fragflow.compiler.axes import loop_rows
from fragflow.compiler.binding import bind
from fragflow.compiler.pytree import NotAnArray, is_static, leaf_paths, spec_of
from fragflow.compiler.recording import NodeRec, Recording
from fragflow.errors import FragflowError
from fragflow.runtime import kernels
from fragflow.source import user_callsite

# A quick warm-up (see Tracer.quick) starts after this many identical trips, each fragment in them
# called more often than that
QUICK_AFTER = 3
QUICK_CHECK_EVERY = 16   # ... and checks every this many calls of a fragment that its outputs keep their specs

_NOT_REPEATED = object()


class Repeats(Recording):
    """The tracer's handling of repeated calls (the attributes below are the tracer's)."""

    _cycle: tuple[Fragment, ...] | None
    _pos: int
    _trips: list[tuple[Fragment, ...]]
    _trip: list[Fragment]
    _unrecorded: Any
    _read_state: Callable[..., Any]
    _effects: Callable[[NodeRec, Fragment, int], None]
    _count_events: Callable[[Fragment, Any], None]
    _buffer_out: Callable[[NodeRec, Any], Any]
    _expected: set[int]
    state_use: Any
    begins_run: bool

    def _follow(self, frag: Fragment) -> None:
        """Follow the warm-up's trips; start running them unrecorded once they repeat (the call
        ``frag`` then begins the first of them)."""
        if frag.role != "env" or frag.evaluation:
            self._trip.append(frag)
            return
        trip, self._trip = tuple(self._trip), [frag]
        self._trips = [*self._trips[-(QUICK_AFTER - 1):], trip]
        if len(self._trips) < QUICK_AFTER or any(t != trip for t in self._trips) or not trip or trip[0] is not frag:
            return
        recs = [self._nodes.get(id(f)) for f in trip]
        if all(r is not None and r.repeat is not None and r.repeated and r.role not in ("learner", "logger") and
               not r.reads_captured and sum(r.calls) > QUICK_AFTER for r in recs):
            self._cycle = trip

    def _unrecorded_call(self, rec: NodeRec, frag: Fragment, bound: Any, window: int) -> Any:
        """A call of a repeating warm-up trip: run and counted as the last recorded one, not recorded."""
        given, out = self._run_counted(rec, frag, bound, window)
        return self._unrecorded_out(rec, frag, given, out, window)

    def _unrecorded_out(self, rec: NodeRec, frag: Fragment, given: dict[str, Any], out: Any, window: int) -> Any:
        self._unrecorded.append((rec, frag, given, out))
        if sum(rec.calls) % QUICK_CHECK_EVERY == 0:   # its outputs keep their specs (a change is recorded, or refused)
            leaves = self._output_leaves(rec, frag, out, None)
            if [(path, spec_of(leaf)) for _, path, leaf in leaves] != rec.out_specs:
                self._record_again()   # (its arguments' sources are known again: it is recorded as any call)
                return self._record_in_full(rec, frag, given, out, window)
        return out

    def _express(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a repeating warm-up trip (see Tracer.quick): what Tracer.call, Tracer._call and
        _unrecorded_call would do for it, in one frame (the warm-up's every call: a replay buffer's 10k
        steps of warm-up, three calls each). Before the first update the trace window is 0 and
        notes nothing of a call whose trip it has seen (see TraceWindow.call)."""
        rec = self._nodes[id(frag)]
        rep = rec.repeat
        assert rep is not None and self._cycle is not None
        expected = self._expected
        expected.discard(id(frag))
        self.window.unseen = bool(expected)
        rec.calls[0] += 1
        names = frag.__dict__.get("_ff_positional")
        if not kwargs and names is not None and len(names) == len(args):
            given = dict(zip(names, args))
            run_args, run_kwargs = args, kwargs
            for i, value in enumerate(args):
                if isinstance(value, (Versioned, VersionedView)):
                    if run_args is args:
                        run_args = list(args)   # type: ignore[assignment]
                    run_args[i] = self._read_state(rec, frag, names[i], value, 0, None)   # type: ignore[index]
        else:
            try:
                bound = bind(frag, args, kwargs)
            except TypeError:
                return frag.fn(*args, **kwargs)   # let Python report the bad call the usual way
            given = dict(bound.arguments)
            for pname, value in given.items():
                if isinstance(value, (Versioned, VersionedView)):
                    bound.arguments[pname] = self._read_state(rec, frag, pname, value, 0, None)
            run_args, run_kwargs = bound.args, bound.kwargs
        self._pos = (self._pos + 1) % len(self._cycle)
        for edge in rep.edges:
            edge.crossings[0] += 1
        self._effects(rec, frag, 0)
        use = self.state_use
        on, use.on = use.on, False   # (what a fragment does with the state's tensors is its own)
        sink = probes.swap_sink(None)
        try:
            with kernels.in_fragment:
                out = frag.fn(*run_args, **run_kwargs)
        except FragflowError:
            raise
        except Exception as exc:
            exc.add_note(f"(while fragflow traced fragment '{rec.name}' called at {user_callsite()})")
            raise
        finally:
            probes.swap_sink(sink)
            use.on = on
        self._count_events(frag, out)
        out = self._unrecorded_out(rec, frag, given, out, 0)
        if frag.role == "buffer" and frag.instance is not None and out is not None and not self.begins_run:
            return self._buffer_out(rec, out)
        return out

    def _run_counted(self, rec: NodeRec, frag: Fragment, bound: Any, window: int) -> tuple[dict[str, Any], Any]:
        """Run a call counted where its last recorded one was (its edges, its state reads and effects,
        its env events); returns its arguments as given (state handles, not their values) and its outputs."""
        rep = rec.repeat
        assert rep is not None
        given = dict(bound.arguments)
        for pname, value in given.items():
            if isinstance(value, (Versioned, VersionedView)):
                bound.arguments[pname] = self._read_state(rec, frag, pname, value, window, None)
        for edge in rep.edges:
            edge.crossings[window] += 1
        self._effects(rec, frag, window)
        out = self._traced(rec, frag, bound, None)
        self._count_events(frag, out)
        return given, out

    def _traced(self, rec: NodeRec, frag: Fragment, bound: Any, where: Any) -> Any:
        """The fragment run on its bound arguments; an error of the user's code carries the call's line
        (``where``, else the one on the stack as it is raised)."""
        try:
            with kernels.in_fragment:
                return frag.fn(*bound.args, **bound.kwargs)
        except FragflowError:
            raise
        except Exception as exc:
            exc.add_note(f"(while fragflow traced fragment '{rec.name}' called at {where or user_callsite()})")
            raise

    def _record_again(self) -> None:
        """Leave the unrecorded trips: the outputs of their last calls (what the loop may still hold)
        are known as their fragments', as a recorded call would have left them."""
        self._cycle, self._trips, self._trip = None, [], []
        for rec, frag, given, out in self._unrecorded:
            rep = rec.repeat
            if rep is None:
                continue
            self._input_ids = {id(leaf) for value in given.values()
                               if not isinstance(value, (Versioned, VersionedView)) and not is_static(value)
                               for _, leaf in _leaf_list(value)}
            leaves = self._output_leaves(rec, frag, out, None)
            if frag.axes is not None:
                self._know_outputs(rec, frag, out, leaves, frag.axes, frag.axes)
            else:
                self._know_outputs(rec, frag, out, leaves, rep.axes, rep.out_axes.get)
        self._unrecorded.clear()
        self._input_ids = set()

    def _repeated(self, rec: NodeRec, frag: Fragment, bound: inspect.BoundArguments, window: int) -> Any:
        """Run a call whose arguments come from the places its last recorded call's came from, with
        the same specs, and count it where that one was counted, without recording it again. Returns
        ``_NOT_REPEATED``, having run nothing, where an argument differs; where its outputs differ,
        it is recorded in full (a changed output is refused as any is)."""
        rep = rec.repeat
        assert rep is not None
        arguments = bound.arguments
        if len(arguments) != len(rep.params):
            return _NOT_REPEATED
        self._input_ids = set()
        for (pname, value), param in zip(arguments.items(), rep.params):
            if isinstance(value, (Versioned, VersionedView)):
                same = _state_param(pname, value) == param
            elif is_static(value):
                same = param == ("static", pname)
            else:
                try:
                    sources = self._sources(rec, pname, value, None, frag.in_axes)
                except FragflowError:
                    return _NOT_REPEATED   # refused by the full recording, at the user's line
                same = param[:2] == ("data", pname) and param[2] == tuple(
                    (path, spec_of(leaf), src, port, src_path, axis) for path, leaf, src, port, src_path, axis in sources)
            if not same:
                return _NOT_REPEATED
        given, out = self._run_counted(rec, frag, bound, window)
        rec.arity = len(out) if isinstance(out, tuple) else 0
        try:
            leaves = self._output_leaves(rec, frag, out, None)
        except FragflowError:
            leaves = self._output_leaves(rec, frag, out, user_callsite())   # raises again, with the user's line
        if [(path, spec_of(leaf)) for _, path, leaf in leaves] == rec.out_specs:
            if frag.axes is not None:   # declared (a buffer's may change as it learns its keys): asked again
                self._know_outputs(rec, frag, out, leaves, frag.axes, frag.axes)
            else:
                self._know_outputs(rec, frag, out, leaves, rep.axes, rep.out_axes.get)
            return out
        return self._record_in_full(rec, frag, given, out, window)

    def _record_in_full(self, rec: NodeRec, frag: Fragment, given: dict[str, Any], out: Any, window: int) -> Any:
        """A call run as its last recorded one whose outputs changed: recorded in full, as the first
        call of a new kind (a changed output is refused as any is; the actor acting on an evaluation
        env of another size is not)."""
        rep = rec.repeat
        assert rep is not None
        for edge in rep.edges:
            edge.crossings[window] -= 1
        rec.repeat = None
        rec.repeated = False
        where = user_callsite()
        self._input_ids, self._input_backends, self._inputs, self._loop_made = set(), set(), [], []
        self._input_srcs = []
        for pname, value in given.items():
            if not isinstance(value, (Versioned, VersionedView)) and not is_static(value):
                self._record_inputs(rec, pname, value, window, where, frag.in_axes, [])
        if self._loop_made and frag.in_axes is None:
            loop_rows(self._inputs, self._loop_made, self._per_env())
        self._record_outputs(rec, frag, out, where, [])
        return out


def _state_param(pname: str, value: Versioned | VersionedView) -> tuple[str, str, str, tuple[Any, ...]]:
    handle = value if isinstance(value, Versioned) else value.handle   # (a view's keys: its path, unformatted)
    return ("state", pname, handle.name, () if isinstance(value, Versioned) else value.path)


def _leaf_list(tree: Any) -> list[tuple[str, Any]]:
    try:
        return leaf_paths(tree)
    except NotAnArray:
        return []
