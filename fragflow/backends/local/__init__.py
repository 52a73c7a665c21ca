"""The local backend: one process per group replica on this machine, channels in shared memory.

Rings are :class:`~.channels.TrajectoryChannel` (a bounded ring of pre-allocated slots, zero-copy
reads), broadcasts :class:`~.channels.ParamChannel` (a seqlock ring of versions), admission
:class:`~.control.Control`; reports and definitions go through ``multiprocessing`` queues. The
driver creates every segment and alone unlinks it; workers attach.
"""

from __future__ import annotations

import dataclasses
import mmap
import multiprocessing as mp
import multiprocessing.queues as mpq
import os
import queue
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from fragflow.backends.local import sharedsum
from fragflow.backends.local.channels import (
    ChannelHandles,
    ParamChannel,
    ParamHandles,
    Stopped,
    TrajectoryChannel,
    _acquire,
)
from fragflow.backends.local.control import Control
from fragflow.backends.local.shm import Segment, check_room, sweep_dead
from fragflow.errors import ConfigError

__all__ = ["BACKEND", "LocalBackend", "Stopped"]


def start_method(threads: int = 1) -> str:
    """How workers start: ``FRAGFLOW_START_METHOD`` (fork, forkserver or spawn), else fork on Linux.

    Fork starts a worker in milliseconds with the driver's modules already imported; spawn starts a
    fresh interpreter (about a second per worker, to import torch) and is the only choice on
    macOS and Windows. A process that imported JAX (multithreaded), that has used CUDA (a
    program whose state is on a GPU: a forked child cannot initialise CUDA again), or that runs on
    a machine with a GPU at all, starts its workers from a fork server instead: there torch's
    autograd engine starts a thread per GPU at the first backward pass (the trace's, in the
    driver), even for a program all on the CPU, and a forked child of that process refuses to run
    a backward pass of its own. So does a run whose workers compute with several torch threads
    (``threads``: the most any of its processes runs with, the placement's, ``FRAGFLOW_THREADS`` or
    the program's own): torch's OpenMP threads do not survive a fork, and a forked child of a
    process that has run a parallel kernel waits forever at its own first one.
    """
    method = given_start_method()
    if method:
        return method
    if not sys.platform.startswith("linux"):
        return "spawn"
    if "jax" in sys.modules:   # JAX runs threads of its own: a forked child of a JAX process may deadlock
        return "forkserver"
    if _cuda_initialized():   # a forked child cannot use CUDA once its parent has (the program's state is on a GPU)
        return "forkserver"
    if _gpu_present():   # autograd's threads: see above
        return "forkserver"
    if threads > 1:   # OpenMP's threads: see above
        return "forkserver"
    return "fork"


# What every worker imports: started from a fork server, a worker forks from a process that imported
# them once, instead of importing them itself (a pipelined run's start went from 9.7 s to 5.2 s; forked,
# 3.8 s). Not JAX: its threads are why the fork server is there.
_PRELOAD = ("numpy", "torch", "gymnasium", "cloudpickle", "fragflow.runtime.worker", "fragflow.runtime.service",
            "fragflow.runtime.loop", "fragflow.backends.local")


def given_start_method() -> str:
    """``FRAGFLOW_START_METHOD``, checked ("" when unset): a run checks it before it writes anything."""
    method = os.environ.get("FRAGFLOW_START_METHOD", "")
    if method and method not in mp.get_all_start_methods():
        raise ConfigError(f"FRAGFLOW_START_METHOD={method!r} is not available here",
                          fix=f"use one of: {', '.join(mp.get_all_start_methods())}, or unset it")
    return method


def context(method: str) -> Any:
    """The ``multiprocessing`` context that starts workers by ``method``."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        # only what the driver itself imported: a JAX program's workers need not import torch
        ctx.set_forkserver_preload(["__main__", *(m for m in _PRELOAD if m.split(".")[0] in sys.modules)])
    return ctx


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _gpu_present() -> bool:
    """Whether torch sees a GPU (asked through NVML, which leaves the process free to fork)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.device_count() > 0


