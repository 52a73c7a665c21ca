"""Shared run control: the counters the balance controller and the driver read.

One small shared-memory block of int64 words plus a lock. The learner marks itself busy from the
moment it has a batch until the new version is published; actors under balanced admission count
the rollouts they have in production.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fragflow.runtime.channels import ParamChannel, Stopped, TrajectoryChannel
from fragflow.runtime.shm import Segment

BUSY, IN_PRODUCTION, WAIT_NS, LEARN_NS, UPDATES, ADMIT_WAIT_NS = range(6)
WORDS = 8


class Control:
    def __init__(self, segment: Segment, lock: Any, stop: Any) -> None:
        self.seg = segment
        self.words = np.frombuffer(segment.mem, np.int64, WORDS, 0)
        self.lock = lock
        self.stop = stop

    @staticmethod
    def create() -> Segment:
        seg = Segment.create(WORDS * 8)
        seg.buf[:].fill(0)
        return seg

    def admit(self, trajs: list[TrajectoryChannel], params: ParamChannel, per_update: int, max_lag: int) -> int:
        """Wait until a new rollout's piece would be consumed within ``max_lag`` versions; return the
        version it must act with (the newest), counting the rollout as in production.

        The piece joins ``q`` pieces ahead of it (queued and not yet taken by the learner, or being
        produced by other actors); the learner takes ``per_update`` per update and may be mid-update
        (``busy``), so the piece is consumed ``busy + q // per_update`` versions after the newest
        one, which must be <= max_lag.
        """
        params.wait_for(0)
        pause = 2e-5
        t0 = time.perf_counter_ns()
        while True:
            with self.lock:
                ahead = sum(t.queued for t in trajs) + int(self.words[IN_PRODUCTION])
                if int(self.words[BUSY]) + ahead // per_update <= max_lag:
                    self.words[IN_PRODUCTION] += 1
                    self.words[ADMIT_WAIT_NS] += time.perf_counter_ns() - t0
                    return params.latest
            if self.stop.is_set():
                raise Stopped
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def detach(self) -> None:
        self.words = np.zeros(WORDS, np.int64)
        self.seg.close()

    def produced(self) -> None:
        with self.lock:
            self.words[IN_PRODUCTION] -= 1

    def set_busy(self, busy: bool) -> None:
        with self.lock:
            self.words[BUSY] = int(busy)
