"""How a service group takes its loop replicas' calls (a mixin of
:class:`~fragflow.runtime.service.ServiceRunner`): each replica's next call is the head of one of
its rings; ``ordered`` gathering goes round the replicas in order, ``arrival`` takes the oldest piece
(or, with balanced admission, the next admitted ticket's), until some fragment holds a piece from
every replica. A piece older than ``max_lag`` versions when taken goes to the channel's overflow
discipline; a checkpoint requested meanwhile is saved where every replica's calls before its cut
are in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fragflow.runtime import calls
from fragflow.runtime.loop import UNVERSIONED
from fragflow.runtime.replicas import ReplicaChecks

IDLE_WAIT = 0.05


class _Piece:
    __slots__ = ("replica", "version", "tag", "sid", "call", "cut", "leaves", "ring", "arrived", "own", "steps")

    def __init__(self, replica: int, version: int, tag: int, aux: int, leaves: list[Any], ring: Any,
                 own: int = 0, steps: int = 0) -> None:
        self.replica, self.version, self.tag, self.leaves, self.ring = replica, version, tag, leaves, ring
        self.steps = steps   # the env steps its replica had made when it made the call
        # updates its replica's earlier calls of the clock on the same rollout made (a learner called
        # several times on one rollout, or a learner of its own after it): not staleness, the algorithm's
        # own steps
        self.own = own
        # its skeleton; the fragment's call number in its loop; the loop's last checkpoint mark
        self.sid, self.call, self.cut = calls.unpack_aux(aux)
        self.arrived = time.monotonic()



class Gathering(ReplicaChecks):
    """Taking the loop replicas' calls (the attributes below are the runner's)."""

    endpoints: Any
    admission: Any
    saving: dict[str, Any]
    saved_seq: int
    version: int
    rings: list[dict[str, Any]]
    replies: dict[str, dict[int, tuple[Any, Any]]]
    next_tag: list[int]
    started: list[int | None]
    cuts: dict[int, dict[int, int]]
    _cursor: int
    taken_steps: list[int]
    _released: bool = False   # (see _release_if_stuck)
    _ticket: int
    _void: set[int]
    _own: dict[int, int]
    _take_definition: Callable[[bool], bool]
    _accept: Callable[[str, int], bool]
    _dropped: Callable[[str, int, int], None]
    _save: Callable[[int], None]
    _reports_due: Callable[[], None]

    def _head(self, k: int) -> tuple[int, str, Any, tuple[int, int, int, int, int]] | None:
        """Replica ``k``'s next call, if it has arrived: (tag, fragment, ring, meta)."""
        want = self.next_tag[k]
        for fragment, ring in self.rings[k].items():
            meta = ring.peek()
            if meta is not None and meta[1] == want:
                return want, fragment, ring, meta
        if not self.finished[k] and all(r.closed and r.available == 0 for r in self.rings[k].values()):
            self.finished[k] = True
        return None

    def _save_due(self) -> bool:
        if not self.saving.get("root"):
            return False
        if self.saving.get("cut_every"):
            return True   # the loops' marks say which (they cut on their own schedule: see worker._loop_saving)
        return self.admission.checkpoint_request() > self.saved_seq

    def _saved_where_loop_is(self, aux: int | None) -> int | None:
        """The checkpoint this group's part of is saved now, if any. A loop replica marks its calls
        after it saved its part (``calls.cut_mark``), and the replicas save at one trip: the states
        are saved just before the first marked call is taken, so they hold every update of the calls
        made before the parts and none after, and a resumed run does each update once. That holds
        where calls are taken round the replicas in order (one replica, or ``max_lag=0``, or ordered
        gathering): by the first marked call every earlier one is in. The driver may have asked for
        the next checkpoint since the loops cut this one, or the loops cut the next on their own
        schedule: the mark says which (the first checkpoint after the last one saved with that mark:
        the loops never run 127 checkpoints ahead of the service). Calls gathered as they arrive interleave across
        the cut: the states are saved as they stand, for the newest request. A loop that has ended
        has cut the checkpoint before, or never will (the driver gives it up)."""
        if self.program.producers != 1 and not self.program.ordered:
            return self.admission.checkpoint_request()
        if aux is None:   # nothing to take: saved where every replica's calls before its cut are in
            for seq in sorted(self.cuts, reverse=True):   # (a loop that makes no call of this group for a while)
                cuts = self.cuts[seq]
                if (seq > self.saved_seq and len(cuts) == self.program.producers and not any(self.pools.values())
                        and all(self.next_tag[k] >= tag for k, tag in cuts.items())):
                    return seq
            return None
        mark = calls.unpack_aux(aux)[2]
        if not mark:   # (before any cut)
            return None
        if self.saving.get("cut_every"):   # cut on the loops' own schedule: after the last one saved
            seq = self.saved_seq + (mark - calls.cut_mark(self.saved_seq)) % calls.CUT_MARKS
        else:   # asked for by the driver: the newest request, or one before it
            request = self.admission.checkpoint_request()
            seq = request - (calls.cut_mark(request) - mark) % calls.CUT_MARKS
        return seq if seq > self.saved_seq else None

    def _take(self, k: int, head: tuple[int, str, Any, tuple[int, int, int, int, int]]) -> _Piece | None:
        tag, fragment, ring, meta = head
        if self.program.ordered:
            self._calls_apart(k, fragment)
        self._stalled_since = time.monotonic()   # calls still come: nobody waits for good
        if self._save_due():
            seq = self._saved_where_loop_is(meta[2])
            if seq is not None:
                self._save(seq)
        item = ring.try_get()
        if item is None:   # the producer moved the head but has not released the semaphore yet
            item = ring.get()
        assert item is not None
        self.next_tag[k] = tag + 1
        self._calls_made[(k, fragment)] = calls.unpack_aux(meta[2])[1]
        version, leaves = item
        if version == UNVERSIONED:   # acted on no state: as fresh as the version that takes it
            version = self.version
        # the clock's updates on the same rollout before this call (its own earlier steps, or those a learner
        # of its own called after them follows): the algorithm's steps, not staleness (at most the updates
        # since its version: a loop that steps no counted env has every call "again")
        own = min(self._own.get(k, 0), max(self.version - version, 0)) if calls.again_of(meta[2]) else 0
        if not self._accept(fragment, self.version - version - own):
            ring.release(dropped=True)
            self._dropped(fragment, k, calls.unpack_aux(meta[2])[1])
            if fragment == self.program.clock:
                self._own[k] = own
                self.taken_steps[k] = max(self.taken_steps[k], meta[4])
            return None
        if fragment == self.program.clock:
            self._own[k] = own + 1
        piece = _Piece(k, version, tag, meta[2], leaves, ring, own, meta[4])
        self.pools.setdefault(fragment, []).append(piece)
        return piece

    def _next(self) -> str | None:
        """Take pieces until some fragment's pool is complete; its name, or None when every replica is done."""
        producers = self.program.producers
        while True:
            while self._take_definition(False):
                pass
            if self._save_due():
                seq = self._saved_where_loop_is(None)
                if seq is not None:
                    self._save(seq)
            if self.program.ordered:
                # strictly round the replicas in order: the run does not depend on scheduling
                k = self._cursor
                head = self._head(k)
                if head is None:
                    if all(self.finished):
                        self._ended_apart()
                        return None
                    if self.finished[k]:
                        # a call the others made that this finished replica never will: stop with the
                        # reason now (taking the next replica's next piece would pair two of its calls)
                        self._watch_stall()
                        self._cursor = (k + 1) % producers
                    else:
                        self._watch_stall()
                        self._reports_due()
                        self.endpoints.wait_any(self.program.group, IDLE_WAIT)
                    continue
            else:
                heads = [(k_, h) for k_ in range(producers) if (h := self._head(k_)) is not None]
                if not heads:
                    # nothing more has arrived: a request batch whose wait is over is answered as it is
                    due, wait = self._due()
                    if due is not None:
                        return due
                    if all(self.finished):
                        self._ended_apart()
                        return None
                    self._release_if_stuck()
                    self._watch_stall()
                    self._reports_due()
                    self.endpoints.wait_any(self.program.group, min(IDLE_WAIT, wait))
                    continue
                if any(h[3][3] for _, h in heads):
                    # admitted rollouts (the balance controller's tickets) are consumed in the order
                    # they were admitted: the controller's bound counted on it
                    ready = [kh for kh in heads if kh[1][3][3] <= self._ticket]
                    self._void -= {k_ for k_, _ in heads}
                    if not ready:
                        held = {k_ for k_, _ in heads}
                        if any(not self.finished[k_] and k_ not in held and k_ not in self._void
                               and self._producing(k_) for k_ in range(producers)):
                            self.endpoints.wait_any(self.program.group, IDLE_WAIT)   # being produced
                        elif all(self._head(k_) is None for k_ in range(producers) if k_ not in held):
                            self._ticket = min(h[3][3] for _, h in heads)          # admitted, never produced
                        continue   # (else a piece arrived since the heads were read: looked at again)
                    k, head = min(ready, key=lambda kh: (kh[1][3][3], kh[0]))
                    if head[1] == self.program.clock:
                        self._ticket = head[3][3] + 1
                else:
                    # the oldest piece first: it is the one closest to going stale
                    k, head = min(heads, key=lambda kh: (kh[1][3][0], kh[0]))
            piece = self._take(k, head)
            self._cursor = (k + 1) % producers
            fragment = head[1]
            if fragment == self.program.clock:
                self.started[k] = None
            if piece is not None and len(self.pools[fragment]) >= producers and not self._held(fragment):
                return fragment

    def _producing(self, k: int) -> bool:
        """Whether loop replica ``k`` holds an admission it has not yet put a rollout for. A replica
        restarted after its process died, once heard from again, is no longer void, but the ticket
        its dead process was admitted with will never come: with nothing in production (waiting to
        be admitted, which needs the learner to consume), waiting for it would deadlock the run."""
        producing = getattr(self.admission, "producing", None)
        return producing is None or producing(k) > 0

    def _release_if_stuck(self) -> None:
        """Gathered on arrival, nothing has come, a replica has ended its loop and every replica still
        running waits for a version past the newest: none can come (an update needs a piece only a
        waiting replica would send after it; a resumed run's replicas, saved at different trips, have
        different numbers of trips left, and the pieces sent before the cut but not learned from were
        not saved), so the run would wait for good. The waits are released, for the rest of the run and
        for every replica (a wait whose version has not come within two polls, 0.1 s, then acts with the
        newest version: see disciplines.Latest), and a piece a finished replica leaves unpaired at the
        end is dropped."""
        if self._released or not any(self.finished) or not hasattr(self.admission, "waiting_for"):
            return
        if len(self.pools.get(self.program.clock, ())) >= self.program.producers:
            return
        running = [k for k in range(self.program.producers) if not self.finished[k]]
        if running and all(self.admission.waiting_for(k) > self.version for k in running) and \
                all(self._head(k) is None for k in range(self.program.producers)):
            # (the pieces looked at again after the waits: a replica puts its piece before it waits, so
            # one put and then waited on since the caller looked is seen here, and nothing is released)
            self.admission.release_waits()
            self._released = True

    def _held(self, fragment: str) -> bool:
        """Served inference with a bound: an update that would leave a rollout still being acted
        more than ``max_lag`` versions behind when it is learned from waits for that rollout; not
        where that replica cannot send it: every slot of its clock ring holds a piece of the pool
        waiting here (they are freed only as the pool runs), and the rollout, too old once it comes,
        is dropped as the bound has it."""
        if fragment != self.program.clock or self.program.ordered:
            return False
        pooled = [p.replica for p in self.pools.get(fragment, ())]
        return any(s is not None and not self.finished[k] and self.version + 1 - s > self.program.max_lag
                   # (a ring that does not say its capacity: held as before)
                   and pooled.count(k) < getattr(self.rings[k][fragment], "capacity", float("inf"))
                   for k, s in enumerate(self.started))

    def _due(self) -> tuple[str | None, float]:
        """Bounded wait (arrival gathering): the request fragment whose batch is answered now, either
        complete (every replica still running has asked) or held ``batch_wait`` seconds since its
        first request; else None and the seconds until the next such deadline."""
        now, wait = time.monotonic(), IDLE_WAIT
        clock = self.pools.get(self.program.clock)
        if clock and len(clock) >= self.program.producers and not self._held(self.program.clock):
            return self.program.clock, 0.0     # was held for a rollout that has come in (or whose actor ended)
        for fragment, pool in self.pools.items():
            if not pool or fragment not in self.replies:
                continue
            asked = {p.replica for p in pool}
            if all(k in asked or self.finished[k] for k in range(self.program.producers)):
                return fragment, 0.0
            left = pool[0].arrived + self.program.batch_wait - now
            if left <= 0:
                return fragment, 0.0
            wait = min(wait, left)
        return None, wait
