"""Entry point of every worker process: a loop replica or a service group.

A worker dies with its driver (Linux: the parent-death signal; elsewhere a watchdog thread polls
the parent), so a killed driver leaves no worker running and, once the workers are gone, the
shared-memory tracker unlinks what the driver could not.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cloudpickle
import numpy as np

from fragflow import context
from fragflow.runtime import heap
from fragflow.runtime.outbox import Outbox
from fragflow.source import user_frames


def threads_for(group_threads: int) -> int:
    """torch threads of a process: ``FRAGFLOW_THREADS`` if set, else the placement's number for its group."""
    env = os.environ.get("FRAGFLOW_THREADS", "").strip()
    if not env:
        return group_threads
    if not env.isdigit() or int(env) < 1:
        from fragflow.errors import ConfigError

        raise ConfigError(f"FRAGFLOW_THREADS={env!r} is not a whole number of threads of at least 1",
                          fix="unset it (each process gets the placement's number) or set e.g. FRAGFLOW_THREADS=1")
    return int(env)


def limit_threads(n: int) -> None:
    """``n`` threads for torch's operations and for numpy's BLAS (matrix products) in this worker
    process: the placement's count, as torch's (numpy's OpenBLAS otherwise starts a thread per core
    for a product of a few hundred rows, whose speed then depends on what else the machine runs)."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(n, user_api="blas")


def blas_threads() -> list[int]:
    """The thread counts of numpy's BLAS libraries in this process (threadpoolctl's reading)."""
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's and numpy's BLAS threads at ``n`` within, the counts before put back after."""
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    with threadpool_limits(n, user_api="blas"):
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent(parent: int) -> None:
    armed = False   # the kernel kills this process when its parent dies
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            armed = libc.prctl(1, signal.SIGKILL) == 0   # PR_SET_PDEATHSIG
        except OSError:
            pass
    # Started by fork or spawn, the driver is this process's parent; from a fork server (the start
    # method once JAX is imported) the server is, and the driver is watched by its pid.
    started_by = os.getppid()

    def orphaned() -> bool:
        return os.getppid() != started_by or (started_by != parent and not _alive(parent))

    if orphaned():   # the driver died before the signal was armed
        os._exit(1)
    if armed and started_by == parent:
        # the signal comes when the driver dies: no thread to watch it, which would wait for the GIL
        # while the process computes, and be woken in vain at each of its numpy and torch calls that
        # let the GIL go (see backends.local.DirectQueue)
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if orphaned():
                os._exit(1)

    threading.Thread(target=watch, name="fragflow-parent-watch", daemon=True).start()


