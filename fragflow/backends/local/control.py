"""Shared run control: the counters the balance controller and the driver read.

One small shared-memory block of int64 words plus a lock. The learner marks itself busy from the
moment it has a batch until the new version is published; actors under balanced admission count
the rollouts they have in production.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fragflow.backends.local.channels import ParamChannel, Stopped, TrajectoryChannel
from fragflow.backends.local.shm import Segment

BUSY, IN_PRODUCTION, WAIT_NS, LEARN_NS, UPDATES, ADMIT_WAIT_NS, TICKETS, CHECKPOINT, CUT_SEQ, CUT_TRIP, CUT_AT, \
    REQ, REQ_SEQ, RELEASED = range(14)
WORDS = 14
PER_REPLICA = 3


class Control:
    """The balance controller and the learner's counters (implements ``backends.Admission``).

    ``clock_rings`` are the rings of the calls that make updates (one per producer) and
    ``params`` the broadcast whose newest version an admitted producer acts with."""

    def __init__(self, segment: Segment, lock: Any, stop: Any, clock_rings: list[TrajectoryChannel] | None = None,
                 params: ParamChannel | None = None) -> None:
        self.seg = segment
        self.words = np.frombuffer(segment.mem, np.int64, len(segment.mem) // 8, 0)
        self.lock = lock
        self.stop = stop
        self.clock_rings = clock_rings or []
        self.params = params
        self.last_ticket = 0   # the admission order of this process's last admitted rollout
        self._replicas = max((len(self.words) - WORDS) // PER_REPLICA, 1)

    @staticmethod
    def nbytes(replicas: int = 1) -> int:
        """The size of the segment :meth:`create` makes."""
        return (WORDS + PER_REPLICA * max(replicas, 1)) * 8

    @staticmethod
    def create(replicas: int = 1) -> Segment:
        """The run's words, then three per loop replica: rollouts it was admitted and has not produced,
        the trip it last started (of the top-level loop it is in), and the version it waits for plus
        one (0: none)."""
        seg = Segment.create(Control.nbytes(replicas))
        seg.buf[:].fill(0)
        return seg

    def admit(self, replica: int, max_lag: int) -> int:
        """Wait until a new rollout's piece would be consumed within ``max_lag`` versions; return the
        version it must act with (the newest), counting the rollout as in production.

        The piece joins ``q`` pieces ahead of it (put and not yet consumed by the learner, whether
        still queued or already taken while the learner waits for the rest of a batch, or being
        produced by other actors); the learner consumes ``per_update`` per update and may be
        mid-update (``busy``, its pieces not counted in ``q``), so the piece is consumed
        ``busy + q // per_update`` versions after the newest one, which must be <= max_lag.
        """
        params, trajs, per_update = self.params, self.clock_rings, max(len(self.clock_rings), 1)
        assert params is not None
        params.wait_for(0)
        pause = 2e-5
        t0 = time.perf_counter_ns()
        while True:
            with self.lock:
                busy = int(self.words[BUSY])
                unconsumed = sum(t.depth for t in trajs) - busy * per_update
                ahead = max(unconsumed, 0) + int(self.words[IN_PRODUCTION])
                if busy + ahead // per_update <= max_lag:
                    self.words[IN_PRODUCTION] += 1
                    self.words[WORDS + replica] += 1
                    self.words[ADMIT_WAIT_NS] += time.perf_counter_ns() - t0
                    self.words[TICKETS] += 1
                    self.last_ticket = int(self.words[TICKETS])
                    return params.latest
            if self.stop.is_set():
                raise Stopped
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def detach(self) -> None:
        self.words = np.zeros(len(self.words), np.int64)
        self.seg.close()

    def produced(self, replica: int = 0) -> None:
        with self.lock:
            self.words[IN_PRODUCTION] -= 1
            self.words[WORDS + replica] -= 1

    def forget(self, replica: int) -> None:
        """A replica's process died: what it was admitted to produce will not come (the driver, before
        restarting it). A lock the dead process held is given back."""
        if not self.lock.acquire(timeout=1.0):
            self.lock.release()          # held by the dead process (a live one holds it for microseconds)
            self.lock.acquire()
        try:
            self.words[IN_PRODUCTION] -= self.words[WORDS + replica]
            self.words[WORDS + replica] = 0
            self.waiting(replica, -1)   # (a wait it was in: its restarted process waits anew)
        finally:
            self.lock.release()

    def set_busy(self, busy: bool) -> None:
        with self.lock:
            self.words[BUSY] = int(busy)

    def add_wait(self, ns: int) -> None:
        self.words[WAIT_NS] += ns

    def add_busy(self, ns: int) -> None:
        self.words[LEARN_NS] += ns
        self.words[UPDATES] += 1

    def request_checkpoint(self, seq: int, at: int = 0) -> None:
        """Ask every process for its part of checkpoint ``seq`` (the driver), cut once a loop replica
        has made ``at`` updates (see ``checkpoint_at``)."""
        self.words[CUT_AT] = at   # (first: a replica that sees the new request sees its update too)
        self.words[CHECKPOINT] = seq

    def checkpoint_request(self) -> int:
        """The newest checkpoint asked for (0: none yet)."""
        return int(self.words[CHECKPOINT])

    def checkpoint_at(self) -> int:
        """The updates a loop replica has made at the trip that saves its part of the newest request
        (0: at its next trip)."""
        return int(self.words[CUT_AT])

    def at_trip(self, replica: int, trip: int) -> None:
        """Loop replica ``replica`` starts ``trip`` (before it asks whether a checkpoint is wanted)."""
        self.words[WORDS + self._replicas + replica] = trip

    def cut_trip(self, seq: int, trip: int) -> int:
        """The trip at which every loop replica saves its part of checkpoint ``seq``: the first
        replica to ask sets it, past ``trip`` and past every trip a replica has started (one may be
        ahead of it), the others get it."""
        with self.lock:
            if int(self.words[CUT_SEQ]) != seq:
                ahead = int(self.words[WORDS + self._replicas:WORDS + 2 * self._replicas].max(initial=0)) + 1
                self.words[CUT_SEQ], self.words[CUT_TRIP] = seq, max(trip, ahead)
            return int(self.words[CUT_TRIP])

    def request_seq(self, request: int, seq: int) -> int:
        """The checkpoint that serves out-of-schedule request ``request`` (Ctrl-C's) where the loop
        replicas number their cuts themselves: the first replica to take it sets it (its next
        cut, ``seq``), the others get it (one that has cut it already counts it served)."""
        with self.lock:
            if int(self.words[REQ]) != request:
                self.words[REQ], self.words[REQ_SEQ] = request, seq
            return int(self.words[REQ_SEQ])

    def producing(self, replica: int) -> int:
        """Rollouts loop replica ``replica`` was admitted to make and has not yet put."""
        return int(self.words[WORDS + replica])

    def waiting(self, replica: int, version: int) -> None:
        """Loop replica ``replica`` waits for parameter version ``version`` (-1: no longer)."""
        self.words[WORDS + 2 * self._replicas + replica] = version + 1

    def waiting_for(self, replica: int) -> int:
        """The version loop replica ``replica`` waits for (-1: none)."""
        return int(self.words[WORDS + 2 * self._replicas + replica]) - 1

    def release_waits(self) -> None:
        """No version the replicas still wait for can come (see Gathering._release_if_stuck): they
        act with the newest from now on."""
        self.words[RELEASED] = 1

    def waits_released(self) -> bool:
        return bool(self.words[RELEASED])

    def counters(self) -> dict[str, float]:
        w = self.words
        return {"learner_wait_s": int(w[WAIT_NS]) / 1e9, "learner_busy_s": int(w[LEARN_NS]) / 1e9,
                "learner_updates": int(w[UPDATES]), "admission_wait_s": int(w[ADMIT_WAIT_NS]) / 1e9}
