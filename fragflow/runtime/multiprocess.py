"""The multi-process executor: one worker process per placed group replica, plus this driver.

The driver creates every shared-memory segment, spawns the learner and the actors, turns their
reports into the run monitor's steps, episodes and metric rows, and ends the run. Whatever way the
run ends (success, a worker raising, a worker dying, Ctrl-C or SIGTERM) every worker is stopped
within seconds and every segment is unlinked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cloudpickle

from fragflow.errors import ConfigError
from fragflow.runtime.channels import ParamChannel, TrajectoryChannel
from fragflow.runtime.control import ADMIT_WAIT_NS, LEARN_NS, UPDATES, WAIT_NS, Control
from fragflow.runtime.monitor import Monitor, StopRun
from fragflow.runtime.plan import RunPlan
from fragflow.runtime.serial import unwrap
from fragflow.runtime.shm import Segment

JOIN_TIMEOUT = 3.0
STATS_EVERY = 1.0


def start_method() -> str:
    """How workers start: ``FRAGFLOW_START_METHOD`` (fork, forkserver or spawn), else fork on Linux.

    Fork starts a worker in milliseconds with the driver's modules already imported; spawn starts a
    fresh interpreter (about a second per worker, to import torch) and is the only choice on
    macOS and Windows.
    """
    method = os.environ.get("FRAGFLOW_START_METHOD", "")
    if method:
        if method not in mp.get_all_start_methods():
            raise ConfigError(f"FRAGFLOW_START_METHOD={method!r} is not available here",
                              fix=f"use one of: {', '.join(mp.get_all_start_methods())}")
        return method
    return "fork" if sys.platform.startswith("linux") else "spawn"


class WorkerFailed(Exception):
    """A worker process raised: names the process and fragment, carries the user's traceback."""

    def __init__(self, role: str, index: int, fragment: str | None, tb: str) -> None:
        who = "learner" if role == "learner" else f"actor {index}"
        where = f" in fragment '{fragment}'" if fragment else ""
        super().__init__(f"{who} failed{where}:\n{tb.rstrip()}")
        self.role, self.index, self.fragment, self.tb = role, index, fragment, tb


class WorkerDied(Exception):
    """A worker process ended without a word (killed, or crashed in native code)."""


@contextmanager
def _no_main_reimport() -> Iterator[None]:
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