class QueueReporter:
    """A loop replica's events, batched to the driver every 0.2 s.

    Everything it reports (its counts, an update's mark, what the loop logs) goes into one outbox,
    in the order it happened, sent whole every ``REPORT_EVERY`` seconds and wherever the driver must
    have all of it (a checkpoint's cut, the loop's end, its failure): see :mod:`fragflow.runtime.outbox`.

    Counts are cumulative (env steps and episodes since the replica's loop began), so the driver
    counts each step and episode once: a restarted replica re-running trips its dead process
    already reported (or had done without reporting) starts from the counts of its snapshot, and
    the driver takes only what goes beyond what it has heard."""

    def __init__(self, results: Any, replica: int) -> None:
        self.replica = replica
        self.total_steps = 0
        self.log_seq = 0   # the loop's number of the ff.log call being reported
        self.total_episodes = 0
        self.episodes: list[tuple[int, float, int]] = []   # (this replica's env steps at its end, return, length)
        self.marks: list[tuple[int, int, int, int]] = []
        self.eval: list[tuple[int, int, float, int]] = []   # (updates, env steps made then, return, length)
        self.updates_made = 0
        self.dirty = False
        self.outbox = Outbox(results)   # reports not sent yet, in order

    def env_step(self, n: int, episodes: list[tuple[float, int]], evaluation: bool) -> None:
        if evaluation:   # every acting replica steps the whole evaluation env: the first one reports it
            if self.replica == 0:
                self.eval.extend((self.updates_made, self.total_steps, ret, length) for ret, length in episodes)
        else:
            self.total_steps += n
            self.total_episodes += len(episodes)
            self.episodes.extend((self.total_steps, ret, length) for ret, length in episodes)
        self.dirty = True
        self._due()

    def loop_begins(self) -> None:
        pass   # (a run over several processes counts its rate from its start: see Monitor.rate)

    def update(self) -> None:
        pass

    def log(self, scalars: dict[str, float], update: int | None = None, steps: int = 0,
            new_row: bool = False) -> None:
        self.outbox.add(("log", scalars, update, steps, new_row, self.log_seq))
        self._due()

    def logged(self, requests: list[tuple[str, int, int, str, str, int]], steps: int = 0,
               new_row: bool = False) -> None:
        self.outbox.add(("logged", requests, steps, new_row, self.log_seq))
        self._due()

    def mark(self, update: int, call: int = -1) -> None:
        """The loop made its ``update``-th clock call (``call``: the clock fragment's call number): what
        it had stepped then goes with it, so the driver's metrics row of that update says what
        single_process's says (not what had arrived)."""
        self.marks.append((update, self.total_steps, self.total_episodes, call))
        self.updates_made = update
        self.dirty = True
        self._counts()   # (the mark ends its report: the driver counts what was made by then)
        self._due()

    def _counts(self) -> None:
        if self.dirty:
            self.outbox.add(("steps", self.replica, self.total_steps, self.total_episodes, self.episodes,
                                self.eval, self.marks))
            self.episodes, self.eval, self.marks, self.dirty = [], [], [], False

    def _due(self) -> None:
        if self.outbox.due():
            self.flush()

    def flush(self) -> None:
        """Send everything reported so far."""
        self._counts()
        self.outbox.send()


def main(*args: Any) -> None:
    """Run a worker; with ``FRAGFLOW_PROFILE=DIR`` under cProfile, stats written to DIR/<role><index>.prof."""
    saving = (args[5] or {}) if len(args) > 5 else {}
    environ = saving.get("environ")
    if environ is not None:   # the driver's environment as the run started (a fork server holds that of its start)
        whole = saving.get("environ_whole", False)   # this machine's whole environment; on another, fragflow's settings
        for k in [k for k in os.environ if (whole or k.startswith("FRAGFLOW_")) and k not in environ]:
            del os.environ[k]
        os.environ.update(environ)
    out = os.environ.get("FRAGFLOW_PROFILE", "")
    if not out:
        return _main(*args)
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(_main, *args)
    finally:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"{args[0]}{args[1]}.prof"))


def _flush(reporter: QueueReporter | None, worker: Any = None) -> None:
    """What a process that stops or fails had not reported yet, sent (where its queue still takes
    it): a loop replica's counts and logs, a service group's updates."""
    try:
        if reporter is not None:
            reporter.flush()
        flush = getattr(worker, "flush_reports", None)
        if flush is not None:
            flush()
    except Exception:   # (its queue closed: the driver has stopped listening)
        pass