class DirectQueue(mpq.Queue):
    """A ``multiprocessing`` queue whose ``put`` writes the report on the calling thread.

    The standard queue hands each item to a feeder thread, which pickles and writes it. In a
    worker whose main thread runs Python without blocking (an acting loop, a learner), that thread
    waits for the GIL, and every time the main thread lets it go (each numpy or torch call that
    releases it) wakes the waiting thread in vain, as the main thread takes it back first: on a
    pipelined DQN actor the first ``argmax`` of each step took about 10 us instead of 0.3 for
    long stretches of the run. A loop's and a learner's reports go out at most every 0.2 s
    (:mod:`fragflow.runtime.outbox`), so writing them here costs less than the feeder did; a large
    report (a loop's snapshot, a learner's final state) holds its thread while the driver reads it.
    Reading is the standard queue's. A report to a queue whose reading ends are all closed (the
    driver's, and the worker's own: :meth:`writing_only`) is dropped, as the feeder drops it."""

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:   # type: ignore[attr-defined]
            raise ValueError(f"Queue {self!r} is closed")
        if not self._sem.acquire(block, timeout):   # type: ignore[attr-defined]
            raise queue.Full
        data = ForkingPickler.dumps(obj)
        try:
            if self._wlock is None:   # type: ignore[attr-defined]
                self._writer.send_bytes(data)   # type: ignore[attr-defined]
            else:
                with self._wlock:   # type: ignore[attr-defined]
                    self._writer.send_bytes(data)   # type: ignore[attr-defined]
        except (BrokenPipeError, ConnectionResetError):
            self._sem.release()   # type: ignore[attr-defined]

    def writing_only(self) -> None:
        """Close this process's copy of the reading end (a worker's: it only writes). A worker forked
        later (a restart) holds a copy of every earlier queue's reading end too: the driver retires a
        queue only once its writer has ended, so no writer waits on such a copy."""
        if not self._reader.closed:   # type: ignore[attr-defined]
            self._reader.close()   # type: ignore[attr-defined]


class Reports:
    """The driver's end of the workers' reports: a queue per process.

    A ``multiprocessing`` queue that several processes write to shares one write lock among them:
    a process killed while it holds it (midway through a report) would leave every other
    process's reports blocked for good, and the run waiting for them. With a queue each, a killed
    process takes only its own queue down. Once the process has started, the driver closes its own
    copy of the queue's writing end (:meth:`started`), so the queue ends when the process does:
    what it sent whole is read, a report it died midway through ends the queue (EOF) instead of
    being waited for, and the queue is then dropped. :meth:`get` returns the next report of any
    process, taking the queues in turn; a restarted process gets a new queue from :meth:`new`.
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._queues: dict[str, Any] = {}
        self._turn = 0

    def new(self, process: str) -> Any:
        """A fresh queue for ``process`` (the one it had before, if any, is dropped)."""
        self.retire(process)
        q = self._queues[process] = DirectQueue(ctx=self._ctx)
        return q

    def started(self, process: str) -> None:
        """``process`` holds its queue now: the driver's writing end (``_writer``) is closed."""
        self._queues[process]._writer.close()

    def retire(self, process: str) -> None:
        """Stop reading ``process``'s queue: what is left in it is dropped, never waited for."""
        q = self._queues.pop(process, None)
        if q is not None:
            q.close()
            q.cancel_join_thread()
            for end in (q._reader, q._writer):
                if not end.closed:
                    end.close()

    def get(self, timeout: float) -> Any:
        """The next report of any process; ``queue.Empty`` after ``timeout`` seconds without one."""
        deadline = time.monotonic() + timeout
        while True:
            named = list(self._queues.items())
            for i in range(len(named)):
                process, q = named[(self._turn + i) % len(named)]
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    continue
                except (EOFError, OSError):   # its process has ended (midway through a report, or after)
                    self.retire(process)
                    continue
                self._turn = (self._turn + i + 1) % len(named)
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            if self._queues:   # sleep until one of them has something, or has ended (its reading end)
                wait([q._reader for q in self._queues.values()], left)
            else:
                time.sleep(left)

    def close(self) -> None:
        for process in list(self._queues):
            self.retire(process)


