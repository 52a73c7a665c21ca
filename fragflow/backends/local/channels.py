"""Channels between processes: a trajectory ring and a versioned parameter broadcast.

**TrajectoryChannel** - one producer, one consumer. A bounded queue of slots pre-allocated in
shared memory and sized from the traced edge spec. ``put`` copies a pytree into a free slot and
stamps it with the producer's parameter version; ``get`` hands the consumer zero-copy views of the
oldest item, valid until ``release``. Items leave in the order they came, but a slot is not chosen
round-robin: ``put`` takes the free slot released most recently, whose lines are most likely still
in cache (with a consumer that keeps up, the producer writes one hot slot over and over instead of
streaming through the whole ring). Two semaphores count free and filled slots. A shared
``ready`` semaphore (one for a group of channels) lets a consumer of several channels sleep until
any of them has data. Counters live in the segment header, so the driver reads depth, items,
bytes, drops and the lag histogram without asking either side.

**ParamChannel** - one writer, any number of readers, never blocking either. The last ``depth``
versions live in a ring of slots, each guarded by a sequence counter (a seqlock): the writer makes
the counter odd, writes, then makes it even; a reader copies the slot and retries if the counter
moved. Readers therefore never see a half-written set of weights, and can ask for an exact
version (deterministic policies) or the newest one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fragflow.backends import Stopped
from fragflow.backends.local.shm import Layout, Segment
from fragflow.compiler.pytree import TensorSpec, from_numpy

LAG_BINS = 16   # lag histogram: 0, 1, ..., 14, and 15 or more


class ChannelClosed(Exception):
    """The producer closed the channel and every item has been consumed."""


# header fields of a trajectory channel (int64 each)
_HEAD, _TAIL, _PUTS, _GETS, _DROPS, _BYTES, _CLOSED, _PUT_WAIT_NS, _TAKEN = range(9)
_LAGS = 9
_SLOT_OF = _LAGS + LAG_BINS      # then capacity words: slot of item i at [i % capacity]
# then capacity words: per slot, 1 + the number of the item last released from it (0: never used)
_SLOT_WORDS = 6           # version, item number, tag (the producer's call number), aux (a word for the producer),
                          # order (the producer's admission ticket: the consumer's first-come order across producers),
                          # steps (the environment steps the producer had made)
_SLOT_META = 64           # the leaves start one cache line into the slot, 64-byte aligned


def _header_words(capacity: int) -> int:
    return _SLOT_OF + 2 * capacity


SPIN_SECONDS = 5e-5   # poll this long before sleeping: a futex wake-up costs more than a short spin


def _round64(n: int) -> int:
    return -(-n // 64) * 64


def _traj_base(capacity: int) -> int:
    return _round64(_header_words(capacity) * 8)   # slots start after the header


def _traj_slot_bytes(layout: Layout) -> int:
    return _round64(_SLOT_META + layout.nbytes)


def _param_slot_bytes(layout: Layout) -> int:
    return _round64(_P_META + layout.nbytes)


def _acquire(sem: Any, stop: Any, timeout: float | None) -> bool:
    """Acquire ``sem``, waking every 50 ms to honour ``stop``; False on timeout."""
    if sem.acquire(block=False):
        return True
    spin_until = time.perf_counter() + SPIN_SECONDS
    while time.perf_counter() < spin_until:
        if sem.acquire(block=False):
            return True
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
        if sem.acquire(timeout=wait):
            return True
        if stop is not None and stop.is_set():
            raise Stopped
        if deadline is not None and time.monotonic() >= deadline:
            return False


@dataclass
class ChannelHandles:
    """What a process needs to open a channel: segment name, layout and synchronisation objects."""

    name: str
    segment: str
    layout: Layout
    capacity: int
    free: Any
    filled: Any
    ready: Any | None


class TrajectoryChannel:
    def __init__(self, handles: ChannelHandles, segment: Segment, stop: Any = None) -> None:
        self.h = handles
        self.name = handles.name
        self.layout = handles.layout
        self.capacity = handles.capacity
        self.stop = stop
        self.seg = segment
        self._bind_header(np.frombuffer(segment.mem, np.int64, _header_words(self.capacity), 0))
        self._base = _traj_base(self.capacity)
        self._slot_bytes = _traj_slot_bytes(self.layout)
        self._views: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}   # per slot, made on first use
        # The consumer may hold several items before releasing them (in order): it reads at its
        # own cursor, and ``tail`` only moves on release.
        self._next = int(self.header[_TAIL])

    def _bind_header(self, header: np.ndarray) -> None:
        self.header = header
        self._slot_of = header[_SLOT_OF:_SLOT_OF + self.capacity]
        self._released = header[_SLOT_OF + self.capacity:]

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def nbytes(specs: list[TensorSpec], capacity: int) -> int:
        """The size of the segment :meth:`create` makes for a ring of ``capacity`` slots of ``specs``."""
        return _traj_base(capacity) + capacity * _traj_slot_bytes(Layout.of(specs))

    @staticmethod
    def create(ctx: Any, name: str, specs: list[TensorSpec], capacity: int, ready: Any = None) -> tuple[ChannelHandles, Segment]:
        layout = Layout.of(specs)
        seg = Segment.create(TrajectoryChannel.nbytes(specs, capacity))
        seg.buf[:_traj_base(capacity)].fill(0)
        handles = ChannelHandles(name, seg.name, layout, capacity, ctx.Semaphore(capacity), ctx.Semaphore(0), ready)
        return handles, seg

    @staticmethod
    def open(handles: ChannelHandles, stop: Any = None) -> TrajectoryChannel:
        return TrajectoryChannel(handles, Segment.attach(handles.segment), stop)

    def _slot(self, item: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Metadata and leaf views of the slot holding item number ``item``."""
        k = int(self._slot_of[item % self.capacity])
        views = self._views.get(k)
        if views is None:
            off = self._base + k * self._slot_bytes
            views = (np.frombuffer(self.seg.mem, np.int64, _SLOT_WORDS, off),
                     self.layout.views(self.seg.buf, off + _SLOT_META))
            self._views[k] = views
        return views

    def _hottest_free_slot(self, head: int) -> int:
        """The free slot released most recently. Called after acquiring ``free``, so one exists;
        the consumer published its releases before releasing the semaphore."""
        tail = int(self.header[_TAIL])
        if tail == head and tail > 0:    # nothing queued: the last item's slot was the last released
            return int(self._slot_of[(tail - 1) % self.capacity])
        busy = {int(self._slot_of[i % self.capacity]) for i in range(tail, head)}
        free = [k for k in range(self.capacity) if k not in busy]
        return max(free, key=lambda k: int(self._released[k]))

    # -- producer ----------------------------------------------------------------------
    def put(self, leaves: list[Any], version: int, timeout: float | None = None, tag: int = 0, aux: int = 0,
            order: int = 0, steps: int = 0) -> bool:
        """Copy ``leaves`` into the next free slot; blocks while the ring is full (False on timeout).
        ``tag`` travels with the item (a producer numbers its calls across all its rings)."""
        t0 = time.perf_counter_ns()
        if not _acquire(self.h.free, self.stop, timeout):
            return False
        waited = time.perf_counter_ns() - t0
        head = int(self.header[_HEAD])
        self._slot_of[head % self.capacity] = self._hottest_free_slot(head)
        meta, views = self._slot(head)
        self.layout.write_views(views, leaves)
        meta[0] = version
        meta[1] = head
        meta[2] = tag
        meta[3] = aux
        meta[4] = order
        meta[5] = steps
        self.header[_HEAD] = head + 1
        self.header[_PUTS] += 1
        self.header[_BYTES] += self.layout.nbytes
        self.header[_PUT_WAIT_NS] += waited
        self.h.filled.release()
        if self.h.ready is not None:
            self.h.ready.release()
        return True

    def repair_producer(self) -> None:
        """The producer's process died: give back a free slot it had taken and not filled, and
        signal an item it had queued without saying so (the semaphores then match the counters again).
        Read twice, 2 ms apart, so a consumer caught between its counter and its semaphore is not
        mistaken for a loss."""
        def losses() -> tuple[int, int]:
            free = self.capacity - int(self.header[_HEAD] - self.header[_TAIL]) - self.h.free.get_value()
            filled = int(self.header[_HEAD] - self.header[_TAKEN]) - self.h.filled.get_value()
            return free, filled

        try:
            first = losses()
        except NotImplementedError:   # macOS has no sem_getvalue
            raise RuntimeError("this platform cannot read a semaphore's value, which repairing a ring "
                               "needs") from None
        for _ in range(100):          # until two readings agree (a consumer may be mid-release)
            time.sleep(0.002)
            again = losses()
            if again == first:
                break
            first = again
        lost_free, lost_filled = first
        for _ in range(max(lost_free, 0)):
            self.h.free.release()
        for _ in range(max(lost_filled, 0)):
            self.h.filled.release()
            if self.h.ready is not None:
                self.h.ready.release()

    @property
    def puts(self) -> int:
        """Items put so far (readable from any process): the head, which a put moves as it
        publishes the item (its ``puts`` counter comes just after)."""
        return int(self.header[_HEAD])

    def close(self) -> None:
        """No more items will come (the consumer drains what is queued)."""
        self.header[_CLOSED] = 1
        if self.h.ready is not None:
            self.h.ready.release()
        self.h.filled.release()   # wake a consumer blocked in get()

    # -- consumer ----------------------------------------------------------------------
    def try_get(self) -> tuple[int, list[Any]] | None:
        """(version, zero-copy leaves) of the oldest item, or None if the ring is empty."""
        if int(self.header[_HEAD]) == self._next:
            return None
        if not self.h.filled.acquire(block=False):
            return None
        return self._take()

    def get(self, timeout: float | None = None) -> tuple[int, list[Any]] | None:
        """Block until an item is queued. None on timeout; ChannelClosed once closed and drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if int(self.header[_HEAD]) == self._next and self.header[_CLOSED]:
                raise ChannelClosed(self.name)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _acquire(self.h.filled, self.stop, left):
                return None
            if int(self.header[_HEAD]) != self._next:
                return self._take()
            # woken by close(): loop to report the closed channel

    def _take(self) -> tuple[int, list[Any]]:
        meta, views = self._slot(self._next)
        self._next += 1
        self.header[_TAKEN] = self._next
        return int(meta[0]), self.layout.read_views(views)

    def peek_version(self) -> int | None:
        """Version of the next item this consumer would take, or None if there is none."""
        if int(self.header[_HEAD]) == self._next:
            return None
        return int(self._slot(self._next)[0][0])

    def peek(self) -> tuple[int, int, int, int, int] | None:
        """(version, tag, aux, order, steps) of the next item this consumer would take, or None if there is none."""
        if int(self.header[_HEAD]) == self._next:
            return None
        meta = self._slot(self._next)[0]
        return int(meta[0]), int(meta[2]), int(meta[3]), int(meta[4]), int(meta[5])

    @property
    def available(self) -> int:
        """Items queued that this consumer has not taken yet."""
        return int(self.header[_HEAD]) - self._next

    def memory(self) -> tuple[int, int]:
        """The addresses of this process's mapping of the slots, ``[lo, hi)``: a value a consumer keeps
        past ``release`` must not lie there (the producer writes the slot again)."""
        lo = int(self.seg.buf.__array_interface__["data"][0]) + self._base
        return lo, lo + self.capacity * self._slot_bytes

    def release(self, lag: int | None = None, dropped: bool = False) -> None:
        """Free the oldest slot (its views become invalid); record its lag or its drop."""
        tail = int(self.header[_TAIL])
        self._released[int(self._slot_of[tail % self.capacity])] = tail + 1
        self.header[_TAIL] = tail + 1
        self.header[_GETS] += 1
        if dropped:
            self.header[_DROPS] += 1
        elif lag is not None:
            self.header[_LAGS + min(max(lag, 0), LAG_BINS - 1)] += 1
        self.h.free.release()

    # -- metrics -----------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return int(self.header[_HEAD] - self.header[_TAIL])

    @property
    def queued(self) -> int:
        """Items put that the consumer has not taken yet (readable from any process)."""
        return int(self.header[_HEAD] - self.header[_TAKEN])

    @property
    def closed(self) -> bool:
        return bool(self.header[_CLOSED])

    def stats(self) -> dict[str, Any]:
        h = self.header
        return {"depth": int(h[_HEAD] - h[_TAIL]), "puts": int(h[_PUTS]), "gets": int(h[_GETS]),
                "drops": int(h[_DROPS]), "bytes": int(h[_BYTES]), "put_wait_s": int(h[_PUT_WAIT_NS]) / 1e9,
                "lag_histogram": [int(x) for x in h[_LAGS:_LAGS + LAG_BINS]]}

    def detach(self) -> None:
        self._views.clear()
        self._bind_header(np.zeros(_header_words(self.capacity), np.int64))
        self.seg.close()


# -- parameter broadcast ---------------------------------------------------------------------
_P_LATEST, _P_WRITES = 0, 1
_P_HEADER = 64
_P_META = 32   # per slot: sequence (odd while written), version, stamp, unused


@dataclass
class ParamHandles:
    name: str
    segment: str
    layout: Layout
    depth: int


# the longest sleep between two looks at a version not published yet: an actor waiting for the
# learner's next version wakes within it (1 ms cost pipelined A2C 5% and SAC 7% of their steps/s on
# two cores, against a few microseconds of CPU for each look while it waits)
VERSION_POLL_MAX = 1e-4


class ParamChannel:
    def __init__(self, handles: ParamHandles, segment: Segment, stop: Any = None) -> None:
        self.h = handles
        self.layout = handles.layout
        self.depth = handles.depth
        self.seg = segment
        self.stop = stop
        self.header = np.frombuffer(segment.mem, np.int64, 2, 0)
        self._slot_bytes = _param_slot_bytes(self.layout)
        self._cache: tuple[int, list[Any]] | None = None
        self._stamp = 0
        self._views: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self._leaves: dict[int, list[Any]] = {}

    @staticmethod
    def nbytes(specs: list[TensorSpec], depth: int) -> int:
        """The size of the segment :meth:`create` makes for ``depth`` versions of ``specs``."""
        return _P_HEADER + depth * _param_slot_bytes(Layout.of(specs))

    @staticmethod
    def create(name: str, specs: list[TensorSpec], depth: int) -> tuple[ParamHandles, Segment]:
        layout = Layout.of(specs)
        slot = _param_slot_bytes(layout)
        seg = Segment.create(ParamChannel.nbytes(specs, depth))
        seg.buf[:].fill(0)
        np.frombuffer(seg.mem, np.int64, 1, 0)[0] = -1   # nothing published yet
        for i in range(depth):
            np.frombuffer(seg.mem, np.int64, 3, _P_HEADER + i * slot)[1] = -1
        return ParamHandles(name, seg.name, layout, depth), seg

    @staticmethod
    def open(handles: ParamHandles, stop: Any = None) -> ParamChannel:
        return ParamChannel(handles, Segment.attach(handles.segment), stop)

    def _slot(self, version: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """The metadata and leaf views of ``version``'s slot (made once per slot)."""
        k = version % self.depth
        views = self._views.get(k)
        if views is None:
            off = _P_HEADER + k * self._slot_bytes
            views = self._views[k] = (np.frombuffer(self.seg.mem, np.int64, 3, off),
                                      self.layout.views(self.seg.buf, off + _P_META))
        return views

    def _leaf_views(self, version: int, data: list[np.ndarray]) -> list[Any]:
        """The leaves of ``version``'s slot as views (kept per slot) where every leaf is a CPU torch
        or numpy array; else copies, as :meth:`read` makes (a jax array made over the slot copies it
        asynchronously, after the sequence counter is checked: a torn read unseen)."""
        k = version % self.depth
        views = self._leaves.get(k)
        if views is None:
            specs = self.layout.specs
            if not all(s.backend in ("torch", "numpy") and s.device == "cpu" for s in specs):
                # (a jax array's copy first; a device leaf's copy to its device, a number's read, are done here)
                return [view.item() if s.backend == "python" else
                        from_numpy(view.copy() if s.backend == "jax" else view, s.backend, s.device)
                        for view, s in zip(data, specs)]
            views = self._leaves[k] = self.layout.read_views(data)
        return views

    @property
    def latest(self) -> int:
        """The newest published version (-1 before the first)."""
        return int(self.header[_P_LATEST])

    def publish(self, leaves: list[Any], version: int, stamp: int = 0) -> None:
        """Publish ``version``; ``stamp`` counts the writes of the state so far (a version written by
        several learner calls is published after each, with a growing stamp)."""
        meta, data = self._slot(version)
        meta[0] += 1                      # odd: slot being written
        meta[1] = -1
        self.layout.write_views(data, leaves)
        meta[2] = stamp
        meta[1] = version
        meta[0] += 1                      # even: slot consistent
        self.header[_P_LATEST] = version
        self.header[_P_WRITES] += 1

    def read(self, version: int | None = None, stamp: int | None = None) -> tuple[int, list[Any]]:
        """A private copy of ``version`` (default: the newest); with ``stamp``, of that version once
        published with at least that many writes (it waits for them). Retries a torn read."""
        return self._read(version, stamp, None)

    def read_into(self, version: int, stamp: int | None, fill: Callable[[list[Any]], Any]) -> Any:
        """``fill(leaves)`` on ``version``'s leaves as views of the slot (not copies: ``fill`` copies
        what it keeps, as into a module's tensors), once published with ``stamp`` writes as
        :meth:`read`; called again where a write raced with it. Returns what ``fill`` returned."""
        return self._read(version, stamp, fill)

    def _read(self, version: int | None, stamp: int | None, fill: Callable[[list[Any]], Any] | None) -> Any:
        pause = 2e-5
        while True:
            v = self.latest if version is None else version
            if v < 0:
                raise LookupError("no version published yet")
            if self._cache is not None and self._cache[0] == v and (stamp is None or self._stamp >= stamp):
                return self._cache if fill is None else fill(self._cache[1])
            meta, data = self._slot(v)
            before = int(meta[0])
            if before % 2 == 0 and int(meta[1]) == v:
                got = int(meta[2])
                if stamp is None or got >= stamp:
                    if fill is not None:
                        out = fill(self._leaf_views(v, data))
                        if int(meta[0]) == before and int(meta[1]) == v:
                            return out
                        continue
                    leaves = self.layout.read_views(data, copy=True)
                    if int(meta[0]) == before and int(meta[1]) == v:
                        self._cache, self._stamp = (v, leaves), got
                        return self._cache
                    continue
            elif version is not None and int(meta[1]) > v and before % 2 == 0:
                raise LookupError(f"version {v} was overwritten (ring depth {self.depth})")
            elif before % 2:
                continue   # a write of this slot raced with the read: try again
            # the version (or its last writes) is not published yet
            if self.stop is not None and self.stop.is_set():
                raise Stopped
            time.sleep(pause)
            pause = min(pause * 2, VERSION_POLL_MAX)

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Sleep until ``latest >= version``; returns latest. Honours the stop event."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 2e-5
        while self.latest < version:
            if self.stop is not None and self.stop.is_set():
                raise Stopped
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"parameter version {version} not published in {timeout}s")
            time.sleep(pause)
            pause = min(pause * 2, VERSION_POLL_MAX)
        return self.latest

    def detach(self) -> None:
        self._cache = None
        self._views.clear()
        self._leaves.clear()
        self.header = np.zeros(2, np.int64)
        self.seg.close()