def _main(role: str, index: int, parent: int, blob: bytes, wiring: Any, saving: dict[str, Any] | None = None) -> None:
    # The driver coordinates shutdown; Ctrl-C in a terminal reaches the whole process group.
    if getattr(wiring, "watch_parent", True):   # a local process (a Ray actor is ended by Ray)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a forked worker inherits the driver's handler
        _die_with_parent(parent)
    from fragflow.backends import Stopped

    endpoints = None
    worker: Any = None
    reporter: QueueReporter | None = None
    results = wiring.results
    try:   # (a program that cannot be loaded here, a module it needs missing, is reported as any error)
        try:
            lowered, checks, train, args, user_envs = cloudpickle.loads(blob)
        except ModuleNotFoundError as exc:
            from fragflow.errors import ConfigError

            raise ConfigError(f"the {role} process could not load the program: {exc}",
                              fix="the worker could not import a module the program needs: install it where the "
                                  "workers run (on Ray, every node), or start the run from the folder that holds "
                                  "it") from None
        from fragflow.api.envs import register
        from fragflow.driver import apply_process_settings

        apply_process_settings(checks.get("process", {}))
        heap.in_worker()
        register(user_envs)
        endpoints = wiring.attach()
        if role == "actor":
            from fragflow.runtime.loop import LoopInterpreter

            limit_threads(threads_for(lowered.loop.threads))
            reporter = QueueReporter(results, index)
            worker = LoopInterpreter(lowered.loop, reporter, replica=index, endpoints=endpoints, checks=checks)
            tracker = _loop_saving(worker, reporter, index, parent, endpoints, saving,
                                   () if args is None else (args,)) if saving else None
            try:
                with context.using(worker):
                    value = train(*(() if args is None else (args,)))
            except Exception as exc:
                _note_split_envs(exc, lowered.loop.replicas, index)
                _close_rings(lowered, endpoints, index)
                raise
            except (SystemExit, KeyboardInterrupt):   # (the program's own: this process ignores Ctrl-C; the
                _close_rings(lowered, endpoints, index)       # calls made before it are learned from)
                raise
            finally:
                if tracker is not None:
                    from fragflow.runtime import trips

                    trips.install(None)
                worker.close()
            reporter.flush()
            _close_rings(lowered, endpoints, index)
            if index == 0:
                returned, lost = _returned(value)
                if lost:
                    results.put(("warn", "the training function's return value holds what cannot be sent from the "
                                         f"loop's process, which is None in the run's result: {'; '.join(lost)}"))
                results.put(("return", returned))
        else:
            from fragflow.runtime.service import ServiceRunner

            program = next(s for s in lowered.services if s.group == role)
            limit_threads(threads_for(program.threads))
            worker = ServiceRunner(program, endpoints, checks, saving=saving, driver=parent)
            worker.run()
        results.put(("done", role, index))
    except Stopped:
        _flush(reporter, worker)
        results.put(("stopped", role, index))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the driver
        _flush(reporter, worker)   # (what the loop made before it failed has its rows, as it had when sent at once)
        fragment = getattr(worker, "current", None)
        results.put(("error", role, index, fragment, _user_traceback(exc), _dumps_or_none(exc)))
        sys.exit(1)
    finally:
        if endpoints is not None:
            endpoints.detach()


def _close_rings(lowered: Any, endpoints: Any, index: int) -> None:
    """Loop replica ``index`` has ended (its loop returned, or the program ended it): its channels
    are closed, so that what it sent is taken and nothing more is waited for."""
    for name in lowered.loop.remote:
        endpoints.rings[f"{name}[{index}]"].close()


def _note_split_envs(exc: Exception, replicas: int, index: int) -> None:
    """A shape error in the loop's own code, where the environments are split: an array the loop
    sized with the run's count of environments (``args.num_envs``) has more rows than this
    replica's share (a fragment's call says so itself, with its own note)."""
    from fragflow.runtime.loop import _about_shapes

    notes = getattr(exc, "__notes__", [])
    if replicas > 1 and _about_shapes(exc) and not any(n.startswith("(while executing") for n in notes) \
            and "env.num_envs" not in str(exc):   # (a refusal that names the run's count says so itself)
        exc.add_note(f"(in loop replica {index}, one of {replicas} processes that each step their share of the run's "
                     "environments: size the loop's own per-environment arrays with env.num_envs, this process's "
                     "share, not with the run's count such as args.num_envs)")


SNAPSHOT_EVERY = 1.0    # a restartable replica sends where it stands at most this often (seconds) ...
SNAPSHOT_COST = 20.0    # ... and at most once per this many times what taking one cost
SNAPSHOT_MAX_BYTES = 64 << 20    # objects (a replay buffer) beyond this stay out of restart snapshots