@dataclass
class LocalWiring:
    """Everything a worker needs to attach (picklable: names of segments and sync objects)."""

    rings: dict[str, ChannelHandles]
    consumers: dict[str, str]                 # ring -> consuming group
    broadcasts: dict[str, ParamHandles]
    clock_rings: list[str]
    clock_state: str | None
    control: str
    lock: Any
    stop: Any
    results: Any                              # the driver's Reports; a worker's copy: its own queue
    definitions: dict[str, Any]               # group -> queue
    ready: dict[str, Any]                     # group -> semaphore
    segments: list[Segment] = field(default_factory=list, repr=False)
    sums: str = ""                            # replicated learners' shared-memory sums (see sharedsum)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["segments"] = []                # the driver alone owns (and unlinks) the segments
        return state

    def attach(self) -> LocalEndpoints:
        return LocalEndpoints(self)

    def for_process(self, process: str) -> LocalWiring:
        """The wiring a worker process gets: ``results`` is its own report queue (see :class:`Reports`)."""
        return dataclasses.replace(self, results=self.results.new(process))

    def started(self, process: str) -> None:
        """``process`` has started: its report queue now ends when it does (see :class:`Reports`)."""
        self.results.started(process)

    def release(self) -> None:
        self.results.close()
        for q in self.definitions.values():
            q.close()
            q.cancel_join_thread()
            if q._thread is None:   # (never written to: no feeder thread closes its ends, kept till it is collected)
                q._reader.close()
                q._writer.close()
        for seg in self.segments:
            seg.close()
            seg.unlink()
        self.segments.clear()


class LocalEndpoints:
    def __init__(self, wiring: LocalWiring) -> None:
        self.wiring = wiring
        self.stop = wiring.stop
        self.results = wiring.results
        if isinstance(self.results, DirectQueue):   # (a worker's own report queue)
            self.results.writing_only()
        self.sums = wiring.sums
        self.rings: dict[str, Any] = {n: TrajectoryChannel.open(h, wiring.stop) for n, h in wiring.rings.items()}
        self.broadcasts: dict[str, Any] = {n: ParamChannel.open(h, wiring.stop) for n, h in wiring.broadcasts.items()}
        clock = [self.rings[n] for n in wiring.clock_rings]
        params = self.broadcasts.get(wiring.clock_state) if wiring.clock_state else None
        self.admission = Control(Segment.attach(wiring.control), wiring.lock, wiring.stop, clock, params)

    def definitions(self, group: str) -> Any:
        return self.wiring.definitions[group]

    def wait_any(self, group: str, timeout: float) -> None:
        """Sleep until a ring into ``group`` may have something (or ``timeout`` seconds)."""
        _acquire(self.wiring.ready[group], self.stop, timeout)

    def detach(self) -> None:
        for ring in self.rings.values():
            ring.detach()
        for b in self.broadcasts.values():
            b.detach()
        self.admission.detach()


