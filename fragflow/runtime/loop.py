"""The loop interpreter: the user's training loop as the program of a loop group.

Every fragment call is served from the dispatch table lowering built (:class:`LoopProgram`):

- **here**: the fragment is called in this process; reads of versioned state written elsewhere
  resolve to the broadcast version this replica acts with (chosen by the channel's version
  discipline at the first read after each update);
- **remote**: the call's loop-side leaves go onto the fragment's ring, stamped with that version
  and numbered in this replica's call order; the loop gets the state handle back (a write) and
  ``Pending`` references for the outputs, which other fragments of that group may take.

Under ``single_process`` every fragment is served here and versioned state is the value itself:
the serial semantics every other placement is checked against.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, Protocol

import cloudpickle
import numpy as np

from fragflow.api import random as ff_random
from fragflow.api.events import EventSources
from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Pending, Versioned, VersionedView, pendings_in
from fragflow.compiler.loops import defined_in_loop, loop_around
from fragflow.compiler.pytree import (
    NotAnArray,
    fill_skeleton,
    from_keys,
    leaf_paths,
    ordered_like,
    private,
    structure,
    to_numpy,
    unflatten_into,
)
from fragflow.compiler.reach import Reached, handles_as_values
from fragflow.context import InstanceNames
from fragflow.errors import (
    ConfigError,
    FragflowError,
    PlacementError,
    UntracedFragmentError,
    VersionedStateError,
)
from fragflow.lowering import LoopProgram
from fragflow.lowering.disciplines import Exact
from fragflow.lowering.program import called_again
from fragflow.runtime import calls, heap, kernels, received
from fragflow.runtime.looplogs import LoopLogs
from fragflow.runtime.remotechecks import RemoteChecks
from fragflow.source import SourceLoc, user_callsite


class Reporter(Protocol):
    """Where a loop's events go: the monitor (one process) or the driver's queue (a worker)."""

    log_seq: int   # the loop's number of the ff.log call being reported

    def env_step(self, n: int, episodes: list[tuple[float, int]], evaluation: bool) -> None: ...
    def loop_begins(self) -> None: ...
    def update(self) -> None: ...
    def log(self, scalars: dict[str, float], update: int | None = None, steps: int = 0,
            new_row: bool = False) -> None: ...
    def flush(self) -> None: ...
    def mark(self, update: int, call: int = -1) -> None: ...
    def logged(self, requests: list[tuple[str, int, int, str, str, int]], steps: int = 0,
               new_row: bool = False) -> None: ...


# The stamp of a call that depends on no version of any state (the loop reads none and no inference
# answers it: a random or fixed behaviour policy): never stale, whatever the learner's version.
UNVERSIONED = -1
_ASK = object()
_HANDLES = frozenset({Versioned, VersionedView})   # (neither has subclasses: a type's lookup is the fast test)


def allow_nonfinite() -> bool:
    return os.environ.get("FRAGFLOW_ALLOW_NONFINITE", "") not in ("", "0")


RUN_SIZED_FIX = ("size per-environment arrays with env.num_envs, or make them from env.ids "
                 "(ff.random.keys(seed, env.ids)); or run with one acting process")


def _about_shapes(exc: BaseException) -> bool:
    """Whether an error may come of an array's size (numpy's, torch's and JAX's shape errors: JAX's
    are TypeErrors), which the note on arrays sized with the run's count of environments explains; a
    user's own error is not."""
    if isinstance(exc, IndexError):
        return True
    text = str(exc).lower()   # (a ValueError of the user's own, "boom", is not: probe helper)
    return any(w in text for w in ("size", "shape", "dimension", "broadcast", "axis", "length", "mismatch"))


