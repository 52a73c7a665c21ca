"""Summing a tensor across the learners of one machine through shared memory: ``multi_learner``'s
gradient all-reduce on the CPU, in place of gloo's ring over TCP.

One segment, made by the driver with the run's others: a word per learner (each on a cache line
of its own: how many barriers it has reached), then K + 1 slots of :data:`SLOT` bytes. Learner k
copies its tensor into slot k and reaches a barrier; then it sums the k-th of K stripes of the slots,
in rank order, into the last slot (so every learner gets the same sums, bit for bit, as gloo's
learners do), and reaches a second barrier; then it copies the sums out. A tensor larger than a
slot goes in rounds of a slot. Each learner also says, before the first barrier, how many values of
what size it sums: learners that differ are found there by every one of them alike (the caller
then says how they differ, rather than waiting for a round that never comes).

The barrier is a counter per learner that its learner alone writes: waiting is a read of the K
counters, spinning for a while (2 ms where the machine has a core for each of the run's processes,
0.1 ms where they share cores) and then sleeping, with a check of the caller's (another learner that
ended its run, the run's stop) every tenth of a second. Stores in program order are seen in that
order by another core only on x86-64 (TSO), where this is used; elsewhere the learners use gloo.

PPO's 135k-value gradient, 41 all-reduces an update (`benchmarks/multi_learner.py --gloo`): two
learners on 2 cores spent 16-23 ms of each update summing here against 102-109 ms with gloo; eight on
16 cores 57-104 ms against 137-155 ms, most of it the wait for the slowest learner.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import numpy as np

from fragflow.backends.local.shm import ALIGN, Segment

SLOT = 1 << 20          # bytes: a tensor larger than this is summed in rounds
LINE = ALIGN // 8       # int64 words per learner: one cache line each
SPIN_SECONDS = 1e-4     # read the counters this long before sleeping between reads, where the run's
SPIN_SPARE = 2e-3       # processes outnumber the machine's cores, else this long (a sleeper wakes late)
CHECK_EVERY = 0.1       # seconds between the caller's checks while waiting


def available() -> bool:
    """Whether this machine orders stores as the barrier needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def nbytes(world: int) -> int:
    return (world + 1) * ALIGN + (world + 1) * SLOT   # (a line of settings, one per learner; the slots)


def spin_for(processes: int) -> float:
    """How long a learner reads the counters before sleeping: longer where every one of the run's
    ``processes`` has a core of its own, where spinning takes no core another process needs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN_SPARE if cores > processes else SPIN_SECONDS


class SizesDiffer(Exception):
    """The learners sum tensors of different sizes (every one of them raises it, at the same sum)."""


class SharedSum:
    """Learner ``rank`` of ``world``'s side of the segment ``name`` (see the module's text)."""

    def __init__(self, name: str, rank: int, world: int) -> None:
        self.seg = Segment.attach(name)
        self.rank, self.world = rank, world
        self.spin = int(np.frombuffer(self.seg.mem, np.int64, 1, 0)[0]) / 1e9
        words = np.frombuffer(self.seg.mem, np.int64, world * LINE, ALIGN)
        self.counts = words[::LINE]              # each learner's barriers reached
        self.sizes = words.reshape(world, LINE)[:, 1:3]   # each learner's sum: values, bytes a value
        self.slots = np.frombuffer(self.seg.mem, np.uint8, (world + 1) * SLOT,
                                   (world + 1) * ALIGN).reshape(world + 1, SLOT)
        self.reached = int(self.counts[rank])   # (0 in a new segment)

    def sum(self, x: np.ndarray, check: Callable[[], None]) -> None:
        """Sum the contiguous 1-d array ``x`` in place across the learners (each calls it with its
        own). ``check`` is called every :data:`CHECK_EVERY` seconds of waiting for the others: it
        raises where one will never come. :class:`SizesDiffer` where the learners' sizes differ."""
        n, size = x.size, x.itemsize
        self.sizes[self.rank] = (n, size)
        per = SLOT // size
        for start in range(0, max(n, 1), per):
            chunk = x[start:start + per]
            m = chunk.size
            slot = self.slots[self.rank, :m * size].view(x.dtype)
            slot[:] = chunk
            self._barrier(check)
            if start == 0 and not (self.sizes == self.sizes[self.rank]).all():
                self._barrier(check)   # (every learner has read the sizes before any posts its next)
                raise SizesDiffer
            lo, hi = self.rank * m // self.world, (self.rank + 1) * m // self.world
            out = self.slots[self.world, lo * size:hi * size].view(x.dtype)
            np.copyto(out, self.slots[0, lo * size:hi * size].view(x.dtype))
            for k in range(1, self.world):
                out += self.slots[k, lo * size:hi * size].view(x.dtype)
            self._barrier(check)
            chunk[:] = self.slots[self.world, :m * size].view(x.dtype)

    def _barrier(self, check: Callable[[], None]) -> None:
        self.reached += 1
        goal = self.reached
        self.counts[self.rank] = goal
        counts = self.counts
        if counts.min() >= goal:
            return
        spin_until = time.perf_counter() + self.spin
        while time.perf_counter() < spin_until:
            if counts.min() >= goal:
                return
        pause, next_check = 2e-5, time.monotonic() + CHECK_EVERY
        while counts.min() < goal:
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
            if time.monotonic() >= next_check:
                check()
                next_check = time.monotonic() + CHECK_EVERY

    def close(self) -> None:
        self.counts, self.sizes = np.empty(0, np.int64), np.empty((0, 2), np.int64)   # (no view left on it)
        self.slots = np.empty((0, SLOT), np.uint8)
        self.seg.close()


def create(world: int, processes: int) -> Segment:
    """The driver's side: the segment for ``world`` learners of a run of ``processes`` (it unlinks
    it with the run's others)."""
    seg = Segment.create(nbytes(world))
    words = np.frombuffer(seg.mem, np.int64, (world + 1) * LINE, 0)
    words[:] = 0
    words[0] = int(1e9 * spin_for(processes))
    return seg

