"""The multi-process driver: one worker per group replica (the loop's replicas and each service
group), started through a backend, plus this process, which watches them.

It turns the workers' reports into the run monitor's steps, episodes and metric rows and ends the
run. However the run ends (success, a worker raising, a worker dying, Ctrl-C or SIGTERM) every
worker is stopped within seconds and the backend releases everything it created.
"""

from __future__ import annotations

import errno
import os
import queue
import time
from typing import Any

import cloudpickle

from fragflow import backends
from fragflow.backends import WorkerDied
from fragflow.errors import FragflowError
from fragflow.lowering import Lowered
from fragflow.runtime import signals
from fragflow.runtime.drivercuts import DriverCheckpoints
from fragflow.runtime.exits import SHM_FULL, ProgramExit, WorkerFailed, ended, not_restarted
from fragflow.runtime.monitor import Monitor, StopRun
from fragflow.runtime.scalars import by_position, logged_at
from fragflow.runtime.serial import unwrap
from fragflow.runtime.worker import no_main_reimport

JOIN_TIMEOUT = 3.0
STATS_EVERY = 1.0
STOP_HEAR_OUT = 5.0          # a run stopped on its target: how long its processes may take to say their last


class Driver(DriverCheckpoints):
    def __init__(self, lowered: Lowered, program: bytes, monitor: Monitor, backend: str = "local",
                 checkpoints: Any = None, max_restarts: int = 3, address: str | None = None) -> None:
        self.checkpoints = checkpoints
        self.max_restarts = max_restarts
        self.restarts: dict[int, int] = {}
        self.points: dict[int, tuple[Any, ...]] = {}     # replica -> where it last said it stood
        self.logs_heard = 0   # the ff.log calls of loop replica 0 heard (a restarted replica 0 skips as many)
        self.heard: dict[int, tuple[int, int]] = {}      # replica -> env steps and episodes counted from it
        # a logged fragment's scalars, by call of loop replica 0: computed (the update, by part) and asked for
        self._computed_logs: dict[tuple[str, int], dict[int, dict[str, float | None] | None]] = {}
        self._asked_for: dict[tuple[str, int], list[tuple[int, str, str, int, int, bool]]] = {}
        # gathered on arrival: the update (of this run) that merged each of loop replica 0's calls of a
        # fragment other than the clock (the clock's j-th update's row is its j-th call's: see arrivalrows)
        self._merged_into: dict[tuple[str, int], int] = {}
        # when each call's computed scalars were heard (kept a while: the loop's ff.log of the call comes
        # in its next report, up to a flush period later), and each fragment's newest call forgotten
        self._computed_when: dict[tuple[str, int], float] = {}
        self._forgotten: dict[str, int] = {}
        # each fragment's newest call heard, and the size at which each store is next looked through
        # (twice what its last look left: a look costs its size, so each entry costs a few looks)
        self._newest_call: dict[str, int] = {}
        self._look_at = [4 * self._KEEP_CALLS] * 3
        self._said_forgotten: set[str] = set()
        self._said_missing: set[tuple[str, str]] = set()
        self._clocks = {s.clock for s in lowered.services}
        self.lowered = lowered
        self.program = program
        self.monitor = monitor
        self.backend = backends.get(backend, address)
        self.procs: list[tuple[str, int, Any]] = []
        self.finished: set[tuple[str, int]] = set()
        self.value: Any = None
        self.final: dict[str, Any] = {}
        self.finals_expected = len(lowered.services)
        self.finals = 0
        self.returned = False
        self.wiring: Any = None
        self.endpoints: Any = None
        self._asked_at = 0.0
        self._asks = 0     # the requests made of loops that cut on their own schedule (Ctrl-C)
        self.store: Any = None      # the learners' rendezvous (replicated learners)
        self.world = 1              # how many of them

    def run(self) -> Any:
        try:
            self._start()
            self._loop()
        except KeyboardInterrupt:
            if not self._ended():
                raise
            # (Ctrl-C, SIGTERM once every process has ended and the program's value came: the run has
            # completed, and its processes are only being joined; it stops nothing)
        finally:
            with signals.shielded():   # a second Ctrl-C (a signal sent to the group twice) lets the segments be released
                if self.checkpoints is not None:
                    self.checkpoints.abort()
                self._shutdown()
                if self.checkpoints is not None and self.checkpoints.enabled:
                    self.checkpoints.sweep()   # (parts its processes wrote of ones never committed)
        if self.checkpoints is not None and self.checkpoints.enabled:
            # (refused whether or not the services had their state yet: a run that ran nothing may end
            # before they are sent it, and say nothing of it)
            self.checkpoints.refuse_nothing_run(self.monitor.counters())
        if self.checkpoints is not None and self.checkpoints.enabled and self.final:
            from fragflow.runtime.snapshot import encode_states

            with signals.shielded():   # (the run has completed: its last checkpoint is written whole)
                states = encode_states({name: (self.monitor.updates, value) for name, value in self.final.items()})
                self.checkpoints.commit(self.monitor.counters(), None, {"states": states}, complete=True)
        return unwrap(self.value, self.final)

    def _ended(self) -> bool:
        """Every process has ended, the loop has returned its value and each service its last state."""
        return len(self.finished) >= len(self.procs) and self.returned and self.finals == self.finals_expected

    def _start(self) -> None:
        from fragflow.runtime import worker

        with signals.deferred():   # every segment made is recorded for release before a Ctrl-C stops the run
            self.wiring = self.backend.wire(self.lowered)
        self.endpoints = self.wiring.attach()
        roles = [(s.group, 0) for s in self.lowered.services] + [("actor", k) for k in range(self.lowered.loop.replicas)]
        self.saving = self._saving()
        with no_main_reimport():
            for role, k in roles:
                with signals.deferred():   # (a signal during a fork is otherwise dropped, and the run goes on)
                    p = self.backend.start(worker.main, (role, k, os.getpid(), self.program,
                                                         self._wiring_for(role, k), self.saving), f"fragflow-{role}-{k}")
                    self.procs.append((role, k, p))
                self._started(role, k)
                signals.check()

    def _wiring_for(self, role: str, k: int) -> Any:
        """What worker ``(role, k)`` attaches to: a report queue of its own where the backend has them."""
        per_process = getattr(self.wiring, "for_process", None)
        return per_process(f"{role}-{k}") if per_process is not None else self.wiring

    def _started(self, role: str, k: int) -> None:
        started = getattr(self.wiring, "started", None)
        if started is not None:
            started(f"{role}-{k}")

    def _saving(self) -> dict[str, Any]:
        """What every worker is told besides its program: checkpoints, restarts, the learners' rendezvous."""
        ck = self.checkpoints
        here = getattr(self.backend, "shares_files", True)   # workers on this machine (not Ray's, elsewhere)
        world = self.world = max((s.world for s in self.lowered.services), default=1)
        rendezvous = None
        if world > 1:
            from fragflow.runtime import allreduce

            allreduce.setting()   # (a wrong FRAGFLOW_ALLREDUCE refused before any worker starts)
            self.store, rendezvous = allreduce.host(world, self.backend.rendezvous_host()
                                                    if hasattr(self.backend, "rendezvous_host") else "127.0.0.1")
        return {"root": str(ck.root) if ck is not None and ck.enabled else None,
                # workers get the checkpoint's parts, read here: they may run where its files are not
                "resume": ck.resume if ck is not None else None,   # its parts read (see driver.run)
                # parts go through the report queue where workers may not share this machine's files
                "ship": not here,
                "snapshots": self.lowered.loop.restartable is None and self.max_restarts > 0,
                # loop replicas whose calls a service takes round them in order save at one trip (see
                # worker._loop_saving); others each at their next one, nearest the learner's save
                "cut_together": any(s.ordered for s in self.lowered.services),
                # a schedule in updates that the loops cut on their own (see worker._loop_saving)
                "cut_every": self.cut_every,
                "rendezvous": rendezvous,
                # the environment as it is now, as a forked or spawned worker would have it: a fork server
                # started earlier holds its start's; on other machines (Ray), only fragflow's settings
                "environ": (dict(os.environ) if here
                            else {k: v for k, v in os.environ.items() if k.startswith("FRAGFLOW_")}),
                "environ_whole": here}

    def _restart(self, k: int, how: str) -> None:
        """Start loop replica ``k`` again in a new process: from where it last said it stood, with the
        newest parameters (it reads the broadcast), sending nothing its dead process already sent."""
        from fragflow.runtime import worker

        endpoints = self.endpoints
        ck = self.checkpoints
        if ck is not None and ck.staging:
            # its part will not come, or its marked calls after it (which the learner saves before): the
            # next one is asked for when due
            ck.abort()
        puts = 0
        for name in self.lowered.loop.remote:
            ring = endpoints.rings[f"{name}[{k}]"]
            try:
                ring.repair_producer()
            except RuntimeError as exc:
                raise WorkerDied(f"actor {k} {how}; not restarted: {exc}") from None
            puts += ring.puts
        endpoints.admission.forget(k)
        loop = self.lowered.loop
        for group in {route.group for route in loop.remote.values()}:   # its admitted rollouts will not come
            endpoints.definitions(loop.service_for(group, k)).put(("restarted", k))
        self.restarts[k] = self.restarts.get(k, 0) + 1
        saving = dict(self.saving, restart={"point": self.points.get(k), "skip_until": puts,
                                            "skip_logs": self.logs_heard if k == 0 else 0})
        try:
            with no_main_reimport():
                p = self.backend.start(worker.main, ("actor", k, os.getpid(), self.program,
                                                     self._wiring_for("actor", k), saving),
                                       f"fragflow-actor-{k}-r{self.restarts[k]}")
                self._started("actor", k)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # (its report queue's semaphores live in /dev/shm: not the program's error)
            raise WorkerDied(f"actor {k} {how}; it could not be restarted: {exc} ({SHM_FULL})") from None
        self.monitor.restarted(f"actor {k} {how}: restarted ({self.restarts[k]} of {self.max_restarts})")
        self.procs = [(r, i, q) if (r, i) != ("actor", k) else (r, i, p) for r, i, q in self.procs]

    def _loop(self) -> None:
        next_stats = time.monotonic() + STATS_EVERY
        results = self.wiring.results
        try:
            while not self._ended():
                signals.check()   # (a Ctrl-C dropped in a finalizer: see keeps_interrupts)
                self._checkpoint_due()
                try:
                    msg = results.get(timeout=0.1)
                except queue.Empty:
                    self._check_alive()
                    continue
                self._handle(msg)
                if time.monotonic() >= next_stats:
                    next_stats = time.monotonic() + STATS_EVERY
                    self.monitor.channels(self.channel_stats())
        except StopRun:
            self.wiring.stop.set()
            self._hear_out()
            raise
        except (WorkerFailed, FragflowError) as exc:   # what the others made of the calls sent before the failure
            self._loops_ended(exc)                        # still has its rows (a worker's own error: a non-finite write)
            self.wiring.stop.set()
            self._hear_out(STOP_HEAR_OUT / 5)
            raise
        except ProgramExit as exc:   # (sys.exit(3), a KeyboardInterrupt of its own: exit 3, 130 as in one process)
            self._loops_ended(exc)
            self.wiring.stop.set()
            self._hear_out(STOP_HEAR_OUT / 5)
            raise exc.cause from None
        finally:
            self.monitor.channels(self.channel_stats())

    def _loops_ended(self, exc: Exception) -> None:
        """A loop replica ended by the program (its sys.exit, an exception of its code): the calls it
        made before are learned from, as they were where the program ran eagerly. The replica closed
        its channels as it ended, so the services take what is in them and end once every replica's
        loop has ended too (every replica runs the same program, as a rule to the same end); the rest
        of the run is stopped after ``STOP_HEAR_OUT / 5`` seconds at most."""
        if getattr(exc, "role", None) == "actor" and not self.wiring.stop.is_set():
            self._hear_out(STOP_HEAR_OUT / 5)

    def _hear_out(self, wait: float = STOP_HEAR_OUT) -> None:
        """The run stops early (its target reached, a process failed): take in what the processes
        still send until they have stopped, so that the updates they made have their rows, with their
        own steps."""
        deadline = time.monotonic() + wait
        results = self.wiring.results
        while len(self.finished) < len(self.procs) and time.monotonic() < deadline:
            try:
                self._handle(results.get(timeout=0.05))
            except queue.Empty:
                if all(p.exitcode is not None for _, _, p in self.procs):
                    return
            except (ProgramExit, WorkerFailed, FragflowError):
                # another process ending as this one did (every loop replica runs the program's sys.exit)
                # or failing as it stops: the run has its outcome already, the rest is still heard
                continue
            except Exception:
                return

    # A service reports the scalars of the parts of a fragment's outputs the loop may log, after
    # every call, with the call's number in loop replica 0; the loop (replica 0) says which of its
    # calls it logged, which part, the path in it, the name, and the update it had made: those values
    # are written into that update's row, as single_process writes them (rows wait for replica 0's
    # next update, see Monitor.mark), whichever message reaches the driver first.
    _KEEP_CALLS = 256   # calls of a fragment kept for the other side's word

    def _computed(self, fragment: str, call: int | None, logged: dict[int, dict[str, float | None] | None],
                  calls: tuple[int, ...] = ()) -> None:
        if not self.monitor.marked_replicas:
            # gathered on arrival from several replicas: the clock's j-th update has the row, and the
            # values, of replica 0's j-th call (see arrivalrows); another fragment's values of the call
            # that merged replica 0's call (``calls``: one, two or none of them) go to the row replica 0
            # logged them at, as the loop's own values do
            update = self.monitor.updates - self.monitor.base_updates
            clock = fragment in self._clocks
            key = f"{fragment}@update" if clock else fragment   # (the clock's: by its update)
            for c in (update,) if clock else calls:
                for part, rest, name, at, steps, new_row in self._asked_for.pop((key, c), ()):
                    self._write_logged(at, logged.get(part, {}), rest, name, steps, new_row, fragment)
                    if not clock:
                        self.monitor.row_answered(at, new_row)
                self._computed_logs[(key, c)] = logged
                self._computed_when[(key, c)] = time.monotonic()
                self._merged_into[(key, c)] = update
                self._forget_logs(key, c)
            return
        if call is None:   # (replica 0's call is in every update where calls are taken in order)
            return
        for part, rest, name, asked_at, steps, new_row in self._asked_for.pop((fragment, call), ()):
            self._write_logged(asked_at, logged.get(part, {}), rest, name, steps, new_row, fragment)
        self._computed_logs[(fragment, call)] = logged   # a later ff.log of the call may ask again
        self._computed_when[(fragment, call)] = time.monotonic()
        self._forget_logs(fragment, call)

    def _asked(self, fragment: str, call: int, part: int, rest: str, name: str, update: int, steps: int,
               new_row: bool) -> None:
        """The loop logged ``part`` of ``fragment``'s call ``call`` after its ``update``-th update and
        ``steps``-th env step (``new_row``: after an env step, a row of its own, as the loop's own values)."""
        computed = self._computed_logs.get((fragment, call))
        if computed is not None:
            self._write_logged(update, computed.get(part, {}), rest, name, steps, new_row, fragment)
        elif self._was_forgotten(fragment, call, name):
            return
        else:
            self._asked_for.setdefault((fragment, call), []).append((part, rest, name, update, steps, new_row))
            self._forget_logs(fragment, call)

    def _asked_on_arrival(self, fragment: str, call: int, part: int, rest: str, name: str, at: int, steps: int,
                          new_row: bool) -> None:
        """Calls gathered on arrival: the loop (replica 0) logged ``part`` of its call ``call`` of
        ``fragment`` after its ``at``-th clock call (``new_row``: after its ``steps``-th env step too),
        whichever came first. The clock's j-th call of this run has the j-th update's values (none
        where the run made fewer updates: calls dropped as stale), another fragment's call the
        values of the call that merged it; they go where single_process writes them: the row of
        update ``at``, or after an env step a row of its own after it (see Monitor.log_at). A row
        waits for another fragment's values (the clock's update comes before any later row)."""
        clock = fragment in self._clocks
        if clock:   # its call numbered first_call0 + j - 1 is the j-th update's
            fragment, call = f"{fragment}@update", call - (self.monitor.first_call0 or 0) + 1
        # (logged after a value that made the loop's row at this step: it joins that row)
        new_row = new_row or self.monitor.loop_row_at(at, steps)
        update = self._merged_into.get((fragment, call))
        computed = self._computed_logs.get((fragment, call))
        if update is not None and computed is not None:
            self._write_logged(at, computed.get(part, {}), rest, name, steps, new_row, fragment)
        elif self._was_forgotten(fragment, call, name):
            if new_row:
                self.monitor.log_at(at, {}, steps, new_row=True)
        else:
            if not clock:
                self.monitor.row_awaits(at, new_row)
            if new_row:   # (the loop's row, which a value logged after it at the same step joins)
                self.monitor.log_at(at, {}, steps, new_row=True)
            self._asked_for.setdefault((fragment, call), []).append((part, rest, name, at, steps, new_row))
            self._forget_logs(fragment, call)

    def _dropped(self, fragment: str, call: int) -> None:
        """Replica 0's call of ``fragment`` was dropped as stale: what the loop logged of it is in no
        row (single_process has no such call), and the rows that waited for it go on."""
        for _, _, _, at, _, new_row in self._asked_for.pop((fragment, call), ()):
            self.monitor.row_answered(at, new_row)
        self._computed_logs[(fragment, call)] = {}
        self._merged_into[(fragment, call)] = 0
        self._forget_logs(fragment, call)

    def _write_logged(self, update: int, scalars: dict[str, float | None] | None, rest: str, name: str,
                      steps: int | None, new_row: bool, fragment: str) -> None:
        """The scalars at ``rest`` in a part, logged as ``name`` into the row the loop logged them in
        (see Monitor.log_at): its own row at ``steps``, else ``update``'s. A call that returned nothing
        there (a key the traced calls returned, missing from this one) is said once a name."""
        chosen = logged_at(scalars, rest, name) if scalars else {}
        if scalars and not chosen and rest:   # (an index into a part reported by name: a namedtuple's fields)
            chosen = logged_at(scalars, by_position(scalars, rest), name)
        if scalars is None or (scalars and not chosen):
            self._missing_logged(fragment, name)
        chosen = {k: v for k, v in chosen.items() if v is not None}   # (a None: nothing to write, as ff.log's)
        if chosen:
            self.monitor.log_at(update, chosen, steps, new_row)

    def _missing_logged(self, fragment: str, name: str) -> None:
        fragment = fragment.removesuffix("@update")
        if (fragment, name) in self._said_missing:
            return
        self._said_missing.add((fragment, name))
        shared = next((s.world for s in self.lowered.services if fragment in s.fragments and s.world > 1), 0)
        if shared:   # (learner 0 reports its own share's outputs: an element past its rows is in no report)
            self.monitor.warn(
                f"ff.log got {name or 'a value'!r}, an output of a call of '{fragment}' which learner 0's call did "
                f"not return: {shared} learners each run '{fragment}' on their share of the batch, and learner 0 "
                "reports what its share gives (an element of a per-sample output past its share's rows is in no "
                "report, a key it returns only for some samples may be missing): rows miss it (log a statistic such "
                "as a mean, learner 0 reporting its share's, or run with a single-learner policy)")
            return
        self.monitor.warn(f"ff.log got {name or 'a value'!r}, an output of a call of '{fragment}' which that "
                          "call did not return (a key or an entry its traced calls returned, missing from this "
                          "one; an eager run raises KeyError or IndexError at the loop's line): rows miss it (return "
                          "every metric from the first call on, one not ready yet as NaN, or log the output whole: "
                          "ff.log(metrics))")

    _KEEP_SECONDS = 10.0   # ... and for this long at least after they were computed (many report flushes)

    def _forget_logs(self, fragment: str, call: int) -> None:
        """Forget the calls of each fragment well behind its newest (``call``, of ``fragment``, just
        heard): those computed at least ``_KEEP_SECONDS`` ago (a fast loop's report of its ff.log of a
        call can come hundreds of calls after the learner's values of it: forgetting by count alone
        lost them). A store is looked through when it has doubled since it was last (each look walks
        all of it: one at every call kept the driver busy, its stores holding ``_KEEP_SECONDS`` of
        calls, and took the loop's core on a small machine)."""
        if call > self._newest_call.get(fragment, -1):
            self._newest_call[fragment] = call
        stores: tuple[dict[tuple[str, int], Any], ...] = (self._computed_logs, self._asked_for, self._merged_into)
        for i, store in enumerate(stores):
            if len(store) <= self._look_at[i]:
                continue
            old = time.monotonic() - self._KEEP_SECONDS
            newest = self._newest_call
            for key in [k for k in store if k[1] < newest.get(k[0], k[1]) - self._KEEP_CALLS
                        and self._computed_when.get(k, 0.0) <= old]:
                name = key[0]
                if store is self._asked_for and not self.monitor.marked_replicas and not name.endswith("@update"):
                    for request in store[key]:   # (never answered: its row waits no more)
                        self.monitor.row_answered(request[3], request[5])
                if store is self._computed_logs:
                    self._computed_when.pop(key, None)
                    self._forgotten[name] = max(self._forgotten.get(name, -1), key[1])
                del store[key]
            self._look_at[i] = max(4 * self._KEEP_CALLS, 2 * len(store))

    def _was_forgotten(self, fragment: str, call: int, name: str) -> bool:
        """The loop logged a call whose values were forgotten (it kept the output many calls and
        seconds before logging it): said once a fragment, not written (rows miss it)."""
        if call > self._forgotten.get(fragment, -1):
            return False
        if fragment not in self._said_forgotten:
            self._said_forgotten.add(fragment)
            self.monitor.warn(f"ff.log got an output of call {call + 1} of '{fragment.removesuffix('@update')}' as "
                              f"{name or 'its value'!r} more than {self._KEEP_CALLS} calls and "
                              f"{self._KEEP_SECONDS:.0f} s after that call ran in another process, which reports "
                              "the values it computes for that long: rows miss such values (log an output in the "
                              "trips that follow its call, or keep what must be logged later in versioned state; "
                              "or run with --policy single_process)")
        return True

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "batch":   # a loop replica's reports, sent together (see QueueReporter): each, in order
            stop: BaseException | None = None
            for part in msg[1]:
                try:
                    self._handle(part)
                except (StopRun, Exception) as failed:   # (the rest still counts, as when they came one by one)
                    stop = stop or failed
            if stop is not None:
                raise stop
        elif kind == "steps":
            _, k, steps, episodes, finished, evaluated, marks = msg
            heard_steps, heard_episodes = self.heard.get(k, (0, 0))
            new = finished[max(0, len(finished) - (episodes - heard_episodes)):] if episodes > heard_episodes else []
            try:   # (a target reached stops the run here: the rest of the message still counts)
                if steps > heard_steps or new:
                    self.monitor.env_step(max(0, steps - heard_steps), [(ret, length) for _, ret, length in new], k, new)
            finally:
                self.heard[k] = (max(steps, heard_steps), max(episodes, heard_episodes))
                # (evaluation episodes before the marks: a mark may write the row that holds them)
                for update, at, ret, length in evaluated:
                    self.monitor.eval_episode(ret, length, (update, at))
                for update, *_ in marks:   # the mark ends its message: what was heard is what it had made
                    self.monitor.mark(k, update, self.heard[k][0])
                if self.monitor.arrival:   # (its steps and clock calls heard: the rows that wait for them)
                    self.monitor.heard_from(k, self.heard[k][0], marks)
        elif kind == "update":
            if self.monitor.arrival:   # (each replica's steps at its latest call taken, where one learner takes them all)
                taken = msg[5] if len(msg[5]) == self.lowered.loop.replicas else None
                self.monitor.arrived_update(taken)
            else:
                self.monitor.update()
            self._computed(msg[2], msg[3], msg[4])
        elif kind == "logs":
            self._computed(*msg[1:])
        elif kind == "logged":
            self.logs_heard = max(self.logs_heard, msg[4] + 1)
            if self.monitor.marked_replicas:
                for fragment, call, part, rest, name, update in msg[1]:
                    self._asked(fragment, call, part, rest, name, update, msg[2], msg[3])
            else:   # gathered on arrival: into the row of the update that merged the call
                for fragment, call, part, rest, name, at in msg[1]:
                    self._asked_on_arrival(fragment, call, part, rest, name, at, msg[2], msg[3])
        elif kind == "dropped":
            self._dropped(msg[1], msg[2])
        elif kind == "log":   # the loop's own values, after its update-th update and steps-th env step
            self.logs_heard = max(self.logs_heard, msg[5] + 1)
            self.monitor.log_at(msg[2], msg[1], msg[3], msg[4])
        elif kind == "warn":
            self.monitor.warn(msg[1])
        elif kind == "return":
            self.value = cloudpickle.loads(msg[1]) if msg[1] is not None else None
            self.returned = True
        elif kind == "final":
            self.final.update({name: cloudpickle.loads(blob) for name, blob in msg[2].items()})
            self.finals += 1
        elif kind in ("done", "stopped"):
            self.finished.add((msg[1], msg[2]))
            if msg[1] == "actor":
                self.monitor.loop_ended(msg[2])
            ck = self.checkpoints
            for seq in list(ck.staging) if ck is not None and msg[1] == "actor" else ():
                if f"loop{msg[2]}" in ck.missing(seq):
                    ck.abort(seq)   # that replica's loop has ended: no trip of it is left to save
        elif kind == "trip":
            _, k, meta, arrays, seq, update, counts = msg
            self.points[k] = (meta, arrays, seq, update, counts)
        elif kind in ("ckpt_data", "ckpt"):   # a process's part of a checkpoint (see DriverCheckpoints)
            self._checkpoint_part(msg)
        elif kind == "error":
            _, role, index, fragment, tb, blob = msg
            self.finished.add((role, index))   # (it has said its last)
            if role == "actor":   # its loop has ended: the rows it marked are written with their own steps
                self.monitor.loop_ended(index)
            exc = WorkerFailed(role, index, fragment, tb, self._process_name(role, index, fragment))
            cause = None
            if blob is not None:
                try:
                    cause = cloudpickle.loads(blob)
                except Exception:
                    cause = None
            if isinstance(cause, FragflowError):
                if role != "actor" and getattr(cause, "replicas_apart", False):
                    self._replica_failure_first()
                raise cause
            if isinstance(cause, (SystemExit, KeyboardInterrupt)):
                raise ProgramExit(cause, role)
            dead = self._killed_peer(role, index)
            if dead is not None:   # its peers fail on their connections to it: the death is the cause
                first = (tb.strip().splitlines() or [""])[-1]
                raise WorkerDied(f"{dead} without reporting an error; {exc.args[0].splitlines()[0]} {first}") from None
            raise exc from cause

    def _replica_failure_first(self, wait: float = 2.0) -> None:
        """A service found loop replicas that left the loop apart: where one of them left because its
        program raised (it closes its channels, then reports), report that error, which follows at
        once, not its consequence (handled here: it raises)."""
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                msg = self.wiring.results.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            if msg[0] != "error" or msg[1] == "actor":   # (another service's error: this one is reported)
                self._handle(msg)

    def _process_name(self, role: str, index: int, fragment: str | None) -> str:
        """A worker by its part in the placement: the loop's replicas only step environments where every
        actor fragment is served elsewhere (central_inference's env workers), and the process serving
        them is an inference server beside the learner."""
        roles = {n.name: n.role for n in self.lowered.placed.graph.fragments()}
        if role == "actor":
            served = any(roles.get(name) == "actor" for name in self.lowered.loop.remote)
            return f"env worker {index}" if served else f"actor {index}"
        if fragment is not None and roles.get(fragment) == "actor":
            return f"the inference server (the {role}'s process)"
        answers = sorted(name for name, route in self.lowered.loop.remote.items()
                         if roles.get(name) == "actor" and route.group == role)
        if fragment is None and answers:   # (died without a word: the fragment it ran is not known)
            return f"{role} (also the inference server of actor {', '.join(repr(n) for n in answers)})"
        return role

    def _killed_peer(self, role: str, index: int, wait: float = 0.5) -> str | None:
        """Another process that a signal ended (a peer of a failed process, which may have failed
        only because that one died): ``"<who> process was killed by signal N"``, or None."""
        deadline = time.monotonic() + wait
        while True:
            for r, k, p in self.procs:
                if (r, k) != (role, index) and (r, k) not in self.finished and p.exitcode is not None and p.exitcode < 0:
                    who = self._process_name(r, k, None)
                    return f"{who} process {getattr(p, 'died', None) or ended(p.exitcode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _check_alive(self) -> None:
        for role, k, p in self.procs:
            if (role, k) not in self.finished and p.exitcode is not None:
                try:   # drain: an error message may be in flight
                    while True:
                        self._handle(self.wiring.results.get(timeout=0.2))
                except queue.Empty:
                    pass
                if (role, k) in self.finished:
                    continue
                who = self._process_name(role, k, None)
                code = p.exitcode
                failure = getattr(p, "failure", None)
                if failure:   # (a Ray actor whose run raised before it could report: it would again)
                    hint = ("; the worker could not import a module the program needs: install it where Ray runs "
                            "its workers, or start the run from the folder that holds it" if "ModuleNotFoundError" in failure
                            else "")
                    raise WorkerDied(f"{who} process failed before it could report: {failure}{hint}")
                how = getattr(p, "died", None) or ended(code)   # (a Ray actor: Ray does not say how it ended)
                why = not_restarted(role, code, self.lowered.loop.restartable, self.restarts.get(k, 0),
                                    self.max_restarts)
                lost = (self.points.get(k) or ({},))[0].get("lost") if role == "actor" else None
                if why is None and lost:
                    why = (f"its loop's {', '.join(f'{n!r} (a {cls})' for n, cls, _ in lost)} holds the data its buffer fragments keep but has no "
                           "state_dict()/load_state_dict(), so a restarted actor would go on with it empty (give "
                           "the class both to have such an actor restarted)")
                if why is None:
                    self._restart(k, how)
                    continue
                raise WorkerDied(f"{who} process {how} without reporting an error; not restarted: {why}")

    def channel_stats(self) -> dict[str, Any]:
        if self.endpoints is None:
            return {}
        stats = [self.endpoints.rings[r.name].stats() for r in self.lowered.rings]
        if not stats:
            return {}
        merged: dict[str, Any] = {
            "depth": sum(s["depth"] for s in stats), "items": sum(s["gets"] for s in stats),
            "bytes": sum(s["bytes"] for s in stats), "drops": sum(s["drops"] for s in stats),
            "put_wait_s": sum(s["put_wait_s"] for s in stats),
            "lag_histogram": [sum(s["lag_histogram"][i] for s in stats) for i in range(len(stats[0]["lag_histogram"]))],
            **self.endpoints.admission.counters(),
        }
        if self.store is not None:   # replicated learners: where each one's time went (once they report)
            from fragflow.runtime import allreduce

            learners = allreduce.timings(self.store, self.world)
            if learners:
                merged["learners"] = learners
        return {"trajectory": merged}

    def _shutdown(self) -> None:
        if self.wiring is not None:
            self.wiring.stop.set()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for _, _, p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for _, _, p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
            if hasattr(p, "close") and not p.is_alive():
                p.close()   # (its sentinel's pipe, held until the object is collected)
        if self.endpoints is not None:
            self.endpoints.detach()
        if self.wiring is not None:
            self.wiring.release()


def execute(lowered: Lowered, program: bytes, monitor: Monitor, checkpoints: Any = None, max_restarts: int = 3,
            backend: str = "local", address: str | None = None) -> Any:
    monitor.rows_end_at_steps = False
    clock = {r.group for r in lowered.loop.remote.values() if r.primary}
    # (the instances of a replicated learner, multi_learner's learner.0, learner.1, ..., update together)
    services = [s for s in lowered.services if s.group in clock or s.group.rsplit(".", 1)[0] in clock]
    if services and sum(s.producers for s in services) == lowered.loop.replicas and all(
            s.producers == 1 or s.ordered for s in services) and (len(services) == 1 or all(
            s.world == len(services) for s in services)):
        monitor.marked_replicas = lowered.loop.replicas   # each update takes one call of every replica
    elif services and lowered.loop.replicas > 1:
        monitor.arrival = True   # calls gathered as they arrive (see arrivalrows)
    return Driver(lowered, program, monitor, backend, checkpoints=checkpoints, max_restarts=max_restarts,
                  address=address).run()