class LoopInterpreter(RemoteChecks, LoopLogs):
    """Executes the loop's fragment calls as the placement says (see :mod:`fragflow.context`)."""

    def __init__(self, program: LoopProgram, reporter: Reporter, *, replica: int = 0, endpoints: Any = None,
                 checks: dict[str, Any] | None = None) -> None:
        self.program = program
        self.reporter = reporter
        self.index = replica
        self.endpoints = endpoints
        self.checks = checks or {}
        self._captured: frozenset[str] = self.checks.get("captured", frozenset())   # read state through a global
        self.instance_name = InstanceNames()
        self._names = InstanceNames()
        self._state_names = InstanceNames()
        self._node_of: dict[int, tuple[Fragment, str, bool]] = {}
        self._events_of: dict[int, Any] = {}   # a plain fragment's events function, once asked (see _plain)
        self.events = EventSources()
        self.resources: list[Any] = []
        self.current: str | None = None   # the fragment being called (None: the loop's own code runs)
        self.update = 0                       # remote clock calls made (this replica's updates)
        self._clock_due = True                # the loop's first env call is to come (Reporter.loop_begins)
        self._stepped = True                  # an environment stepped since the last clock call
        self._learned_at: dict[str, int] = {}   # the env steps made when each learner placed apart was last called
        self._log_stepped = False             # ... since the last clock call or ff.log (a row of its own)
        self.rollout_version: int | None = None
        self._last_version = 0
        self._clock_stamp: int | None = None    # the version the clock's last call was stamped with
        self._ticket = 0
        self._views: dict[str, tuple[tuple[int, int | None], list[Any]]] = {}
        # the torch leaves of each received view, with their version counters then (see received.check_unchanged)
        self._watched: dict[str, list[tuple[str, Any, int]]] = {}
        # its random generators, with their states then: a draw changes the state as an in-place op does
        self._drawn: dict[str, list[tuple[str, Any, bytes]]] = {}
        self._modules: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}   # a received module's tensors (see received.received)
        # writes of each state this replica has issued, and how many there were when each version
        # ended (a version is the state after a clock call and every write before the next one)
        self._writes: dict[str, int] = {}
        self._final: dict[tuple[str, int], int] = {}
        # since the last clock call: each acted-with state's last write by another learner (that
        # learner, and whether this loop acted with the state after it; see _unclocked_write)
        self._unclocked: dict[str, list[Any]] = {}
        self._states: dict[str, Versioned] = {}
        self._shapes: dict[str, Any] = {}   # each state's structure (a learner's new state keeps it)
        self._seq = 0
        self.cut = 0   # the mark of the last checkpoint this replica saved its part of (calls.cut_mark)
        # outputs given back to the fragment that made them, held where it runs, and that fragment's role
        # (see snapshot.loop_locals)
        self.recurrent: dict[tuple[Any, ...], str] = {}
        self.trip = -1   # the trip of the top-level loop under way (set by the worker's trip tracker)
        self._shipped: set[str] = set()
        # module data each fragment served elsewhere reaches, as it was when the fragment was sent there
        self._reached: dict[str, Reached] = {}
        self._every = calls.check_every()
        self._finite = not allow_nonfinite()   # (read once, as _every: a learner's writes are checked at each update)
        self._eval_obs: tuple[int, Any] | None = None   # (id, array) of the evaluation env's latest observations
        self._late_obs: tuple[int, Any, str] | None = None   # ... of an env first stepped after the trace (and its name)
        self._acted_on_training: set[str] = set()   # served actors called on the training envs' observations
        self._skeletons: dict[tuple[str, Any], int] = {}
        self._calls_of: dict[str, int] = {}   # remote fragment -> its last call's number
        self._rings = {} if endpoints is None else {r: endpoints.rings[f"{r}[{replica}]"] for r in program.remote}
        self._replies = {} if endpoints is None else {r: endpoints.rings[f"{r}.reply[{replica}]"]
                                                      for r, route in program.remote.items() if route.sync}
        self._defs = {} if endpoints is None else {g: endpoints.definitions(program.service_for(g, replica)) for g in
                                                   {r.group for r in program.remote.values()}}
        self.restored: Any = None             # a checkpoint's states part: versioned state starts from it
        self.warn: Callable[[str], None] | None = None   # the run's warnings (the monitor's, or the driver's by message)
        self.changed_args: list[Any] = []     # a resumed run's --set values (see versioned)
        # (resumed) what the acting side read of each state at the versions before the saved one, by the
        # version they are in this run (-1, -2, ...): an exact version choice acts with them at first
        self.acting_before: dict[str, dict[int, list[Any]]] = {}
        self.restarted = False                # a replica started again after its process died
        self.skip_until = 0                   # (restarted) calls its dead process already sent: not sent again
        self.logs = 0                         # ff.log calls made (replica 0 reports them)
        self.skip_logs = 0                    # (restarted) those its dead process had reported: not again
        self.on_update: Callable[[int], None] | None = None   # after each clock call (checkpoint schedule)

    # -- interpreter protocol ------------------------------------------------------------
    def env_ids(self, num_envs: int) -> np.ndarray:
        n = self.program.replicas
        if num_envs % n:
            raise ConfigError(f"cannot split {num_envs} environments across {n} actors", where=user_callsite(),
                              fix=f"use a number of environments divisible by {n} (each actor steps its share); "
                                  "an environment that evaluates: make it with ff.envs.make(..., evaluation=True) "
                                  "(every actor steps it whole, its episodes reported apart from training's); or "
                                  "another actors=")
        per = num_envs // n
        return np.arange(self.index * per, (self.index + 1) * per)

    def replica(self) -> tuple[int, int]:
        return self.index, self.program.replicas

    def read_state(self, x: Versioned | VersionedView, what: str | None) -> tuple[bool, Any]:
        """The loop reads versioned state: its value where this process runs every fragment (as
        eagerly), else refused (the state is written in another process)."""
        if self.program.remote:
            handle = x if isinstance(x, Versioned) else x.handle
            if self._writes.get(handle.name, 0) or self.update:
                return False, None
            # before any learner call, the value this process made is every process's (a target
            # network's copy, a parameter count): read as eagerly
            value = self._states.get(handle.name, handle).value
            for k in () if isinstance(x, Versioned) else x.path:
                value = value[k]
            return True, value
        return True, self._resolve(x)

    def adopt(self, resource: Any) -> None:
        self.resources.append(resource)

    def close(self) -> None:
        for r in self.resources:
            r.close()
        self.resources.clear()

    def versioned(self, value: Any, name: str, where: SourceLoc | None) -> Versioned:
        name = self._state_names(name)
        version = 0
        if self.restored is not None:
            from fragflow.runtime import encoding
            from fragflow.runtime.snapshot import restore_state

            encoding.overridden.clear()
            value, version = restore_state(self.restored, name, value, where)
            # (a value the resumed run's --set gave, which the saved optimizer state sets back)
            set_back = [what for what, built in encoding.overridden if built in self.changed_args]
            if set_back and self.index == 0 and self.warn is not None:
                self.warn(f"state '{name}' was resumed with the optimizer state its checkpoint saved, which sets back "
                          f"what the program built with the --set values ({'; '.join(set_back[:4])}): the run goes on "
                          "with the saved values, as torch's load_state_dict sets them (a --set of the rate changes "
                          "nothing there); to change them, set them in the learner (optimizer.param_groups[0]['lr'] "
                          "= ...) or with a scheduler")
        handle = Versioned(name, version, value, where)
        self._states[handle.name] = handle
        self._shapes[handle.name] = structure(value)
        if self.index == 0:   # (restarted too: its first process may have died before it sent it; a service keeps the first)
            from fragflow.runtime.snapshot import global_random

            blob = cloudpickle.dumps(value)
            # the process's random states as the state is made (after the program's torch.manual_seed):
            # a learner that draws from them (torch.randperm, dropout) draws the same numbers every run
            rng = global_random()
            # the group that publishes (first in the list) last: a replicated learner's other processes
            # then hold the state before any actor, waiting for its first broadcast, can feed them
            for group in reversed(self.program.ship.get(handle.name, ())):
                self.endpoints.definitions(group).put(("state", handle.name, blob, rng))
        return handle

    # -- dispatch --------------------------------------------------------------------------
    def _node(self, frag: Fragment) -> str:
        hit = self._node_of.get(id(frag))
        if hit is None:
            hit = self._node_of[id(frag)] = self._entry(frag, self._names(frag.name))
        return hit[1]

    def name_nodes(self, named: dict[int, tuple[Fragment, str]]) -> None:
        """The fragments' node names as a trace named them (the run it began goes on from it)."""
        self._node_of = {key: self._entry(frag, name) for key, (frag, name) in named.items()}

    def _entry(self, frag: Fragment, name: str) -> tuple[Fragment, str, bool]:
        program = self.program
        # only run here, as called (see _plain): not a learner, a logger or an evaluation env, not
        # placed elsewhere, reading no state through a global
        plain = frag.role in ("actor", "env", "buffer") and frag.writes is None and not frag.evaluation and \
            name not in program.remote and name not in self._captured and \
            (not program.remote or name in program.local)
        return frag, name, plain

    def call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hit = self._node_of.get(id(frag))
        name = hit[1] if hit is not None else self._node(frag)
        outer, self.current = self.current, name
        if hit is not None and hit[2] and not self._clock_due:
            out = self._plain(frag, name, args, kwargs)
        else:
            out = self._dispatch(frag, name, args, kwargs)
        self.current = outer   # (an exception leaves it: the fragment that raised)
        return out

    def _dispatch(self, frag: Fragment, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if frag.role == "logger":
            return self._log(args[0] if args else kwargs)
        route = self.program.remote.get(name)
        if route is not None:
            return self._remote(frag, name, route, args, kwargs)
        # an evaluation env first stepped after the trace (every N updates, after the loop) is stepped
        # whole by every acting process, where the loop runs: here; so is an actor first called then
        # (a final evaluation's act_eval), with the version the loop acts with; and, where one process
        # runs the loop, an env or buffer the trace never saw called (an env evaluating every N
        # updates, made without evaluation=True; one a later phase of training makes), as eagerly
        made_later = frag.instance is not None and frag.role in ("env", "buffer")
        if made_later and self.program.replicas == 1:
            out = self._local(frag, name, args, kwargs)
            if frag.role == "env" and any(r.sync for r in self.program.remote.values()):
                first = out[0] if isinstance(out, tuple) and out else out   # (to know them if a served actor gets them)
                self._late_obs = (id(first), first, name)
            return out
        if self.program.remote and name not in self.program.local and not frag.evaluation and \
                (made_later or frag.role not in ("actor", "env") or not self._broadcast_here(args, kwargs)):
            loop = loop_around(frag.defined_at, self.checks.get("loops", ()))
            if frag.instance is None and frag.defined_at is not None and loop is not None:
                raise UntracedFragmentError(
                    f"{defined_in_loop(frag.role, name, frag.defined_at, loop)}, and this one was first called after "
                    "tracing ended, so the placement has no process for it", where=frag.defined_at,
                    fix=f"define it once, before the loop (at the top of the module, or above `{loop.header}`), and "
                        "call it in the loop; or run with --policy single_process")
            n = self.program.replicas
            raise UntracedFragmentError(
                f"{frag.role} fragment '{name}' was first called after tracing ended, so the placement has no "
                "process for it" + (f" among the policy's {n} acting processes (the placement splits the "
                                    "environments and buffers the trace saw used among them)" if made_later else ""),
                where=user_callsite(),
                fix=("an environment that evaluates: make it with ff.envs.make(..., evaluation=True) (every acting "
                     "process steps it whole, its episodes reported apart from training's); else call it within "
                     "the first learner updates, which the trace runs through (make every environment and buffer "
                     "once, before the training loop, and use them from its first trips), or run with "
                     + ("a policy that acts where the envs step (actor_learner, pipelined) or --policy single_process"
                        if any(r.sync for r in self.program.remote.values()) else
                        f"{self.program.one_process} (the placement's option) or --policy single_process"))
                if made_later else
                "make sure the loop calls it within its first learner updates (the tracer runs until every "
                "fragment of the training module has been called, for up to 200 updates: call it within "
                "them, e.g. at update 0 and every N after; an actor first called later runs where the loop "
                "runs only with state this process receives: the views the traced actors read), or run with "
                "--policy single_process")
        return self._local(frag, name, args, kwargs)

    def _broadcast_here(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether every state an untraced fragment is given reaches this loop by broadcast, in a
        part this loop receives (else it would act with the state as the process started)."""
        for x in (*args, *kwargs.values()):
            if isinstance(x, (Versioned, VersionedView)):
                handle = x if isinstance(x, Versioned) else x.handle
                path = () if isinstance(x, Versioned) else x.path
                b = self.program.reads.get(handle.name) if self.endpoints is not None else None
                if b is None or not any(path[:len(root)] == root for root in b.paths):
                    return False
        return True

    # -- here ------------------------------------------------------------------------------
    def _local(self, frag: Fragment, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._clock_due and frag.role == "env" and not frag.evaluation:
            self._clock_due = False
            self.reporter.loop_begins()
        written: Versioned | None = None
        if frag.writes is not None:
            handle = frag.written(args, kwargs)
            if not isinstance(handle, Versioned):
                raise VersionedStateError(
                    f"learner '{name}' writes '{frag.writes}', but that argument is not versioned state",
                    where=user_callsite(), fix=f"create it with ff.versioned(...) and pass it as '{frag.writes}'")
            written = handle
            if handle.name not in self._shapes:   # (a state the trace made, which this run goes on from)
                self._shapes[handle.name] = structure(self._states.get(handle.name, handle).value)
        args, kwargs, reads = self._resolved(args, kwargs)
        try:
            if name in self._captured:   # single_process only: as eagerly, the global holds the value
                with handles_as_values(frag.fn), kernels.in_fragment:
                    out = frag.fn(*args, **kwargs)
            else:
                with kernels.in_fragment:
                    out = frag.fn(*args, **kwargs)
        except Exception as exc:
            self._failed(exc, frag, name, args, kwargs, reads)
            raise
        if reads and self._watched and frag.role != "learner":
            for state in self._watched:
                received.check_unchanged(self._watched, self._drawn, state, name)
        if frag.evaluation and frag.role == "env":   # its observations, to know them if a served actor gets them
            first = out[0] if isinstance(out, tuple) and out else out
            self._eval_obs = (id(first), first)
        events = self.events.of(frag)
        if events is not None:
            n, finished = events(out)
            self.reporter.env_step(n, finished, frag.evaluation)
            if not frag.evaluation and n:   # (a reset steps nothing: the update's row goes on, as eagerly)
                self._stepped = self._log_stepped = True
        if written is not None:
            new_value = ordered_like(self._states.get(written.name, written).value,
                                     out[0] if isinstance(out, tuple) else out)
            self._check_write(name, written.name, new_value)
            new = Versioned(written.name, written.version + 1, new_value, written.created_at)
            latest = self._states.get(new.name)
            if latest is None or written.version >= latest.version:
                self._states[new.name] = new
            # else a learner called on a version the loop kept (`_, m = learn(first, x)`): eagerly the
            # value it returns is that call's alone, never the state's newest
            if name == self.checks.get("clock"):
                self.update += 1
                if self.update == 1:
                    heap.settle()
                self.reporter.update()
                if self.on_update is not None:
                    self.on_update(self.update)
            return (new, *out[1:]) if isinstance(out, tuple) else new
        if frag.role == "learner" and name == self.checks.get("clock"):
            self.reporter.update()
            if self.on_update is not None:
                self.on_update(self.update)
        return out

    def _plain(self, frag: Fragment, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What :meth:`_local` does for a call that runs here and is only run (an actor, an env step, a
        buffer's: not a learner, a logger, an evaluation env, a fragment reading a global's state; see
        :meth:`call`), without the tests that are false for it: most of a loop's calls."""
        args, kwargs, reads = self._resolved(args, kwargs)
        if self._eval_obs is not None and frag.role == "actor" and self.program.replicas > 1:
            self._training_keys_on_evaluation(name, args, kwargs)
        try:
            with kernels.in_fragment:
                out = frag.fn(*args, **kwargs)
        except Exception as exc:
            self._failed(exc, frag, name, args, kwargs, reads)
            raise
        if reads and self._watched:
            for state in self._watched:
                received.check_unchanged(self._watched, self._drawn, state, name)
        events = self._events_of.get(id(frag), _ASK)
        if events is _ASK:
            events = self.events.of(frag)
            if self.events.steady(frag):   # (a reset's is asked at each call: it ends the episodes under way)
                self._events_of[id(frag)] = events
        if events is not None:
            n, finished = events(out)
            self.reporter.env_step(n, finished, False)
            if n:
                self._stepped = self._log_stepped = True
        return out

    def _training_keys_on_evaluation(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse an actor given the evaluation env's observations with the training environments'
        keys: every acting process steps the evaluation env whole, and holds keys for its share of
        the training environments only, so its keys no longer match the evaluation env's rows (fewer
        broadcast over them silently: its evaluation acted with other numbers than single_process's)."""
        assert self._eval_obs is not None
        values = (*args, *kwargs.values())
        if not any(id(v) == self._eval_obs[0] for v in values):
            return
        obs = self._eval_obs[1]
        first = next(iter(obs.values())) if isinstance(obs, dict) and obs else obs
        rows = first.shape[0] if getattr(first, "ndim", 0) else None
        for v in values:
            if rows is not None and ff_random.is_key(v) and v.ndim and v.shape[0] != rows:
                raise ConfigError(
                    f"actor '{name}' is given the evaluation env's observations ({rows} rows: every acting process "
                    f"steps it whole) with keys of {v.shape[0]} row{'s' * (v.shape[0] != 1)}, this process's share of the training "
                    f"environments' keys (its {self.program.replicas} acting processes split those): they no longer "
                    "match the evaluation env's environments, and fewer keys would broadcast over them, acting with "
                    "other numbers than single_process's", where=user_callsite(),
                    fix="give the evaluation env keys of its own, from its ids: `ekey = ff.random.keys(seed, ev.ids)` "
                        "before the loop, then `ekey, esub = ff.random.split(ekey)` for each of its steps; or run "
                        "one acting process (actors=1, or --policy single_process)")

    def _resolved(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
        """The arguments with the versioned state among them read (the version this loop acts with),
        and whether there was any."""
        reads = False
        for a in args:
            if type(a) in _HANDLES:
                args, reads = tuple([self._resolve(a) if type(a) in _HANDLES else a for a in args]), True
                break
        if kwargs:
            for v in kwargs.values():
                if type(v) in _HANDLES:
                    kwargs, reads = {k: self._resolve(v) if type(v) in _HANDLES else v for k, v in kwargs.items()}, True
                    break
        return args, kwargs, reads

    def _failed(self, exc: Exception, frag: Fragment, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                reads: bool) -> None:
        """A fragment run here raised ``exc``: say what it tells of the likely cause (the caller raises it)."""
        if isinstance(exc, FragflowError):
            # fragflow's own refusal of a size (env.step given an action per environment of the run,
            # made with the loop's exploration noise sized with args.num_envs) says the likely cause
            found = self._run_sized(frag, name, args, kwargs) if _about_shapes(exc) else None
            if found and exc.fix != RUN_SIZED_FIX:   # (said once, where a call within a call failed)
                exc.restate(what=f"{exc.what}: argument {found[0]} has a row for every environment of the run, made "
                                 f"in the loop (sized with the run's count, as args.num_envs, or made from such an "
                                 f"array), where this process steps {found[2]} of them", fix=RUN_SIZED_FIX)
            return
        if reads and self._watched and isinstance(exc, ValueError) and "read-only" in str(exc):
            # (which array it was, the error does not say: the state's are read-only here, see _received)
            exc.add_note("(fragflow: in an acting process where this policy runs the learner apart, the numpy "
                         "arrays of the versioned state are read-only: if the array written is one of them, "
                         "leave it unchanged (work on a copy: array.copy()) or make the change in a learner that "
                         "writes the state; a change here would stay in this process's copy, unseen by the "
                         "learner; or run with --policy single_process)")
        exc.add_note(f"(while executing fragment '{name}' called at {user_callsite()})")
        found = self._run_sized(frag, name, args, kwargs) if _about_shapes(exc) else None
        if found:
            exc.add_note(f"(fragflow: argument {found[0]} of '{name}' has {found[1]} rows, one per environment of "
                         f"the run, but this process steps {found[2]} of them: {RUN_SIZED_FIX})")

    def _run_sized(self, frag: Fragment, name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[str, int, int] | None:
        """Where a fragment run here failed: the argument the loop made with a row for every
        environment of the run (sized with ``args.num_envs``) where this process steps its share of
        them (``env.num_envs``), the usual cause of a shape error in a split run, with its rows and
        the share. Not cut to the share: an array of that many rows may be a constant of the
        program's own."""
        rows = {path: (axis, per) for path, axis, per in self.program.rows.get(name, ())}
        if not rows:
            return None
        try:
            bound = frag.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None
        for pname, value in bound.items():
            try:
                leaves = leaf_paths(value, pname)
            except NotAnArray:
                continue
            for path, leaf in leaves:
                axis, per = rows.get(path, (0, 0))
                shape = getattr(leaf, "shape", ())
                if per and len(shape) > axis and shape[axis] == per * self.program.replicas:
                    return path, shape[axis], per
        return None

    def _check_write(self, fragment: str, state: str, value: Any) -> None:
        traced = self.checks.get("state", {}).get((fragment, state))
        calls.check_write(value, traced, fragment, state, self.update + 1, user_callsite, self._finite,
                          self._shapes.get(state), self._every)

    def _version(self) -> int:
        """The parameter version of the current rollout, chosen at its first read."""
        if self.rollout_version is None:
            choice = self.program.choice
            if choice is None or self.endpoints is None:
                return self.update
            params = self.endpoints.broadcasts[next(iter(self.program.reads))]
            self.rollout_version = choice.choose(self.update, params, self.endpoints.admission, self.index)
            if getattr(choice, "admits", False):
                self._ticket = self.endpoints.admission.last_ticket
            self._last_version = self.rollout_version
            if self.acting_before and isinstance(choice, Exact) and self.update < choice.max_lag:
                # a resumed run's first trips act with the versions before the checkpoint's, as the
                # uninterrupted run did (the oldest saved: the run's first, which its first trips all took)
                saved = next(iter(self.acting_before.values()))
                if saved:
                    self.rollout_version = max(self.update - choice.max_lag, min(saved))
        return self.rollout_version

    def _resolve(self, x: Any) -> Any:
        if not isinstance(x, (Versioned, VersionedView)):
            return x
        handle, path = (x, ()) if type(x) is Versioned else (x.handle, x.path)
        local = self._states.get(handle.name, handle)
        b = self.program.reads.get(handle.name) if self.endpoints is not None else None
        if b is None:
            # as eagerly: a version the loop kept after a learner wrote a newer one is that version
            # (`_, metrics = learn(state, batch)` leaves `state` as it was)
            value = (handle if handle.version < local.version else local).value
            for k in path:
                value = value[k]
            return value
        v = self._version()
        key = (v, self._stamp(handle.name, v) if v >= 0 else None)
        if self._unclocked:
            unclocked = self._unclocked.get(handle.name)
            if unclocked is not None:
                unclocked[1] = True   # (acted with after another learner's write: see _unclocked_write)
        cached = self._views.get(handle.name)
        if cached is None or cached[0] != key:
            received.check_unchanged(self._watched, self._drawn, handle.name, None)   # (changed since this process's last fragment call: the loop)
            def fill(leaves: list[Any], plain: Any = None) -> list[Any]:
                trees, pos = [], 0
                for root, n in zip(b.paths, b.counts):
                    template = local.value
                    for k in root:
                        template = template[k]
                    trees.append(unflatten_into(template, leaves[pos:pos + n], optimizers=False, plain=plain))
                    pos += n
                return trees

            with received.counted():
                broadcast = self.endpoints.broadcasts[handle.name]
                if v < 0:   # (resumed: a version before the checkpoint's, saved with it)
                    trees = fill(self.acting_before[handle.name][v])
                elif hasattr(broadcast, "read_into"):
                    # the slot's views copied straight into the modules' tensors (one copy, not two);
                    # a leaf kept as it is (a tensor beside the modules) gets its own copy
                    trees = broadcast.read_into(v, key[1], lambda leaves: fill(leaves, private))
                else:
                    trees = fill(broadcast.read(v, key[1])[1])
            cached = self._views[handle.name] = (key, trees)
            self._watched[handle.name], self._drawn[handle.name] = received.received(b.paths, trees, self._modules)
        for root, tree in zip(b.paths, cached[1]):
            if path[:len(root)] == root:
                for k in path[len(root):]:
                    tree = tree[k]
                return tree
        raise ConfigError(f"the loop read {handle.name}{''.join(f'[{k!r}]' for k in path)}, which was not traced",
                          where=user_callsite(), fix="read the same state views on every call")

    def _own_rows(self, leaves: list[Any], whole: tuple[tuple[int, int, int], ...]) -> list[Any]:
        """A leaf the loop made with as many rows as there are environments in all (while tracing,
        one process stepped them all) is batched along them; where this replica holds it whole, not
        its share (a constant of that size: a mask over as many actions), its rows are its part. Each
        such leaf's fingerprint follows the leaves (0 where this replica held its share already): the
        service refuses a whole value that differs between the replicas, whose parts would not join."""
        out = list(leaves)
        marks = []
        for i, axis, per in whole:
            shape = getattr(out[i], "shape", None)
            mark = 0
            if shape is not None and len(shape) > axis and shape[axis] == per * self.program.replicas:
                arr = np.ascontiguousarray(to_numpy(out[i]))
                digest = hashlib.blake2b(arr.tobytes() + str(arr.dtype).encode(), digest_size=7).digest()
                mark = 1 + int.from_bytes(digest, "little")
                out[i] = out[i][(slice(None),) * axis + (slice(self.index * per, (self.index + 1) * per),)]
            marks.append(mark)
        return out + marks

    def _stamp(self, state: str, version: int) -> int | None:
        """Under an exact version choice, the writes ``version`` of ``state`` must include: all
        those issued before the next clock call (a second learner writing the state after the
        clock, SAC's actor step, belongs to the same version). Relaxed choices take any."""
        if not isinstance(self.program.choice, Exact):
            return None
        if version >= self.update:
            return self._writes.get(state, 0)
        return self._final[(state, version)]

    # -- remote ----------------------------------------------------------------------------
    def _remote(self, frag: Fragment, name: str, route: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = frag.signature.bind(*args, **kwargs)
        handle = None
        if route.writes is not None:
            handle = bound.arguments.get(frag.writes) if frag.writes else None
            if not isinstance(handle, Versioned):
                raise VersionedStateError(
                    f"learner '{name}' writes '{frag.writes}', but that argument is not versioned state",
                    where=user_callsite(), fix=f"create it with ff.versioned(...) and pass it as '{frag.writes}'")
        skeleton, leaves, gifts = calls.split_arguments(bound.arguments, route.given, self._lag_of)
        for p in pendings_in(bound.arguments):
            if p.fragment == name and 0 <= p.trip < self.trip:   # (made in an earlier trip: carried across trips)
                self.recurrent[(p.fragment, p.index, p.path_keys)] = frag.role
        group = self._defs[route.group]
        reached = self._reached.get(name)
        if reached is not None:
            self._check_reached(frag, name, reached)
        if name not in self._shipped:
            labels = self.checks.get("reaches", {}).get(name)
            if labels:   # (sent as it is now: the loop changing it later is refused at the next call)
                self._reached[name] = Reached(frag.fn, labels)
            group.put(("fragment", name, cloudpickle.dumps(frag)))
            self._shipped.add(name)
        key: Any = (name, skeleton)
        try:
            sid = self._skeletons.get(key)
        except TypeError:   # a static argument that does not hash (an Args with a list field): by its text
            key = (name, repr(skeleton))
            sid = self._skeletons.get(key)
        if sid is None:   # (a state made after the trace is a new skeleton: its name is new)
            self._refuse_untraced_state(name, route, bound.arguments)
            sid = self._skeletons[key] = len(self._skeletons)
            # cloudpickled: its static arguments (an Args dataclass of the user's file) go by value; the
            # queue's own pickling names their module, which a worker started from a fork server lacks
            group.put(("skeleton", self.index, sid, cloudpickle.dumps(skeleton)))
        ring = self._rings[name]
        on_eval = self._eval_obs is not None and frag.role == "actor" and \
            any(id(v) == self._eval_obs[0] for v in bound.arguments.values())
        if frag.role == "actor" and not on_eval:
            self._acted_on_training.add(name)
        # (an act_eval traced on the evaluation env is served; so, with one env worker, is the training
        # actor on an evaluation env whose observations fit its requests: the placement refuses a traced
        # one that does not)
        misfit = self._eval_misfit(leaves, ring.layout.specs) if on_eval and name in self._acted_on_training else ""
        if misfit:
            several = self.program.replicas > 1
            raise PlacementError(
                f"actor fragment '{name}' is called on the evaluation env's observations, first after the trace, "
                f"but this policy answers it in the learner's process {misfit}", where=user_callsite(),
                fix=f"give the evaluation its own fragment ({name}_eval = ff.fragment('actor', name='{name}_eval')"
                    f"({name}.fn)) and call that on the evaluation env" + (" with env_workers=1" if several else "") +
                    ", or run with a policy that acts where the envs step (actor_learner, pipelined, single_process)")
        late = self._late_obs
        if late is not None and frag.role == "actor" and any(id(v) == late[0] for v in bound.arguments.values()):
            misfit = self._eval_misfit(leaves, ring.layout.specs, late[1], "the env's")
            if misfit:
                env = late[2].rsplit(".", 1)[0]
                raise PlacementError(
                    f"actor fragment '{name}' is called on the observations of '{env}', an env first stepped after "
                    f"the trace, but this policy answers it in the learner's process {misfit}", where=user_callsite(),
                    fix=f"if '{env}' evaluates, make it with ff.envs.make(..., evaluation=True) and give its calls an "
                        f"actor fragment of their own ({name}_eval = ff.fragment('actor', name='{name}_eval')({name}.fn)); "
                        "else step it within the first learner updates, which the trace runs through; or run with "
                        "a policy that acts where the envs step (actor_learner, pipelined, single_process)")
        if route.whole:
            leaves = self._own_rows(leaves, route.whole)
        calls.check_leaves(leaves, ring.layout.specs, name, None, self.program.replicas,
                           None if route.whole else skeleton, self.program.one_process)
        if self.program.reads and not route.primary and frag.role == "learner" and not self._stepped \
                and self._clock_stamp is not None:
            # a learner of its own on the rollout the clock just took: that rollout's version (a new
            # rollout's, chosen now, would be newer than what its data was acted with)
            version = self._clock_stamp
        elif self.program.reads:
            version = max(0, self._version())   # (a version before a resumed run's first is stamped as its first)
        else:   # served acting stamps its answers' version; acting on no state depends on none
            version = self._last_version if self._replies else UNVERSIONED
        if route.primary:
            self._clock_stamp = version
        call = self._calls_of[name] = self._calls_of.get(name, -1) + 1
        if self._seq >= self.skip_until:
            if gifts:   # (the service waits for them before it runs the call)
                group.put(("given", self.index, name, call, cloudpickle.dumps(gifts)))
            # another learner step on the rollout the clock last took (the clock's again, or a learner of its
            # own after it on the same rollout: the clock's updates since are not its data's staleness)
            again = (route.primary or frag.role == "learner") and not self._stepped
            steps = int(getattr(self.reporter, "total_steps", 0))
            if again and route.gathered and steps and self._learned_at.get(name) == steps:   # (no env at all: see calls)
                raise called_again(name, "several learner steps on one rollout, first after the trace, which saw one "
                                         "call a trip", route.gathered, user_callsite())
            self._learned_at[name] = steps
            ring.put(leaves, version, tag=self._seq, aux=calls.pack_aux(sid, call, self.cut, again), order=self._ticket,
                     steps=steps)
        self._seq += 1
        if handle is not None and not route.primary and handle.name in self.program.reads:
            self._unclocked_write(name, handle.name)
        if route.primary:
            self._unclocked.clear()
            for state in self.program.reads:
                self._final[(state, self.update)] = self._writes.get(state, 0)
                self._final.pop((state, self.update - self.program.max_lag - 3), None)
        if handle is not None:
            self._writes[handle.name] = self._writes.get(handle.name, 0) + 1
        if route.primary:
            self._stepped = self._log_stepped = False
            if self.rollout_version is not None and getattr(self.program.choice, "admits", False):
                self.endpoints.admission.produced(self.index)
            self.update += 1
            self.rollout_version = None
            self.reporter.mark(self.update, call)
        if route.sync:
            return self._reply(name, route)
        shape = route.skeleton if isinstance(route.skeleton, tuple) and len(route.skeleton) == route.arity else None
        rest = [Pending(name, i, call=call, skel=None if shape is None else shape[i], trip=self.trip)
                for i in range(1 if route.writes else 0, route.arity)]
        if handle is not None:
            new = Versioned(handle.name, handle.version + 1, self._states.get(handle.name, handle).value,
                            handle.created_at)
            self._states[new.name] = new
            return (new, *rest) if route.arity else new
        return tuple(rest) if route.arity else Pending(name, -1, call=call, skel=route.skeleton, trip=self.trip)

    def _lag_of(self, pending: Pending) -> int:
        """How many calls of its fragment the loop made after the one ``pending`` is an output of (a
        learner's output kept past its next calls, for a later call: PPG's value targets)."""
        return max(0, self._calls_of.get(pending.fragment, -1) - pending.call) if pending.call >= 0 else 0

    def _reply(self, name: str, route: Any) -> Any:
        """Wait for the answer to a request (an inference call served by another group): its
        outputs, copied out of the reply ring and rebuilt in their traced structure."""
        ring = self._replies[name]
        item = ring.get()
        if item is None:
            raise ConfigError(f"no reply to '{name}'", fix="the serving process stopped")
        leaves = [x.clone() if hasattr(x, "clone") else (x.copy() if hasattr(x, "copy") else x) for x in item[1]]
        ring.release()
        if not self.program.reads and self.rollout_version is None:
            # acting is served elsewhere: the rollout's version is that of its first answer
            self.rollout_version = self._last_version = item[0]
        if route.skeleton is not None:
            return fill_skeleton(route.skeleton, iter(leaves))
        return from_keys(route.outputs, leaves)
