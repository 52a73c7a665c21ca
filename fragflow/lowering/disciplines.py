"""Staleness disciplines: objects a channel holds, one concern each.

=================  ================================================================================
version choice     which parameter version a producer acts with for its ``i``-th update:
                   ``exact`` (``max(0, i - max_lag)``, never newer: deterministic), ``latest`` (wait
                   for ``i - max_lag``, take the newest), ``balanced`` (wait until the balance
                   controller admits a rollout whose piece will be consumed within ``max_lag``
                   versions, take the newest)
gathering          how a consumer fed by several producer replicas forms one call: ``ordered`` (one
                   piece from every replica, in replica order) or ``arrival`` (the oldest pieces,
                   whoever made them)
overflow           what happens to a piece beyond the bound when it is consumed: ``drop`` (discard
                   and count), ``block`` (producers are admitted only while their pieces will be
                   fresh enough, so none goes beyond), ``deliver`` (consume it; its version and lag
                   reach the fragment through ``ff.delivered()``)
=================  ================================================================================

>>> Exact(max_lag=1).target(update=5)
4
>>> Drop().accept(lag=3, max_lag=2), Deliver().accept(lag=3, max_lag=2)
(False, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

WAIT_POLL = 0.05   # seconds between a waiting producer's looks at whether its wait was released


class VersionSource(Protocol):
    """What a version choice reads: the broadcast of the producer's parameters."""

    @property
    def latest(self) -> int: ...

    def wait_for(self, version: int, timeout: float | None = None) -> int: ...


class Admission(Protocol):
    """The balance controller: admits a producer's next rollout (and hears which version a
    producer waits for, see Latest)."""

    def admit(self, replica: int, max_lag: int) -> int: ...
    def waiting(self, replica: int, version: int) -> None: ...
    def waits_released(self) -> bool: ...


@dataclass(frozen=True)
class Exact:
    max_lag: int

    def target(self, update: int) -> int:
        return max(0, update - self.max_lag)

    def choose(self, update: int, params: VersionSource, admission: Admission | None, replica: int) -> int:
        v = self.target(update)
        params.wait_for(v)
        return v


@dataclass(frozen=True)
class Latest:
    max_lag: int

    def choose(self, update: int, params: VersionSource, admission: Admission | None, replica: int) -> int:
        target = max(0, update - self.max_lag)
        if admission is None:
            return params.wait_for(target)
        try:
            return params.wait_for(target, timeout=WAIT_POLL)
        except TimeoutError:
            pass
        # it waits on, and says so: where the other replicas have ended their loops (a resumed run's
        # replicas, saved at different trips, have different numbers of trips left, and the
        # rollouts sent before the cut and not yet learned from were not saved), the version may
        # never come, as the learner needs a piece it would send only after it; the learner then
        # releases the waits (Gathering._release_if_stuck) and it acts with the newest
        admission.waiting(replica, target)
        try:
            while True:
                try:
                    return params.wait_for(target, timeout=WAIT_POLL)
                except TimeoutError:
                    if admission.waits_released():
                        return params.latest
        finally:
            admission.waiting(replica, -1)


@dataclass(frozen=True)
class Balanced:
    max_lag: int
    admits = True   # the producer reports each admitted rollout as produced when it puts it

    def choose(self, update: int, params: VersionSource, admission: Admission | None, replica: int) -> int:
        assert admission is not None
        params.wait_for(0)
        return admission.admit(replica, self.max_lag)


@dataclass(frozen=True)
class Drop:
    def accept(self, lag: int, max_lag: int) -> bool:
        return lag <= max_lag


@dataclass(frozen=True)
class Deliver:
    def accept(self, lag: int, max_lag: int) -> bool:
        return True


Block = Deliver   # producers are held back before they put; what arrives is consumed

VERSION_CHOICE: dict[str, Any] = {"exact": Exact, "latest": Latest, "balanced": Balanced}
OVERFLOW: dict[str, Any] = {"drop": Drop, "deliver": Deliver, "block": Block}
GATHER = ("ordered", "arrival")