class LocalBackend:
    name = "local"

    def __init__(self) -> None:
        self._ctx: Any = None

    @property
    def ctx(self) -> Any:
        if self._ctx is None:
            self._ctx = context(start_method())
        return self._ctx

    def wire(self, lowered: Any) -> LocalWiring:
        sweep_dead()   # (segments a run killed with its whole process group left behind)
        # before anything is made, or any worker started; besides the segments, the run's semaphores (two
        # per ring, a few per process's queues) take a page each there: a few pages each, and a margin
        processes = len(lowered.services) + lowered.loop.replicas
        rings = sum(len(s.rings) + len(s.replies) for s in lowered.services)
        check_room(segment_sizes(lowered), extra=(64 + 4 * (rings + processes)) * mmap.PAGESIZE)
        ctx = self._ctx = context(start_method(most_threads(lowered)))
        segments: list[Segment] = []
        wiring = LocalWiring({}, {}, {}, [], None, "", ctx.Lock(), ctx.Event(), Reports(ctx), {}, {}, segments)
        try:
            for service in lowered.services:
                wiring.definitions[service.group] = ctx.Queue()
                ready = wiring.ready[service.group] = ctx.Semaphore(0)
                for ring in service.rings:
                    h, seg = TrajectoryChannel.create(ctx, ring.name, list(ring.specs), ring.capacity, ready)
                    segments.append(seg)
                    wiring.rings[ring.name] = h
                    wiring.consumers[ring.name] = service.group
                    if ring.fragment == service.clock:
                        wiring.clock_rings.append(ring.name)
                for ring in service.replies:
                    h, seg = TrajectoryChannel.create(ctx, ring.name, list(ring.specs), ring.capacity, None)
                    segments.append(seg)
                    wiring.rings[ring.name] = h
                    wiring.consumers[ring.name] = "loop"
                for b in service.publish:
                    ph, seg = ParamChannel.create(b.state, list(b.specs), b.depth)
                    segments.append(seg)
                    wiring.broadcasts[b.state] = ph
                    if wiring.clock_state is None:
                        wiring.clock_state = b.state
            control = Control.create(lowered.loop.replicas)
            segments.append(control)
            wiring.control = control.name
            world = _learners(lowered)
            if _summed_here(lowered):
                sums = sharedsum.create(world, processes + 1)   # (and the driver)
                segments.append(sums)
                wiring.sums = sums.name
        except BaseException:
            wiring.release()
            raise
        return wiring

    def start(self, target: Any, args: tuple[Any, ...], name: str) -> Any:
        p = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        p.start()
        return p


def most_threads(lowered: Any) -> int:
    """The most torch threads a process of the run computes with: its group's (``FRAGFLOW_THREADS``
    overrides), or the count the program sets itself in its training function (the loop's process runs
    it again)."""
    from fragflow.runtime.worker import threads_for

    counts = [threads_for(lowered.loop.threads), *(threads_for(s.threads) for s in lowered.services)]
    return max(*counts, lowered.placed.graph.program_threads)


def segment_sizes(lowered: Any) -> list[tuple[str, int]]:
    """What :meth:`LocalBackend.wire` will make in shared memory for ``lowered``: (what, bytes) each."""
    sizes = []
    for service in lowered.services:
        for ring in (*service.rings, *service.replies):
            sizes.append((f"ring {ring.name} ({ring.capacity} slots)",
                          TrajectoryChannel.nbytes(list(ring.specs), ring.capacity)))
        for b in service.publish:
            sizes.append((f"broadcast of {b.state} ({b.depth} versions)", ParamChannel.nbytes(list(b.specs), b.depth)))
    sizes.append(("control", Control.nbytes(lowered.loop.replicas)))
    if _summed_here(lowered):
        sizes.append((f"the {_learners(lowered)} learners' gradient sums", sharedsum.nbytes(_learners(lowered))))
    return sizes


def _learners(lowered: Any) -> int:
    """How many learners all-reduce their gradients (multi_learner's K; 1: none)."""
    return max((s.world for s in lowered.services), default=1)


def _summed_here(lowered: Any) -> bool:
    """Whether the learners get a shared-memory segment to sum their gradients in: several of them,
    on x86-64, and FRAGFLOW_ALLREDUCE not gloo (a segment they would not use is not made)."""
    if _learners(lowered) <= 1 or not sharedsum.available():
        return False
    from fragflow.runtime.allreduce import setting

    return setting() != "gloo"


BACKEND = LocalBackend()
