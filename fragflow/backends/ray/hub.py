"""The run's hub on Ray: one asynchronous actor that holds every channel of a run.

Trajectory rings, parameter broadcasts, the balance controller's counters, the report queue and the
definition queues live in this actor's memory; the run's processes (Ray actors too) reach them by
method calls. The actor runs its methods on one event loop, so each call is atomic (a producer's
``put`` is queued whole or not at all, which is why a killed producer leaves nothing to repair),
and a call that has to wait (a full ring, a version not yet published) awaits without blocking the
others. The semantics are those of the local backend's shared-memory channels, item for item:
versions, tags and tickets travel with each item, releases are in order, counters and the lag
histogram are the same.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

LAG_BINS = 16
STOPPED = "__fragflow_stopped__"
CLOSED = "__fragflow_closed__"


class _Ring:
    __slots__ = ("capacity", "items", "taken", "puts", "gets", "drops", "bytes", "put_wait_ns", "lags", "closed",
                 "changed", "group", "epoch")

    def __init__(self, capacity: int, group: str | None) -> None:
        self.capacity = capacity
        self.items: collections.deque[tuple[int, int, int, int, list[Any], int, int]] = collections.deque()
        self.taken = 0                  # items at the front the consumer has taken and not released
        self.puts = self.gets = self.drops = self.bytes = self.put_wait_ns = 0
        self.lags = [0] * LAG_BINS
        self.closed = False
        self.changed = asyncio.Condition()
        self.group = group              # the consuming group (its wait_any wakes on a put)
        self.epoch = 0                  # the producer's incarnation: a put of a dead producer is discarded


class Hub:
    """One run's channels (see the module docstring). Created by :class:`RayBackend.wire`."""

    def __init__(self, rings: dict[str, tuple[int, str | None]], broadcasts: dict[str, int], clock_rings: list[str],
                 clock_state: str | None, queues: list[str], replicas: int) -> None:
        self.rings = {name: _Ring(cap, group) for name, (cap, group) in rings.items()}
        self.params: dict[str, dict[int, tuple[int, list[Any]]]] = {n: {} for n in broadcasts}
        self.depth = dict(broadcasts)
        self.latest = {n: -1 for n in broadcasts}
        self.published = asyncio.Condition()
        self.clock_rings = clock_rings
        self.clock_state = clock_state
        self.queues: dict[str, collections.deque[Any]] = {q: collections.deque() for q in queues}
        self.queue_changed = {q: asyncio.Event() for q in queues}
        self.ready = {g: asyncio.Event() for _, g in rings.values() if g is not None}
        self.stopped = False
        self.busy = 0
        self.in_production = 0
        self.per_replica = [0] * max(replicas, 1)
        self.tickets = 0
        self.wait_ns = self.learn_ns = self.updates = self.admit_wait_ns = 0
        self.checkpoint = 0
        self.checkpoint_at = 0   # (the loop's updates at the trip that cuts it: see Admission.checkpoint_at)
        self.cut = (0, 0)   # (checkpoint, the trip its loop replicas save their parts at)
        self.req = (0, 0)   # (an out-of-schedule request, the checkpoint that serves it: see request_seq)
        self.waits = [-1] * max(replicas, 1)   # the version each loop replica waits for (see Admission.waiting)
        self.released = False

    # -- rings ---------------------------------------------------------------------------------------
    async def put(self, name: str, leaves: list[Any], version: int, tag: int, aux: int, order: int, nbytes: int,
                  timeout: float | None, epoch: int = 0, steps: int = 0) -> Any:
        ring = self.rings[name]
        if epoch != ring.epoch:
            return True   # sent by a producer that has died since (it may still be in flight when it is fenced)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with ring.changed:
            try:
                await asyncio.wait_for(ring.changed.wait_for(lambda: len(ring.items) < ring.capacity or self.stopped),
                                       timeout)
            except asyncio.TimeoutError:
                return False
            if self.stopped:
                return STOPPED
            if epoch != ring.epoch:
                return True
            ring.items.append((version, tag, aux, order, leaves, nbytes, steps))
            ring.puts += 1
            ring.bytes += nbytes
            ring.put_wait_ns += int((loop.time() - t0) * 1e9)
            ring.changed.notify_all()
        if ring.group is not None:
            self.ready[ring.group].set()
        return True

    async def fence(self, name: str) -> tuple[int, int]:
        """The producer died: discard whatever it still has in flight; ``(new epoch, puts)``."""
        ring = self.rings[name]
        async with ring.changed:
            ring.epoch += 1
            ring.changed.notify_all()
        return ring.epoch, ring.puts

    def epoch_of(self, name: str) -> int:
        return self.rings[name].epoch

    async def close(self, name: str) -> None:
        ring = self.rings[name]
        async with ring.changed:
            ring.closed = True
            ring.changed.notify_all()
        if ring.group is not None:
            self.ready[ring.group].set()

    def peek(self, name: str) -> tuple[tuple[int, int, int, int, int] | None, tuple[bool, int, int, int]]:
        """The next item's (version, tag, aux, order, steps), or None; and the ring's state (see ``ring_state``),
        which a consumer asks next when there is nothing to take."""
        ring = self.rings[name]
        state = self.ring_state(name)
        if ring.taken >= len(ring.items):
            return None, state
        v, tag, aux, order, _, _, steps = ring.items[ring.taken]
        return (v, tag, aux, order, steps), state

    def try_get(self, name: str) -> tuple[int, list[Any]] | None:
        ring = self.rings[name]
        if ring.taken >= len(ring.items):
            return None
        item = ring.items[ring.taken]
        ring.taken += 1
        return item[0], item[4]

    async def get(self, name: str, timeout: float | None) -> Any:
        ring = self.rings[name]
        async with ring.changed:
            try:
                await asyncio.wait_for(ring.changed.wait_for(
                    lambda: ring.taken < len(ring.items) or ring.closed or self.stopped), timeout)
            except asyncio.TimeoutError:
                return None
        if ring.taken < len(ring.items):
            return self.try_get(name)
        return STOPPED if self.stopped else CLOSED

    async def release(self, name: str, lag: int | None, dropped: bool) -> None:
        ring = self.rings[name]
        async with ring.changed:
            ring.items.popleft()
            ring.taken -= 1
            ring.gets += 1
            if dropped:
                ring.drops += 1
            elif lag is not None:
                ring.lags[min(max(lag, 0), LAG_BINS - 1)] += 1
            ring.changed.notify_all()

    def ring_state(self, name: str) -> tuple[bool, int, int, int]:
        """(closed, available to take, depth, puts)."""
        ring = self.rings[name]
        return ring.closed, len(ring.items) - ring.taken, len(ring.items), ring.puts

    def stats(self, names: list[str]) -> list[dict[str, Any]]:
        out = []
        for name in names:
            r = self.rings[name]
            out.append({"depth": len(r.items), "puts": r.puts, "gets": r.gets, "drops": r.drops, "bytes": r.bytes,
                        "put_wait_s": r.put_wait_ns / 1e9, "lag_histogram": list(r.lags)})
        return out

    async def wait_any(self, group: str, timeout: float) -> None:
        event = self.ready[group]
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return
        event.clear()

    # -- broadcasts ----------------------------------------------------------------------------------
    async def publish(self, name: str, leaves: list[Any], version: int, stamp: int) -> None:
        slots = self.params[name]
        slots[version] = (stamp, leaves)
        for old in [v for v in slots if v <= version - self.depth[name]]:
            del slots[old]
        async with self.published:
            self.latest[name] = max(self.latest[name], version)
            self.published.notify_all()

    async def read(self, name: str, version: int | None, stamp: int | None) -> Any:
        async with self.published:
            while True:
                v = self.latest[name] if version is None else version
                slot = self.params[name].get(v)
                if v >= 0 and slot is not None and (stamp is None or slot[0] >= stamp):
                    return v, slot[1], slot[0]
                if version is not None and self.latest[name] >= version and slot is None:
                    return ("overwritten", self.depth[name])
                if self.stopped:
                    return STOPPED
                await self.published.wait()

    async def wait_for(self, name: str, version: int, timeout: float | None) -> Any:
        async with self.published:
            try:
                await asyncio.wait_for(self.published.wait_for(lambda: self.latest[name] >= version or self.stopped),
                                       timeout)
            except asyncio.TimeoutError:
                return None
        return STOPPED if self.latest[name] < version else self.latest[name]

    def latest_of(self, name: str) -> int:
        return self.latest[name]

    # -- admission (the balance controller) -----------------------------------------------------------
    async def admit(self, replica: int, max_lag: int) -> Any:
        assert self.clock_state is not None
        got = await self.wait_for(self.clock_state, 0, None)
        if got == STOPPED:
            return STOPPED
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        per_update = max(len(self.clock_rings), 1)
        pause = 2e-4
        while True:
            unconsumed = sum(len(self.rings[n].items) for n in self.clock_rings) - self.busy * per_update
            ahead = max(unconsumed, 0) + self.in_production
            if self.busy + ahead // per_update <= max_lag:
                self.in_production += 1
                self.per_replica[replica] += 1
                self.admit_wait_ns += int((loop.time() - t0) * 1e9)
                self.tickets += 1
                return self.latest[self.clock_state], self.tickets
            if self.stopped:
                return STOPPED
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def produced(self, replica: int) -> None:
        if self.per_replica[replica] <= 0:   # (a dead process's report that came after forget: nothing of it is owed)
            return
        self.in_production -= 1
        self.per_replica[replica] -= 1

    def forget(self, replica: int) -> None:
        self.in_production -= self.per_replica[replica]
        self.per_replica[replica] = 0
        self.waits[replica] = -1   # (a wait it was in: its restarted process waits anew)

    def set_busy(self, busy: bool) -> None:
        self.busy = int(busy)

    def add_wait(self, ns: int) -> None:
        self.wait_ns += ns

    def add_busy(self, ns: int) -> None:
        self.learn_ns += ns
        self.updates += 1

    def counters(self) -> dict[str, float]:
        return {"learner_wait_s": self.wait_ns / 1e9, "learner_busy_s": self.learn_ns / 1e9,
                "learner_updates": self.updates, "admission_wait_s": self.admit_wait_ns / 1e9}

    def request_checkpoint(self, seq: int, at: int = 0) -> None:
        self.checkpoint, self.checkpoint_at = seq, at

    def checkpoint_request(self) -> tuple[int, int]:
        return self.checkpoint, self.checkpoint_at

    def cut_trip(self, seq: int, trip: int) -> int:
        if self.cut[0] != seq:
            self.cut = (seq, trip)
        return self.cut[1]

    def request_seq(self, request: int, seq: int) -> int:
        if self.req[0] != request:
            self.req = (request, seq)
        return self.req[1]

    def waiting(self, replica: int, version: int) -> None:
        self.waits[replica] = version

    def waiting_for(self, replica: int) -> int:
        return self.waits[replica]

    def producing(self, replica: int) -> int:
        return self.per_replica[replica]

    def release_waits(self) -> None:
        self.released = True

    def waits_released(self) -> bool:
        return self.released

    # -- queues and the stop flag ---------------------------------------------------------------------
    def qput(self, name: str, obj: Any) -> None:
        self.queues[name].append(obj)
        self.queue_changed[name].set()

    async def qget(self, name: str, timeout: float | None) -> tuple[bool, Any]:
        q = self.queues[name]
        if not q:
            event = self.queue_changed[name]
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return False, None
        if not q:
            return False, None
        return True, q.popleft()

    async def stop(self) -> None:
        self.stopped = True
        async with self.published:
            self.published.notify_all()
        for ring in self.rings.values():
            async with ring.changed:
                ring.changed.notify_all()
        for event in self.ready.values():
            event.set()

    def is_stopped(self) -> bool:
        return self.stopped