class Driver:
    def __init__(self, plan: RunPlan, monitor: Monitor) -> None:
        self.plan = plan
        self.monitor = monitor
        self.ctx: Any = mp.get_context(start_method())
        self.segments: list[Segment] = []
        self.procs: list[tuple[str, int, Any]] = []
        self.finished: set[tuple[str, int]] = set()
        self.trajs: list[TrajectoryChannel] = []
        self.value: Any = None
        self.final_state: Any = None
        self.returned = False

    def run(self) -> Any:
        try:
            self._start()
            self._loop()
        finally:
            self._shutdown()
        return unwrap(self.value, self.final_state)

    # -- start ---------------------------------------------------------------------------------
    def _start(self) -> None:
        plan, ctx = self.plan, self.ctx
        self.stop = ctx.Event()
        self.results = ctx.Queue()
        init = ctx.Queue()
        lock = ctx.Lock()
        ready = ctx.Semaphore(0)
        handles = []
        for k in range(plan.actors):
            h, seg = TrajectoryChannel.create(ctx, f"trajectory[{k}]", list(plan.piece_specs), plan.capacity, ready)
            self.segments.append(seg)
            handles.append(h)
            self.trajs.append(TrajectoryChannel(h, seg))
        param = None
        if plan.read_paths:
            param, seg = ParamChannel.create("parameters", list(plan.param_specs), plan.param_depth)
            self.segments.append(seg)
        control_seg = Control.create()
        self.segments.append(control_seg)
        self.control = Control(control_seg, lock, self.stop)
        from fragflow.runtime import worker

        common = (plan, handles, param, control_seg.name, lock, self.stop, self.results, init, 1)
        roles = [("learner", 0)] + [("actor", k) for k in range(plan.actors)]
        with _no_main_reimport():
            for role, k in roles:
                p = self.ctx.Process(target=worker.main, args=(role, k, *common), name=f"fragflow-{role}-{k}",
                                     daemon=True)
                p.start()
                self.procs.append((role, k, p))
        self._init_queue = init

    # -- monitor loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_stats = time.monotonic() + STATS_EVERY
        try:
            while len(self.finished) < len(self.procs) or not (self.returned and self.final_state is not None):
                try:
                    msg = self.results.get(timeout=0.1)
                except queue.Empty:
                    self._check_alive()
                    continue
                self._handle(msg)
                if time.monotonic() >= next_stats:
                    next_stats = time.monotonic() + STATS_EVERY
                    self.monitor.channels(self.channel_stats())
        except StopRun:
            self.stop.set()
            raise
        finally:
            self.monitor.channels(self.channel_stats())

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "steps":
            self.monitor.env_step(msg[2], msg[3])
        elif kind == "update":
            self.monitor.update()
            if msg[2]:
                self.monitor.log_scalars(msg[2])
        elif kind == "actor_log":
            self.monitor.log_scalars(msg[1])
        elif kind == "return":
            self.value = cloudpickle.loads(msg[1]) if msg[1] is not None else None
            self.returned = True
        elif kind == "final":
            self.final_state = cloudpickle.loads(msg[1])
        elif kind in ("done", "stopped"):
            self.finished.add((msg[1], msg[2]))
        elif kind == "error":
            _, role, index, fragment, tb, blob = msg
            exc = WorkerFailed(role, index, fragment, tb)
            cause = None
            if blob is not None:
                try:
                    cause = cloudpickle.loads(blob)
                except Exception:
                    cause = None
            from fragflow.errors import FragflowError

            if isinstance(cause, FragflowError):
                raise cause
            raise exc from cause

    def _check_alive(self) -> None:
        for role, k, p in self.procs:
            if (role, k) not in self.finished and p.exitcode is not None:
                # drain: an error message may be in flight
                try:
                    while True:
                        self._handle(self.results.get(timeout=0.2))
                except queue.Empty:
                    pass
                if (role, k) in self.finished:
                    continue
                who = "learner" if role == "learner" else f"actor {k}"
                code = p.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise WorkerDied(f"{who} process {how} without reporting an error")

    def channel_stats(self) -> dict[str, Any]:
        stats = [t.stats() for t in self.trajs]
        words = self.control.words
        merged = {
            "depth": sum(s["depth"] for s in stats), "items": sum(s["gets"] for s in stats),
            "bytes": sum(s["bytes"] for s in stats), "drops": sum(s["drops"] for s in stats),
            "put_wait_s": sum(s["put_wait_s"] for s in stats),
            "lag_histogram": [sum(s["lag_histogram"][i] for s in stats) for i in range(len(stats[0]["lag_histogram"]))],
            "learner_wait_s": int(words[WAIT_NS]) / 1e9, "learner_busy_s": int(words[LEARN_NS]) / 1e9,
            "learner_updates": int(words[UPDATES]), "admission_wait_s": int(words[ADMIT_WAIT_NS]) / 1e9,
        }
        return {"trajectory": merged}

    # -- shutdown --------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        stop = getattr(self, "stop", None)
        if stop is not None:
            stop.set()
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
        for q in (getattr(self, "results", None), getattr(self, "_init_queue", None)):
            if q is not None:
                q.close()
                q.cancel_join_thread()
        for t in self.trajs:
            t.detach()
        if getattr(self, "control", None) is not None:
            self.control.detach()
        for seg in self.segments:
            seg.close()
            seg.unlink()
        self.segments.clear()


def execute(plan: RunPlan, monitor: Monitor) -> Any:
    return Driver(plan, monitor).run()
