"""The driver's side of checkpoints across processes: when it asks for one (a schedule in seconds,
in updates where the loops' calls are gathered as they arrive, Ctrl-C), how it stages the parts the
processes write, and when it commits one. Where every service takes the loops' calls in order or
one loop's, a schedule in updates is the loops' own (:attr:`DriverCheckpoints.cut_every`): they cut
at N, 2N, 3N, ... updates whatever this process's speed, and it commits each as its parts come in."""

from __future__ import annotations

import time
from typing import Any

STOP_CHECKPOINT_WAIT = 30.0   # Ctrl-C: how long the parts of the last checkpoint may take
CHECKPOINT_WAIT = 300.0       # a checkpoint whose parts have not all come by then is given up (and asked again)


class DriverCheckpoints:
    """Mixed into the driver (:class:`fragflow.runtime.multiprocess.Driver`), whose attributes these are."""

    checkpoints: Any
    lowered: Any
    monitor: Any
    endpoints: Any
    saving: dict[str, Any]
    finished: set[tuple[str, int]]
    _asked_at: float
    _asks: int

    @property
    def cut_every(self) -> int | None:
        """N, where the loops cut a checkpoint each time they have made N more updates, on their own:
        a schedule in updates, where every service takes their calls in order or one loop's (so that
        it saves its part at their cut). Each was asked for by this process once it had heard of the
        last cut, and a driver slow to hear of them (a loaded machine) got the first and the final
        one; cut where the loops are, they come at N, 2N, 3N, ... whatever this process's speed."""
        ck = self.checkpoints
        if ck is None or not ck.enabled or ck.schedule is None or ck.schedule.every.updates is None:
            return None
        if not all(s.ordered or s.producers == 1 for s in self.lowered.services):
            return None
        return int(ck.schedule.every.updates)

    def _staged(self, seq: int) -> bool:
        """Whether checkpoint ``seq`` is staged (a part of one the loops cut on their own schedule
        stages it, unless it was given up)."""
        ck = self.checkpoints
        if ck is None:
            return False
        if seq in ck.staging or not self.cut_every:
            return seq in ck.staging
        expected = {f"states.{s.group}" for s in self.lowered.services} | {
            f"loop{k}" for k in range(self.lowered.loop.replicas)}
        if not ck.adopt(seq, expected):
            return False
        ended = {f"loop{k}" for r, k in self.finished if r == "actor"}
        if ended & ck.missing(seq):
            ck.abort(seq)   # a replica whose loop has ended will not cut it
            return False
        return True

    def _checkpoint_due(self) -> None:
        """Ask every process for its part of a checkpoint when one is due (or Ctrl-C asked for one)."""
        ck = self.checkpoints
        if ck is None or not ck.enabled:
            return
        if self.cut_every:
            self._own_schedule_due()
            return
        newest = ck.staged
        if newest is not None:
            waited = time.monotonic() - self._asked_at
            if ck.stop_after and waited > STOP_CHECKPOINT_WAIT:
                ck.abort()
                raise KeyboardInterrupt
            if waited > CHECKPOINT_WAIT:   # a part that never came (its process was restarted meanwhile)
                ck.abort()
            return
        if not (ck.requested or ck.due(self.monitor.updates)):
            return
        loops = range(self.lowered.loop.replicas)
        if any(("actor", k) in self.finished for k in loops):
            if ck.stop_after:
                raise KeyboardInterrupt
            return
        if not ck.requested and ck.schedule is not None:
            ck.schedule.asked(self.monitor.updates)
        ck.requested = False
        expected = {f"states.{s.group}" for s in self.lowered.services} | {f"loop{k}" for k in loops}
        seq = ck.begin(expected)
        self._asked_at = time.monotonic()
        self.endpoints.admission.request_checkpoint(seq, 0)

    def _own_schedule_due(self) -> None:
        """The loops cut on their own schedule (see :attr:`cut_every`): this process commits each
        checkpoint as its parts come in, gives up one whose parts have not all come in
        ``CHECKPOINT_WAIT`` (the next comes on schedule), and asks for one out of schedule on Ctrl-C,
        cut at the loops' next trip."""
        ck = self.checkpoints
        assert ck is not None
        now = time.monotonic()
        for seq, begun in list(ck.begun.items()):
            if now - begun > CHECKPOINT_WAIT:   # a part that never came (its process was restarted meanwhile)
                ck.abort(seq)
        if ck.stop_after and self._asks and now - self._asked_at > STOP_CHECKPOINT_WAIT:
            ck.abort()
            raise KeyboardInterrupt
        if not ck.requested:
            return
        if any(("actor", k) in self.finished for k in range(self.lowered.loop.replicas)):
            if ck.stop_after:
                raise KeyboardInterrupt
            return
        ck.requested = False
        self._asks += 1
        self._asked_at = now
        self.endpoints.admission.request_checkpoint(self._asks, 0)

    def _checkpoint_part(self, msg: tuple[Any, ...]) -> None:
        """A process's part of a checkpoint came (written into the staging directory, or sent): the
        checkpoint is committed once every part is in."""
        if msg[0] == "ckpt_data":   # a part sent rather than written: write it into the staging directory
            _, seq, part, meta, arrays, info = msg
            ck = self.checkpoints
            staging = ck.directory(seq) if ck is not None and self._staged(seq) else None
            if staging is not None:
                from fragflow.runtime.checkpoint import save_part

                save_part(staging, part, meta, arrays)
                self._checkpoint_part(("ckpt", seq, part, meta, info))
            return
        _, seq, part, meta, info = msg
        ck = self.checkpoints
        if ck is not None and self._staged(seq) and ck.arrived(seq, part, meta, info):
            infos = ck.staging[seq][3]   # (the parts' infos)
            cuts = {(i.get("line"), i.get("trip")) for k, i in infos.items() if k.startswith("loop")}
            if self.saving.get("cut_together") and len(cuts) > 1:
                # replicas that wait for each other saved at different trips (one was past the trip
                # named, or in another loop): a resumed run could not go on; ask again at once (on
                # their own schedule, the loops cut the next when it comes)
                ck.abort(seq)
                ck.requested = ck.requested or not self.cut_every or bool(ck.stop_after)
                return
            at = {int(part[4:]): int(info["steps"]) for part, info in infos.items()
                  if part.startswith("loop") and "steps" in info}
            counters = (self.monitor.counters_at(at) if len(at) == self.lowered.loop.replicas
                        else self.monitor.counters())
            ck.complete(seq, counters, self.lowered.loop.replicas,
                        (self.monitor.base_steps, self.monitor.base_updates))
            # (Ctrl-C: stopped once the checkpoint cut at the loops' next trip is written, not one
            # they cut on their own schedule before they heard of it)
            # (replicas stepped together cut at one trip: one that had heard of the request when it cut is
            # enough, the others having taken the request as that checkpoint too, see worker's wanted)
            # (the loops cutting on their own, the next may be staged already, where writing one takes
            # longer than an update: it is not waited for, nor the schedule's till the 30 s ran out)
            if ck.stop_after and (any(int(i.get("asked", 0)) >= self._asks for k, i in infos.items()
                                      if k.startswith("loop")) if self.cut_every else not ck.staging):
                raise KeyboardInterrupt
