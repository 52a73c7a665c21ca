"""Metrics rows where one learner gathers its loop replicas' calls as they arrive (a mixin of
:class:`~fragflow.runtime.monitor.Monitor`): ``actor_learner(actors>=2, max_lag>=1)``,
``async_relaxed(actors>=2)``.

An update takes the calls that came first, not one of every replica's in order, so its row cannot
count the replicas' steps at their calls of that update (marks, as where calls are taken in order).
It counts, for each replica, the env steps it had made at its latest clock call the learner had
taken by then (learned from, or dropped as stale): the steps that update had learned from, as
single_process's row counts the steps made before its update, and the episodes each replica had
ended by those steps. The workers' reports come in batches (every 0.2 s), so what had reached the
driver when the update ended was none of that (a short run's rows all said 0 steps, or all the
run's last count).

The loop's replicas run the same loop and replica 0 speaks for them (as it logs the loop's own
values): the run's j-th update's row holds what replica 0 logged of its j-th clock call (of this
run), with the j-th update's values, so the rows are single_process's rows (a loop logging every
second update: every second row). A row waits until each replica's steps up to its count have been
heard and replica 0 has made its next clock call (what the loop logs of a call comes before it), or
has ended.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

MAX_HELD_ROWS = 4096   # rows held for the loops' reports: beyond it the oldest is written as it stands
RETURN_WINDOW = 20   # "solved" = mean return of the last 20 training episodes reaches the target


def ended_by(tagged: Sequence[Any], ended: Callable[[Any], bool], in_order: bool = True) -> int:
    """How many of the evaluation episodes ``tagged`` (each with replica 0's updates and steps when it
    ended, as reported: neither count goes back) a row takes: those ``ended`` holds for, which are
    the first ones (``ended`` asks whether they came by some updates and steps). Found by halving, as
    every row asks (a scan of them all made each row cost what the run had evaluated: a pipelined
    run with an evaluation every update fell from 4.9k to 1.4k steps/s over 60k steps); counted one
    by one where the reports came out of order (``in_order`` False)."""
    if not in_order:
        return sum(1 for e in tagged if ended(e))
    return bisect_left(tagged, True, key=lambda e: not ended(e))


def ended_returns(tagged: Sequence[Any], n: int) -> list[float]:
    """The returns (each entry's third item) of the last of the first ``n`` evaluation episodes that a
    row's mean takes."""
    return [e[2] for e in tagged[max(0, n - RETURN_WINDOW):n]]


class ArrivalRows:
    """The rows of an arrival-gathered run (the attributes below are the monitor's)."""

    arrival: bool = False   # set by execute(): one learner gathers several replicas' calls on arrival
    outputs: Any
    updates: int
    base_updates: int
    base_steps: int
    _pending: dict[str, float] | None
    _early: dict[int, dict[str, float]]
    _ended: set[int]
    _runtime_row: Any
    _evals_in_order: bool
    _episode_columns: Any
    _ended_by: Any
    _eval_columns: Any
    _eval_mean: Any
    _loop_rows: dict[int, list[tuple[int, dict[str, float]]]]
    base_eval_episodes: int
    log_scalars: Any
    steps_rate: Any

    def _arrival_init(self) -> None:
        # rows in order: (row, each replica's steps at its latest call taken, whether it is an update's)
        self._held: list[tuple[dict[str, float], dict[int, int] | None, bool]] = []
        self._heard_from: dict[int, tuple[int, int]] = {}   # replica -> (its steps heard, its last clock call heard)
        self.first_call0: int | None = None   # loop replica 0's first clock call (number) of this run
        # this run's update -> values replica 0 logged after it of a non-clock fragment's calls not heard yet
        self._awaited: dict[int, int] = {}
        self._first_update0 = 0   # replica 0's update count at its first clock call of this run
        self._steps0: dict[int, int] = {}   # replica 0's update count at a clock call -> its env steps then
        # the evaluation episodes, as replica 0 reports them: (its updates and env steps then, return)
        self._eval_at: list[tuple[int, int, float]] = []
        self._last_taken: dict[int, int] = {}   # each replica's steps in the last update row written

    def row_awaits(self, update: int, new_row: bool = False) -> None:
        """The row of this run's ``update``-th update (``new_row``: a row of the loop's own after it,
        written before the next update's) waits for a value the loop logged of a call whose outputs
        have not reached the driver (see :meth:`row_answered`)."""
        j = update + 1 if new_row else update
        if j > 0:
            self._awaited[j] = self._awaited.get(j, 0) + 1

    def row_answered(self, update: int, new_row: bool = False) -> None:
        """A value the row waited for came (or never will: its call was dropped as stale)."""
        j = update + 1 if new_row else update
        if self._awaited.get(j, 0) > 1:
            self._awaited[j] -= 1
        elif self._awaited.pop(j, None) is not None:
            self._drain_held()

    def heard_from(self, replica: int, steps: int, marks: list[tuple[int, int, int, int]]) -> None:
        """The driver has heard ``steps`` env steps of loop replica ``replica`` and the marks of its
        report: (its updates, steps and episodes at a clock call, the clock's call number)."""
        old = self._heard_from.get(replica, (0, -1))
        self._heard_from[replica] = (max(old[0], steps), max([old[1], *(m[3] for m in marks)]))
        if replica == 0 and marks:
            if self.first_call0 is None:
                self.first_call0, self._first_update0 = min(m[3] for m in marks), min(m[0] for m in marks)
            self._steps0.update((m[0], m[1]) for m in marks)
        self._drain_held()

    def arrived_update(self, taken: tuple[int, ...] | None) -> None:
        """An update of an arrival-gathered run: ``taken``, each replica's steps at its latest clock
        call the learner had taken (None: not known, the steps heard are counted)."""
        self.updates += 1
        self._hold_pending()
        row = self._runtime_row()
        row.update(self._early.pop(self.updates - self.base_updates, {}))   # (the loop's values that came first)
        self._held.append((row, None if taken is None else dict(enumerate(taken)), True))
        self._pending = row
        self._drain_held()

    def log_into(self, update: int, scalars: dict[str, float]) -> None:
        """Values for this run's ``update``-th update's row: into it, else (written already: the
        loop logged them after its next clock call) into the current one."""
        for row, _, _ in self._held:
            if int(row["updates"]) - self.base_updates == update:
                row.update(scalars)
                return
        self.log_scalars(scalars)

    def _hold_pending(self) -> None:
        """The current row is complete but for the loops' reports: it waits with the rows before it."""
        pending, self._pending = self._pending, None
        if pending is not None and not any(row is pending for row, _, _ in self._held):
            self._held.append((pending, None, False))   # (the loop's own values, before the first update)
        self._drain_held()

    def _ready(self, row: dict[str, float], taken: dict[int, int] | None, update: bool) -> bool:
        if taken is not None and not all(r in self._ended or self._heard_from.get(r, (0, -1))[0] >= s
                                          for r, s in taken.items()):
            return False
        if not update:
            return True
        j = int(row["updates"]) - self.base_updates   # (replica 0's call first_call0 + j - 1 is this row's)
        if j in self._awaited:
            return False
        if 0 in self._ended:
            return True
        return self.first_call0 is not None and self._heard_from[0][1] >= self.first_call0 + j

    def _drain_held(self, force: bool = False) -> None:
        while self._held:
            row, taken, update = self._held[0]
            if not force and (row is self._pending or
                              (not self._ready(row, taken, update) and len(self._held) <= MAX_HELD_ROWS)):
                return
            self._held.pop(0)   # (taken first: a Ctrl-C in the write cannot write it twice)
            if row is self._pending:
                self._pending = None
            if update:   # (the loop's own rows before it: what replica 0 logged after env steps)
                self._arrival_loop_rows(int(row["updates"]) - self.base_updates, taken)
            if taken is not None:
                row["env_steps"] = self.base_steps + sum(taken.values())
                self._episode_columns(row, self._ended_by(taken))
                self._last_taken = dict(taken)
            row.update(self._evaluated_by(row, update))
            self.steps_rate(row)
            if self.outputs is not None:
                self.outputs.write_row(row)

    def _evaluated_by(self, row: dict[str, float], update: bool) -> dict[str, float]:
        """The evaluation columns of an update's row: the episodes replica 0 (which steps and reports
        them) ended from its first clock call of this run to the step after its call of the row's
        update, as single_process's row holds them (not those heard when the row is written: held
        rows were written together, each with the run's last count)."""
        j = int(row["updates"]) - self.base_updates
        at = self._first_update0 - 1 + j
        if not update or j <= 0 or self.first_call0 is None or at not in self._steps0:
            return self._eval_columns()   # (the loop's values before the first update, or a run cut short)
        steps = self._steps0[at]
        for u in [u for u in self._steps0 if u < at]:   # (rows are written in order)
            del self._steps0[u]
        n, evals = self._evaluated_at(at, steps)
        return {"eval_episodes": self.base_eval_episodes + n, "eval_return_mean": self._eval_mean(evals)}

    def _arrival_loop_rows(self, before: int, taken: dict[int, int] | None) -> None:
        """The loop's own rows of this run's updates before ``before``: values replica 0 logged after
        an env step (with ``ff.log`` or of a fragment's call), each a row of its own as
        single_process writes it, at replica 0's steps then; each replica is counted at those steps,
        within what the rows around it count (the replicas drift apart), so the steps never go back."""
        for u in sorted(x for x in self._loop_rows if x < before):
            for steps, scalars in self._loop_rows.pop(u):
                if not scalars:   # (made for a call's values that never came: dropped as stale)
                    continue
                row = self._runtime_row()
                row["updates"] = self.base_updates + u
                replicas = set(taken or ()) | set(self._heard_from) | set(self._last_taken)
                at = {r: max(self._last_taken.get(r, 0),
                             min(steps, taken[r] if taken and r in taken else self._heard_from.get(r, (steps, 0))[0]))
                      for r in replicas}
                row["env_steps"] = self.base_steps + sum(at.values())
                self._episode_columns(row, self._ended_by(at))
                mark = self._first_update0 - 1 + u   # (replica 0's update count then, as its evaluations are tagged)
                n, evals = self._evaluated_at(mark, steps)
                if self._eval_at or self.base_eval_episodes:
                    row["eval_episodes"] = self.base_eval_episodes + n
                    row["eval_return_mean"] = self._eval_mean(evals)
                row.update(scalars)
                self.steps_rate(row)
                if self.outputs is not None:
                    self.outputs.write_row(row)

    def _evaluated_at(self, update: int, steps: int) -> tuple[int, list[float]]:
        """How many evaluation episodes replica 0 had ended by its ``update``-th clock call and
        ``steps``-th training env step after it, and the last returns of them the row's mean takes."""
        n = ended_by(self._eval_at, lambda e: e[0] < update or (e[0] == update and e[1] <= steps), self._evals_in_order)
        return n, ended_returns(self._eval_at, n)