def _within(meta: dict[str, Any], arrays: dict[str, Any], limit: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A restart snapshot without its largest objects until it fits ``limit`` bytes: a restarted actor
    then starts them empty (a replay buffer refills) rather than every snapshot costing seconds."""
    size = sum(getattr(a, "nbytes", 0) for a in arrays.values())
    if size <= limit:
        return meta, arrays
    local = dict(meta["locals"])
    def of(name: str, key: str) -> bool:
        return key == f"local.{name}" or key.startswith((f"local.{name}[", f"local.{name}."))

    sizes = {name: sum(a.nbytes for k, a in arrays.items() if of(name, k))
             for name, e in local.items() if e.get("as") == "component"}
    for name in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if size <= limit:
            break
        del local[name]
        size -= sizes[name]
        arrays = {k: a for k, a in arrays.items() if not of(name, k)}
    return dict(meta, locals=local, not_saved=[*meta.get("not_saved", []), *(n for n in sizes if n not in local)]), arrays


def _loop_saving(interp: Any, reporter: Any, index: int, driver: int, endpoints: Any, saving: dict[str, Any],
                 args: Any = ()) -> Any:
    """A loop replica's trip tracker: its part of each checkpoint the driver asks for, where it
    stands for a restart (every second or so), and where a resumed or restarted replica starts."""

    from fragflow.runtime import calls, checkpoint, trips
    from fragflow.runtime.received import state_of
    from fragflow.runtime.snapshot import (
        acting_views,
        copied_generators,
        copied_message,
        global_generators,
        global_message,
        held_by_state,
        loop_part,
        recomputed_message,
        resume_point,
        served_objects,
    )

    tracker = trips.Trips()
    ckpt = checkpoint.resumed(saving)
    if ckpt is not None:
        interp.restored = checkpoint.merged_states(ckpt)
        interp.changed_args = checkpoint.args_changed(ckpt, args[0]) if args else []
        interp.warn = lambda message: endpoints.results.put(("warn", message))
        interp.acting_before = acting_views(interp.restored)
        remote = interp.program.remote
        part = ckpt.part(f"loop{index}")

        def recomputed(changed: list[tuple[str, Any, Any]]) -> None:
            if index == 0:   # (said once for every replica)
                endpoints.results.put(("warn", recomputed_message(changed)))

        tracker.resume = resume_point(
            part, served_objects(ckpt), lambda key: not any(name.startswith(f"{key}.") for name in remote),
            recomputed=recomputed if args and checkpoint.changed_fields(ckpt, args[0]) else None)
        # the remote calls' numbers go on: replicas saved at different trips resume at different calls, and
        # a service gathering calls as they arrive compares the replicas' per-update values at the same call
        interp._calls_of = {str(k): int(v) for k, v in part[0].get("calls", {}).items()}
    restart = saving.get("restart")
    if restart is not None:
        interp.restarted = True
        interp.skip_until = restart["skip_until"]
        interp.skip_logs = restart.get("skip_logs", 0)
        if restart["point"] is not None:
            meta, arrays, seq, update, counts = restart["point"]
            interp._seq, interp.update = seq, update
            reporter.total_steps, reporter.total_episodes = counts[0], counts[1]
            interp._calls_of = dict(counts[2])   # the calls' numbers go on (what the loop logged names them)
            interp.logs = counts[3]
            tracker.resume = resume_point((meta, arrays))
    every = int(saving.get("cut_every") or 0)
    # a schedule in updates the loops cut on their own (where every service takes their calls in order,
    # or one loop's): where this replica has made N, 2N, 3N, ... updates (the next multiple of N once
    # it passed one within a trip), numbering its cuts 1, 2, 3, ...; the driver commits each as its
    # parts come in, however long it takes to hear of them. ``served``: the last request the driver
    # made out of schedule (Ctrl-C: at the next trip); ``pending``: the cut decided and not yet made
    # (replicas stepped together cut at the trip the first of them names)
    cut: dict[str, Any] = {"next": every, "served": 0, "pending": None}
    if restart is not None and every:
        point: Any = restart["point"]
        stood: Any = point[4] if point is not None else ()
        if len(stood) > 4:   # (where it stood in the schedule, at its last restart point)
            seen_before, cut["next"], *served = stood[4]
            cut["served"] = served[0] if served else 0   # (a request taken already is not taken again)
        else:
            seen_before, cut["next"] = 0, (interp.update // every + 1) * every
    else:
        seen_before = 0
    root = saving.get("root")
    admission = endpoints.admission
    replicas = interp.program.replicas
    together = bool(saving.get("cut_together"))
    # a replica saves its part of the checkpoint being asked for when it starts: the driver may have
    # asked before this process came up (a loaded machine, a schedule of seconds), and a restarted
    # replica's dead process's part, if it had sent it, is given up with the checkpoint
    seen = [seen_before]
    snapshots = bool(saving.get("snapshots"))
    next_snapshot = [time.monotonic() + SNAPSHOT_EVERY]

    def wanted() -> int | None:
        """The checkpoint whose part this trip saves (or, stepped together, names the trip of), if any."""
        if not every:   # the driver's request (a request of an updates schedule made ahead: once the loop has made them)
            seq = admission.checkpoint_request()
            return seq if seq > seen[0] and interp.update >= admission.checkpoint_at() else None
        if cut["pending"] is None:
            request = admission.checkpoint_request()
            if request > cut["served"]:
                cut["served"] = request
                # replicas stepped together take it as one checkpoint (the first to take it names it): one
                # that had decided its scheduled cut before the request came, while another took the request
                # as that cut, counts it served there, rather than number its cuts one apart from then on
                serving = admission.request_seq(request, seen[0] + 1) if together and replicas > 1 else seen[0] + 1
                if serving > seen[0]:
                    cut["pending"] = serving
            elif interp.update >= cut["next"]:
                cut["pending"] = seen[0] + 1
        return cut["pending"]

    def poll() -> bool:
        return bool((root and wanted() is not None) or (snapshots and time.monotonic() >= next_snapshot[0]))

    def capture(snapshot: trips.Snapshot) -> None:
        part = None
        seq = wanted() if root else None
        # replicas a service takes calls from in order save at one trip (the first to see the request
        # names its next one): under a policy that steps them together a resumed run finds them where
        # they wait for each other, and the service saves where the calls before that trip are in
        if seq is not None and (replicas == 1 or not together
                                or snapshot.trip >= admission.cut_trip(seq, snapshot.trip + 1)):
            seen[0] = seq
            if every:
                cut["pending"], cut["next"] = None, (interp.update // every + 1) * every
            position, part = loop_part(snapshot, held_by_state(interp._states), recurrent=interp.recurrent,
                                       latest=dict(interp._calls_of))
            position["steps"] = reporter.total_steps
            position["updates"] = interp.update   # (this run's)
            if every:   # the last out-of-schedule request it had heard of (Ctrl-C: stopped at a cut after it)
                position["asked"] = cut["served"]
            part[0]["calls"] = dict(interp._calls_of)   # (a resumed replica's calls go on from these numbers)
            reporter.flush()   # (what it made before the cut reaches the driver before its part: the cut's counts)
            checkpoint.deliver(endpoints.results, saving, seq, driver, f"loop{index}", *part, position)
            interp.cut = calls.cut_mark(seq)   # the calls after it: the service saves before the first
            # ... or once it has every earlier one (its own instance of a replicated group: multi_learner's)
            for group in {r.group for r in interp.program.remote.values()}:
                interp._defs[group].put(("cut", index, seq, interp._seq))
        if snapshots and time.monotonic() >= next_snapshot[0]:
            t0 = time.monotonic()
            meta, arrays = part if part is not None else \
                loop_part(snapshot, held_by_state(interp._states), strict=False, recurrent=interp.recurrent,
                          latest=dict(interp._calls_of))[1]
            remote = interp.program.remote
            meta["lost"] = [lost for lost in meta.get("lost", ())
                            if not any(name.startswith(f"{lost[2]}.") for name in remote)]
            meta, arrays = _within(meta, arrays, SNAPSHOT_MAX_BYTES)
            # copies: a backend's queue may pickle later, in a thread of its own, while the loop goes on writing
            # (the local backend's writes the report here: see backends.local.DirectQueue)
            arrays = {key: np.array(a) for key, a in arrays.items()}
            endpoints.results.put(("trip", index, meta, arrays, interp._seq, interp.update,
                                   (reporter.total_steps, reporter.total_episodes, dict(interp._calls_of),
                                    interp.logs, (seen[0], cut["next"], cut["served"]))))
            cost = time.monotonic() - t0
            next_snapshot[0] = time.monotonic() + max(SNAPSHOT_EVERY, SNAPSHOT_COST * cost)

    tracker.poll = poll
    tracker.capture = capture
    if replicas > 1 and index == 0 and restart is None:
        def first(frame: Any) -> None:
            held: list[tuple[str, Any]] = []
            message = copied_generators(frame, replicas, held)
            if message:
                endpoints.results.put(("warn", message))
            # a versioned state's generator: named if this process's copy moves (the loop drew from it);
            # so is a process-wide one (torch's, numpy's, Python's) the loop or a fragment run here draws from
            code, trips_left = frame.f_code, [64]
            then = [(label, gen, state_of(gen)) for label, gen in held]
            drawn = [(label, gen, state_of(gen)) for label, gen in global_generators()]

            def later(_: Any) -> None:
                moved = [label for label, gen, was in then if state_of(gen) != was]
                if moved:
                    endpoints.results.put(("warn", copied_message(code, moved, replicas)))
                    then.clear()
                used = [label for label, gen, was in drawn if state_of(gen) != was]
                if used:
                    endpoints.results.put(("warn", global_message(code, used, replicas)))
                    drawn.clear()
                if (then or drawn) and trips_left[0] > 0:
                    trips_left[0] -= 1
                    tracker.first = later
            tracker.first = later
        tracker.first = first
    if together and replicas > 1:
        def on_start(trip: int) -> None:
            interp.trip = trip
            admission.at_trip(index, trip)
        tracker.on_start = on_start
    else:
        def on_start(trip: int) -> None:
            interp.trip = trip
        tracker.on_start = on_start
    trips.install(tracker)
    return tracker


def _user_traceback(exc: BaseException) -> str:
    """The traceback with fragflow's own frames left out (FRAGFLOW_DEBUG=1 keeps them)."""
    if os.environ.get("FRAGFLOW_DEBUG", "") not in ("", "0"):
        return "".join(traceback.format_exception(exc))
    frames = user_frames(exc.__traceback__)
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))


