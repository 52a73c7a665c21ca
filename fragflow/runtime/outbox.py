"""A worker's reports to the driver, batched: one put every ``REPORT_EVERY`` seconds.

Both kinds of worker report to the driver on a queue (a loop replica its counts, each update's mark
and what the loop logs; a service group its updates and logged values). A put wakes the queue's
feeder thread, which takes the GIL from the loop or the learner for a few hundred microseconds: a
put per update cost 1.9 s of 20.5 s in a profile of pipelined SAC's actor, 0.24 s of 8.8 s of
DQN's, and a fifth of a pipelined A2C learner's time. So reports go into an :class:`Outbox`, in
order, and are sent whole (``("batch", [...])``, which the driver takes report by report) when
``REPORT_EVERY`` has passed since the last send, and wherever the driver must have all of them (a
checkpoint's part, the end, a stop or a failure: the owner calls :meth:`Outbox.send`).
"""

from __future__ import annotations

import time
from typing import Any

REPORT_EVERY = 0.2   # seconds between a worker's sends of its reports to the driver


class Outbox:
    """Reports to the driver not sent yet, in order, and when they are next due."""

    def __init__(self, results: Any) -> None:
        self.results = results                   # the worker's report queue (its ``put``)
        self.items: list[tuple[Any, ...]] = []
        self.next = time.monotonic() + REPORT_EVERY

    def add(self, msg: tuple[Any, ...]) -> None:
        self.items.append(msg)

    def due(self) -> bool:
        """Whether ``REPORT_EVERY`` has passed since the last send."""
        return time.monotonic() >= self.next

    def send(self) -> None:
        """Send every report not sent yet, in one put (a lone report as it is)."""
        if self.items:
            self.results.put(self.items[0] if len(self.items) == 1 else ("batch", self.items))
            self.items = []
        self.next = time.monotonic() + REPORT_EVERY