def _returned(value: Any) -> tuple[bytes | None, list[str]]:
    """The training function's return value as the loop's process sends it: a learner's output the
    loop never saw (``return state, metrics``) is None, as the README says, the rest as returned (the
    versioned state's handles become the states the learners ended with); a part that cannot be
    pickled is None too, named in the list returned (the whole value was None, the state with it)."""
    from fragflow.api.versioned import Pending

    def strip(x: Any, path: str, lost: list[str] | None) -> Any:
        if isinstance(x, Pending):
            return None
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(strip(v, f"{path}[{i}]", lost) for i, v in enumerate(x))
        if isinstance(x, list):
            return [strip(v, f"{path}[{i}]", lost) for i, v in enumerate(x)]
        if isinstance(x, dict):
            return {k: strip(v, f"{path}[{k!r}]", lost) for k, v in x.items()}
        if lost is not None:
            try:
                cloudpickle.dumps(x)
            except Exception as exc:
                lost.append(f"{path or 'the value'} ({type(x).__name__}: {exc})")
                return None
        return x

    try:
        return cloudpickle.dumps(strip(value, "", None)), []
    except Exception:
        lost: list[str] = []
        kept = strip(value, "", lost)
        return _dumps_or_none(kept), lost


def _dumps_or_none(value: Any) -> bytes | None:
    try:
        return cloudpickle.dumps(value)
    except Exception:
        return None


@contextmanager
def no_main_reimport() -> Iterator[None]:
    """Start workers without re-running the user's script in them.

    The spawn start method re-imports ``__main__`` in every child unless the script guards its
    entry point with ``if __name__ == "__main__":``. Workers here need nothing from ``__main__``:
    the program arrives cloudpickled (by value for functions defined there), so the main module's
    path is hidden while the children start.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        if "__file__" in saved:
            delattr(main, "__file__")
        if "__spec__" in saved:
            main.__spec__ = None  # type: ignore[union-attr]
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)
