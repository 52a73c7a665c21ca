"""The run monitor: counts environment steps and episodes, detects the target return, and feeds
the progress display and the run's outputs. Every executor reports to one monitor in the driver.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import Any

from fragflow.progress import ProgressDisplay
from fragflow.runtime.arrivalrows import RETURN_WINDOW, ArrivalRows, ended_by, ended_returns
from fragflow.runtime.episodelog import EpisodeLog
from fragflow.runtime.outputs import RunOutputs
from fragflow.runtime.scalars import flat_scalars


def _by_step(episode: tuple[int, int, float, int]) -> tuple[int, int]:
    """(the replica's env steps when it ended, the replica): a stable sort keeps the environments' order."""
    return episode[0], episode[1]


MAX_WAITING_ROWS = 100_000   # metrics rows held for their updates' marks (a few hundred bytes each)


def solves(recent: Sequence[float], target: float | None) -> bool:
    """Whether the last training returns ``recent`` reach ``target``: their mean, over a full window of
    ``RETURN_WINDOW`` episodes (what ``solved_at_*`` and ``--stop-on-target`` go by)."""
    return target is not None and len(recent) == RETURN_WINDOW and sum(recent) / RETURN_WINDOW >= target


class StopRun(BaseException):
    """Unwinds the training loop when the run is done early (target reached with stop_on_target)."""


class Monitor(ArrivalRows):
    def __init__(self, *, outputs: RunOutputs | None = None,
                 progress: ProgressDisplay | None = None, target_return: float | None = None,
                 stop_on_target: bool = False) -> None:
        self.outputs = outputs
        self.progress = progress
        self.target_return = target_return
        self.stop_on_target = stop_on_target
        self.env_steps = 0
        self.updates = 0
        self.episodes = EpisodeLog()    # (env_steps at end, return, length)
        self.recent: deque[float] = deque(maxlen=RETURN_WINDOW)
        self.recent_lengths: deque[int] = deque(maxlen=RETURN_WINDOW)
        self.eval_episodes: list[tuple[int, float, int]] = []     # (env_steps then, return, length)
        self.eval_recent: deque[float] = deque(maxlen=RETURN_WINDOW)
        self.base_eval_episodes = 0   # a resumed run's: those of the run it continues
        self.solved_at_seconds: float | None = None
        self.solved_at_steps: int | None = None
        self._start = time.perf_counter()
        self.replay_time: float | None = None   # events of a trace told afterwards: when they happened
        # where the clock starts before the program does (single_process: the trace is the run's
        # beginning), the rate counts from just before the loop's first env call (loop_begins; else its
        # first env steps heard of): when, and the steps then. The program's setup before its loop, its
        # imports, networks and optimizers, is not in it
        self.from_first_step = False
        self._first: tuple[float, int] | None = None
        self._next_refresh = 0.0
        self._pending: dict[str, float] | None = None
        # one process runs loop and learners: an update's row is complete when env steps come again.
        # Under several, another learner's metrics of the same update may come after the actors'
        # steps: the row waits for the next update.
        self.rows_end_at_steps = True
        # where each update takes one call of each of ``marked_replicas`` loop replicas, an update's
        # row counts the env steps and episodes those replicas had made at their calls (marks), as
        # single_process's row does, not what had reached the driver when the update ended
        self.marked_replicas = 0
        self._tagged: dict[int, EpisodeLog] = {}   # replica -> (its steps then, return, length)
        self._marks: dict[int, dict[int, tuple[int, int]]] = {}     # replica -> its update -> (steps, episodes)
        self._first_mark: dict[int, int] = {}
        self._waiting: list[dict[str, float]] = []
        self._ended: set[int] = set()   # loop replicas whose loop has ended
        self._early: dict[int, dict[str, float]] = {}   # values of updates the driver has not heard of yet
        self._late: dict[str, float] = {}   # ... of updates never made, their calls dropped as stale (see close)
        self._loop_rows: dict[int, list[tuple[int, dict[str, float]]]] = {}   # update -> (steps, the loop's values)
        self._eval_tagged: list[tuple[int, int, float, int]] = []   # (replica 0's updates and steps then, return, length)
        self._evals_in_order = True   # ... as replica 0 reports them: its counts never go back (see ended_by)
        self._episodes_out: dict[int, int] = {}   # replica -> its tagged episodes written to TensorBoard
        self._eval_out = 0
        self._resumed_recent: list[tuple[float, int]] = []
        self._resumed_eval: list[float] = []   # a resumed run's last evaluation returns, before its own
        self.stop_requested = False
        self.stopping = False
        self.channel_stats: dict[str, dict[str, Any]] = {}
        self._last_channel: tuple[float, dict[str, dict[str, Any]]] | None = None
        self._rates: dict[str, float] = {}
        self.base_steps = 0                  # env steps of the run this one resumed (not in this run's rate)
        self.base_episodes = 0
        self.base_wall = 0.0
        self.base_updates = 0
        self.resumed = False
        self.version_offset = 0
        self.restarts = 0
        self.notes: list[str] = []
        self.unwritten_rows = 0   # rows of a stopped run's last updates left out (see _drain)
        self._solve_resumed = False   # the run this one resumed had reached the target
        self._arrival_init()

    # -- what executors report --------------------------------------------------------
    def start(self, from_first_step: bool = False) -> None:
        self._start = time.perf_counter()
        self.from_first_step, self._first = from_first_step, None
        if self.progress is not None:
            self.progress.start()

    def loop_begins(self, at: float | None = None) -> None:
        """The loop's first environment call (its first reset, or step) is about to run: a one-process
        run's rate (``from_first_step``) counts from here, every step in it, as CleanRL's SPS and SB3's
        fps count from just before their first reset."""
        if self.from_first_step and self._first is None:
            self._first = (time.perf_counter() if at is None else at, self.env_steps)

    def env_step(self, n: int, finished: list[tuple[float, int]], replica: int = 0,
                 tagged: list[tuple[int, float, int]] | None = None) -> None:
        if tagged:
            self._tagged.setdefault(replica, EpisodeLog()).extend(tagged)
        self.env_steps += n
        if self._first is None and n > 0:   # (no loop_begins heard: those steps were made before now, not in the rate)
            self._first = (time.perf_counter() if self.replay_time is None else self.replay_time, self.env_steps)
        if self._pending is not None and self.rows_end_at_steps and n:   # (a reset: the row goes on)
            self._flush()
        for ret, length in finished:
            self.episodes.append((self.env_steps, ret, length))
            self.recent.append(ret)
            self.recent_lengths.append(length)
            if self.outputs is not None and not self.marked_replicas:   # else when its row is written
                self.outputs.write_episode(self.env_steps, ret, length)
            if self.solved_at_steps is None and solves(self.recent, self.target_return):
                self.solved_at_seconds = self.base_wall + self.wall_seconds   # (a resumed run's: the whole run's)
                self.solved_at_steps = self.env_steps
                if self.stop_on_target:
                    self.stop_requested = True
        now = time.perf_counter()
        if now >= self._next_refresh:
            self._next_refresh = now + 0.25
            self._refresh(now)
        if self.stop_requested and not self.stopping:
            self.stopping = True   # raised once: what comes in after (the rest of the run's messages) is counted
            raise StopRun

    def mark(self, replica: int, update: int, steps: int) -> None:
        """Loop replica ``replica`` made its ``update``-th clock call having stepped ``steps`` env
        steps (as heard from it) and finished every episode heard from it so far."""
        if not self.marked_replicas:
            return
        self._first_mark.setdefault(replica, update)
        self._marks.setdefault(replica, {}).setdefault(update, (steps, len(self._tagged.get(replica, ()))))
        self._drain()

    def loop_ended(self, replica: int) -> None:
        self._ended.add(replica)
        self._drain()
        self._drain_held()

    def log_at(self, update: int | None, scalars: dict[str, float], steps: int | None = None,
               new_row: bool = False) -> None:
        """Scalars computed at this run's ``update``-th update (or by the loop after it): into its
        row where the row is still held (rows wait for their marks), else into the current one.
        The loop's own values after it stepped an env (``new_row``, at replica 0's ``steps``) are a
        row of their own after the update's, as single_process writes them."""
        if update is not None and steps is not None and (self.marked_replicas or self.arrival):
            # the row the loop made after that env step (a learner's output the loop logged may
            # come after the loop's later rows: found by its steps), a new one, or the update's
            rows = self._loop_rows.get(update)
            at = next((r for r in rows or () if r[0] == steps), None)
            if at is not None:
                at[1].update(scalars)
                return
            # (a value logged before the loop's first env step and update, as single_process writes it: a
            # row of its own before the first update's, however late the loop's message comes)
            if new_row or (update == 0 and steps == 0 and self.marked_replicas):
                rows = self._loop_rows.setdefault(update, [])
                rows.append((steps, dict(scalars)))
                rows.sort(key=lambda r: r[0])
                return
        if update and self.arrival and not new_row:
            # gathered on arrival: the j-th update's row holds what loop replica 0 logged at its j-th
            # learner call (see arrivalrows), the loop's own values with the learner's
            if update > self.updates - self.base_updates:   # (that update has not reached the driver yet)
                self._early.setdefault(update, {}).update(scalars)
            else:
                self.log_into(update, scalars)
            return
        if update is not None and self.marked_replicas:
            for row in (*self._waiting, *([self._pending] if self._pending is not None else [])):
                if int(row["updates"]) - self.base_updates == update:
                    row.update(scalars)
                    return
            if update > self.updates - self.base_updates:   # its update has not reached the driver yet
                self._early.setdefault(update, {}).update(scalars)
                return
        self.log_scalars(scalars)

    def loop_row_at(self, update: int, steps: int) -> bool:
        """Whether the loop made a row of its own after its ``update``-th update, at ``steps``."""
        return any(r[0] == steps for r in self._loop_rows.get(update, ()))

    def _write_loop_rows(self, before: int) -> None:
        """The loop's own rows of the updates before ``before`` (see log_at), in order."""
        for update in sorted(u for u in self._loop_rows if u < before):
            for steps, scalars in self._loop_rows.pop(update):
                row = self._runtime_row()
                row.update(env_steps=self.base_steps + steps * self.marked_replicas,
                           updates=self.base_updates + update)
                self._episode_columns(row, self._ended_by({r: steps for r in range(self.marked_replicas)}))
                # the evaluation episodes replica 0 had ended by then (not those it ends after the
                # row's next update, heard already), as single_process's row holds them
                at = self._first_mark.get(0, 1) - 1 + update
                def ended(e: tuple[int, int, float, int], at: int = at, steps: int = steps) -> bool:
                    return e[0] <= at and e[1] <= steps

                n = ended_by(self._eval_tagged, ended, self._evals_in_order)
                if self._eval_tagged or self.base_eval_episodes:
                    row["eval_episodes"] = self.base_eval_episodes + n
                    row["eval_return_mean"] = self._eval_mean(ended_returns(self._eval_tagged, n))
                row.update(scalars)
                self.steps_rate(row)
                if self.outputs is not None:
                    self.outputs.write_row(row)

    def _mark_of(self, replica: int, update: int) -> tuple[int, int] | None:
        return self._marks.get(replica, {}).get(self._first_mark.get(replica, 1) - 1 + update)

    def _marked(self, row: dict[str, float], final: bool = False) -> bool:
        """Set the row's step and episode columns from its update's marks, if they are all in and
        replica 0, which logs, has gone on to its next update (what it logs of this one is in), or
        the run has stopped (``final``: nothing more will come)."""
        j = int(row["updates"]) - self.base_updates
        if j <= 0:
            return True   # the loop's values before this run's first update: as they came
        if not final and 0 not in self._ended and self._mark_of(0, j + 1) is None:
            return False
        at = []
        for r in range(self.marked_replicas):
            mark = self._mark_of(r, j)
            if mark is None:
                return False
            at.append(mark)
        row["env_steps"] = self.base_steps + sum(steps for steps, _ in at)
        self._episode_columns(row, {r: n for r, (_, n) in enumerate(at)})
        # replica 0 steps and reports them; the row holds those ended by its end (before replica 0's
        # next training step), as single_process's row does
        before = self._first_mark.get(0, 1) - 1 + j
        steps0 = at[0][0]
        n = ended_by(self._eval_tagged, lambda e: e[0] < before or (e[0] == before and e[1] <= steps0),
                     self._evals_in_order)
        row["eval_episodes"] = self.base_eval_episodes + n
        row["eval_return_mean"] = self._eval_mean(ended_returns(self._eval_tagged, n))
        self._episodes_to_board({r: n for r, (_, n) in enumerate(at)}, n)
        return True

    def _episodes_to_board(self, upto: dict[int, int], evals: int) -> None:
        """Write to TensorBoard, in single_process's order and at its steps, each replica's episodes
        up to ``upto[replica]`` and the evaluation episodes up to ``evals``, not written yet."""
        if self.outputs is None:
            return
        new = sorted(((t, r, ret, length) for r, n in upto.items()
                      for t, ret, length in self._tagged.get(r, [])[self._episodes_out.get(r, 0):n]), key=_by_step)
        for t, _, ret, length in new:
            self.outputs.write_episode(self.base_steps + t * self.marked_replicas, ret, length)
        for r, n in upto.items():
            self._episodes_out[r] = max(self._episodes_out.get(r, 0), n)
        for _, t, ret, length in self._eval_tagged[self._eval_out:evals]:
            self.outputs.write_eval_episode(self.base_steps + t * self.marked_replicas, ret, length)
        self._eval_out = max(self._eval_out, evals)

    def _drain(self, force: bool = False) -> None:
        # rows wait as long as the loop's messages lag the learner's (they share the driver's queue,
        # and a busy machine delays the loop's): a row written before its marks had another update's
        # steps and lost its values; the bound only guards memory against marks that never come
        while self._waiting:
            marked = self._marked(self._waiting[0], final=force)
            if not (marked or force or len(self._waiting) > MAX_WAITING_ROWS):
                break
            self._write_loop_rows(int(self._waiting[0]["updates"]) - self.base_updates)
            row = self._waiting.pop(0)   # (taken first: a Ctrl-C in the write cannot write it twice)
            if not marked and force:
                # a run that stopped (Ctrl-C, a failure) before the loop's steps of this update reached
                # the driver: its step and episode columns would be those heard by then, behind the
                # row before; the row is left out, as single_process never wrote it
                self.unwritten_rows += 1
                continue
            self.steps_rate(row)
            if self.outputs is not None:
                self.outputs.write_row(row)
            written = int(row["updates"]) - self.base_updates
            for replica, marks in self._marks.items():   # rows after it need marks from its next update on
                for u in [u for u in marks if u < self._first_mark.get(replica, 1) + written]:
                    del marks[u]

    def eval_episode(self, ret: float, length: int, at: tuple[int, int] | None = None) -> None:
        """An episode of an evaluation env: reported apart, never mixed into the training returns;
        ``at``: the updates and training env steps loop replica 0 (which reports them) had made then."""
        if at is not None and self.marked_replicas:   # rows and TensorBoard take it when its row is written
            if self._eval_tagged and (at[0], at[1]) < self._eval_tagged[-1][:2]:
                self._evals_in_order = False
            self._eval_tagged.append((at[0], at[1], ret, length))
            steps = self.base_steps + at[1] * self.marked_replicas
        else:
            steps = self.env_steps
            if self.outputs is not None:
                self.outputs.write_eval_episode(steps, ret, length)
            if at is not None and self.arrival:   # (rows take them by replica 0's count: see arrivalrows)
                if self._eval_at and (at[0], at[1]) < self._eval_at[-1][:2]:
                    self._evals_in_order = False
                self._eval_at.append((at[0], at[1], ret))
        self.eval_episodes.append((steps, ret, length))
        self.eval_recent.append(ret)

    def update(self) -> None:
        self.updates += 1
        if self._pending is not None:
            self._flush()
        self._pending = self._runtime_row()
        early = self._early.pop(self.updates - self.base_updates, None)
        if early:
            self._pending.update(early)

    def log(self, scalars: Any) -> None:
        """Scalars from ``ff.log`` (a pytree of 0-d arrays or numbers) into the current row."""
        self.log_scalars(flat_scalars(scalars))

    def log_scalars(self, scalars: dict[str, float]) -> None:
        """Already flattened scalars (see :func:`flat_scalars`) into the current row."""
        if self._pending is not None and not self.rows_end_at_steps and any(k in self._pending for k in scalars):
            self._flush()   # the row waits for the next update, but a value logged again is a later one's
        row = self._pending if self._pending is not None else self._runtime_row()
        row.update(scalars)
        self._pending = row

    def channels(self, stats: dict[str, dict[str, Any]]) -> None:
        """Latest counters of every channel (cumulative); rates are derived between calls."""
        now = time.perf_counter()
        if self._last_channel is not None:
            then, before = self._last_channel
            dt = max(now - then, 1e-9)
            for name, s in stats.items():
                b = before.get(name, {})
                self._rates[f"{name}/items_per_second"] = (s["items"] - b.get("items", 0)) / dt
                self._rates[f"{name}/bytes_per_second"] = (s["bytes"] - b.get("bytes", 0)) / dt
        self._last_channel = (now, stats)
        self.channel_stats = stats

    def warn(self, message: str) -> None:
        """Something the run should say while it goes on (summary.json's notes keep it)."""
        self.notes.append(message)
        if self.progress is not None:
            self.progress.note(message)
        else:
            import sys

            print(f"warning: {message}", file=sys.stderr, flush=True)

    def restarted(self, message: str) -> None:
        """A worker process was started again after it died."""
        self.restarts += 1
        self.notes.append(message)
        if self.progress is not None:
            self.progress.note(message)
        else:
            import sys

            sys.stderr.write(f"warning: {message}\n")

    # -- checkpoints -------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """What a checkpoint records so a resumed run's counters continue."""
        return {"env_steps": self.env_steps, "updates": self.updates,
                "version": self.updates,
                "episodes": self.base_episodes + len(self.episodes), "recent_returns": list(self.recent),
                "recent_lengths": list(self.recent_lengths), "eval_recent": list(self.eval_recent),
                "eval_episodes": self.base_eval_episodes + len(self.eval_episodes),
                "wall_seconds": round(self.base_wall + self.wall_seconds, 3), "restarts": self.restarts,
                # (as the summary gives it: the step of the episode that solved it, in single_process's order)
                "solved_at_steps": self.solved_at_steps if self.solved_at_steps is None or self._solve_resumed
                else self._solved_step(),
                "solved_at_seconds": self.solved_at_seconds,
                "target_return": self.target_return, "stop_on_target": self.stop_on_target,
                "notes": list(self.notes)}

    def counters_at(self, steps: dict[int, int]) -> dict[str, Any]:
        """:meth:`counters` with the episodes as they stood where each loop replica had made
        ``steps[replica]`` env steps (a checkpoint's cut), not as many as have reached the driver."""
        out = self.counters()
        ended = self._ended_by(steps)
        recent = self._recent(ended)
        out["episodes"] = self.base_episodes + sum(ended.values())
        out["recent_returns"] = [ret for ret, _ in recent]
        out["recent_lengths"] = [length for _, length in recent]
        tagged = self._eval_tagged or [(u, t, ret, 0) for u, t, ret in self._eval_at]   # (the latter: on arrival)
        if tagged and 0 in steps:   # the evaluation episodes replica 0 had ended by its cut
            evals = [ret for _, t, ret, _ in tagged if t <= steps[0]]
            out["eval_episodes"] = self.base_eval_episodes + len(evals)
            out["eval_recent"] = (self._resumed_eval + evals)[-RETURN_WINDOW:]
        return out

    def _ended_by(self, steps: dict[int, int]) -> dict[int, int]:
        """How many of each replica's episodes had ended by its ``steps[replica]``-th env step (its
        episodes are tagged with its steps, in order)."""
        return {r: bisect_right(self._tagged[r].steps, at) if r in self._tagged else 0 for r, at in steps.items()}

    def _recent(self, ended: dict[int, int]) -> list[tuple[float, int]]:
        """(return, length) of the last episodes among each replica's first ``ended[replica]``, in
        single_process's order (by the step that ended them, then the replica)."""
        tail = sorted(((t, r, ret, length) for r, n in ended.items()
                       for t, ret, length in self._tagged.get(r, [])[max(0, n - RETURN_WINDOW):n]), key=_by_step)
        return (self._resumed_recent + [(ret, length) for _, _, ret, length in tail])[-RETURN_WINDOW:]

    def _episode_columns(self, row: dict[str, float], ended: dict[int, int]) -> None:
        """A row's episode columns with each replica's first ``ended[replica]`` episodes."""
        recent = self._recent(ended)
        row["episodes"] = self.base_episodes + sum(ended.values())
        row["episode_return_mean"] = sum(ret for ret, _ in recent) / len(recent) if recent else math.nan
        row["episode_length_mean"] = sum(length for _, length in recent) / len(recent) if recent else math.nan

    def resume(self, counters: dict[str, Any]) -> None:
        """Continue the counters a checkpoint recorded."""
        self.env_steps = self.base_steps = int(counters.get("env_steps", 0))
        self.updates = self.base_updates = int(counters.get("updates", 0))
        self.resumed = True
        self.version_offset = int(counters.get("version", self.updates))
        self.base_episodes = int(counters.get("episodes", 0))
        self.base_wall = float(counters.get("wall_seconds", 0.0))
        self.restarts = int(counters.get("restarts", 0))
        self.notes = [str(n) for n in counters.get("notes", [])] + self.notes   # (why the restarts were)
        self.recent.extend(counters.get("recent_returns", []))
        self.recent_lengths.extend(counters.get("recent_lengths", []))
        self._resumed_recent = list(zip(self.recent, self.recent_lengths))
        self.eval_recent.extend(counters.get("eval_recent", []))
        self._resumed_eval = list(self.eval_recent)
        self.base_eval_episodes = int(counters.get("eval_episodes", 0))
        if counters.get("target_return", self.target_return) == self.target_return:   # (another target: solved anew)
            self.solved_at_steps = counters.get("solved_at_steps")
            self.solved_at_seconds = counters.get("solved_at_seconds")
            self._solve_resumed = self.solved_at_steps is not None

    # -- derived figures ---------------------------------------------------------------
    @property
    def wall_seconds(self) -> float:
        return (time.perf_counter() if self.replay_time is None else self.replay_time) - self._start

    def steps_rate(self, row: dict[str, float]) -> None:
        """Set a row's ``steps_per_second`` from its own env steps at its own time, where its steps
        were set from the loops' marks after it was made (its rate, made from the steps heard then,
        was 0 in a run's first rows, the loops' step reports coming after its update)."""
        if "wall_seconds" in row and "env_steps" in row:
            row["steps_per_second"] = self.rate(self._start + row["wall_seconds"] - self.base_wall, int(row["env_steps"]))

    def rate(self, now: float | None = None, env_steps: int | None = None) -> float:
        """Env steps per second of this run's loop, as CleanRL's SPS and SB3's fps count from the
        loop's start: where the clock started before the program (``from_first_step``), since the
        loop's first environment call (:meth:`loop_begins`; the program's setup before it is not
        counted; one process hears of its steps as they are made); else since the run started (after
        the trace, its processes' start included: their reports come some steps at a time)."""
        if now is None:
            now = time.perf_counter() if self.replay_time is None else self.replay_time
        total = self.env_steps if env_steps is None else env_steps   # (a row's: its steps, see steps_rate)
        then, steps = self._first if self.from_first_step and self._first is not None else (self._start, self.base_steps)
        if steps == total:   # (a run whose steps all came in one report: its steps over the run)
            then, steps = self._start, self.base_steps
        return (total - steps) / (now - then) if now > then else 0.0

    @property
    def recent_return(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def _runtime_row(self) -> dict[str, float]:
        wall = self.wall_seconds
        nan = math.nan
        row = {
            "env_steps": self.env_steps, "updates": self.updates, "wall_seconds": self.base_wall + wall,
            "steps_per_second": self.rate(),
            "episode_return_mean": sum(self.recent) / len(self.recent) if self.recent else nan,
            "episode_length_mean": sum(self.recent_lengths) / len(self.recent_lengths) if self.recent_lengths else nan,
            "episodes": self.base_episodes + len(self.episodes),
            **self._eval_columns(),
            "restarts": self.restarts,
        }
        for name, s in self.channel_stats.items():
            row[f"{name}/depth"] = int(s["depth"])
            row[f"{name}/drops"] = int(s["drops"])
            row[f"{name}/items_per_second"] = self._rates.get(f"{name}/items_per_second", nan)
            row[f"{name}/bytes_per_second"] = self._rates.get(f"{name}/bytes_per_second", nan)
        return row

    def _eval_columns(self) -> dict[str, float]:
        """The evaluation columns as the episodes heard so far make them."""
        return {"eval_return_mean": sum(self.eval_recent) / len(self.eval_recent) if self.eval_recent else math.nan,
                "eval_episodes": self.base_eval_episodes + len(self.eval_episodes)}

    def _flush(self) -> None:
        if self.arrival:
            self._hold_pending()   # (see arrivalrows: the row waits for the loops' reports)
        elif self._pending is not None and self.marked_replicas:
            self._waiting.append(self._pending)
            self._pending = None
            self._drain()
        elif self._pending is not None and self.outputs is not None:
            row, self._pending = self._pending, None   # (taken first: a Ctrl-C in the write cannot write it twice)
            # the evaluation episodes ended by the row's end (the next training step where rows end at steps,
            # else the next update), as what the loop logs by then is the row's: an evaluation after the
            # update, and its ff.log, in one row
            row.update(self._eval_columns())
            self.outputs.write_row(row)
        self._pending = None

    def _refresh(self, now: float) -> None:
        if self.progress is not None:
            wall = now - self._start
            extra = ""
            for name, s in self.channel_stats.items():
                extra += f"  {name}: depth {s['depth']} drops {s['drops']}"
            if self.restarts:
                extra += f"  restarts {self.restarts}"
            self.progress.update(self.env_steps, self.rate(now),
                                 self.recent_return, wall, extra)

    def summary(self) -> dict[str, Any]:
        wall = self.wall_seconds
        out: dict[str, Any] = {
            "env_steps": self.env_steps, "updates": self.updates, "wall_seconds": round(wall, 3),
            "steps_per_second": round(self.rate(), 1),
            "episodes": self.base_episodes + len(self.episodes),
            "final_return_mean": self.recent_return,
        }
        out["restarts"] = self.restarts
        notes = list(self.notes)
        if self.unwritten_rows:
            notes.append(f"the last {self.unwritten_rows} update(s) have no row in metrics.csv: the run stopped "
                         "before the loop's steps of them reached the driver")
        if notes:
            out["notes"] = notes
        if self.resumed:
            out["resumed_at"] = {"env_steps": self.base_steps, "updates": self.base_updates, "version": self.version_offset}
            out["wall_seconds_total"] = round(self.base_wall + wall, 3)
        if self.eval_episodes or self.base_eval_episodes:
            out["eval_episodes"] = self.base_eval_episodes + len(self.eval_episodes)
            out["eval_return_mean"] = sum(self.eval_recent) / len(self.eval_recent)
        if self.channel_stats:
            out["channels"] = self.channel_stats
        if self.target_return is not None:
            out["target_return"] = self.target_return
            out["solved_at_seconds"] = None if self.solved_at_seconds is None else round(self.solved_at_seconds, 3)
            out["solved_at_steps"] = self.solved_at_steps
        return out

    def close(self) -> None:
        # values the loop logged for updates that never came (the run stopped first: a learner failed,
        # a Ctrl-C) are left out, as single_process, which stops at the failing call, never logs them;
        # but where those updates were never made because their calls were dropped as stale (gathered on
        # arrival), the run went on to its end, and the loop's last values (its final evaluation, what it
        # logs after the loop) are written in a last row, said
        drops = sum(int(s.get("drops", 0) or 0) for s in self.channel_stats.values())
        if self.arrival and self._early and drops:
            for u in sorted(self._early):
                self._late.update(self._early[u])
            self.warn(f"values the loop logged after learner calls that were dropped as stale ({', '.join(map(repr, sorted(self._late)))}: "
                      f"{drops} call(s) dropped under max_lag, so the run made fewer updates than the loop called the "
                      "learner) are in metrics.csv's last row")
        self._early.clear()
        self._flush()
        self._drain(force=True)
        self._drain_held(force=True)
        if self.arrival:   # (every one left: replica 0 may have made more clock calls than the run made updates)
            self._arrival_loop_rows(max(self._loop_rows, default=0) + 1, None)
        self._write_loop_rows(self.updates - self.base_updates + 1)
        if self.marked_replicas:   # what no row took
            self._episodes_to_board({r: len(eps) for r, eps in self._tagged.items()}, len(self._eval_tagged))
        if self.marked_replicas and self._tagged:
            # replicas stepped in step: their episodes in single_process's order (by the step that
            # ended them, then the replica's environments), not in the order they reached the driver,
            # at the env steps they ended at, not those the driver had heard of then
            merged = self._merged()
            self.episodes = EpisodeLog((self.base_steps + t * self.marked_replicas, ret, length) for t, _, ret, length in merged)
            recent = (self._resumed_recent + [(ret, length) for *_, ret, length in merged])[-RETURN_WINDOW:]
            self.recent = deque((ret for ret, _ in recent), maxlen=RETURN_WINDOW)
            self.recent_lengths = deque((length for _, length in recent), maxlen=RETURN_WINDOW)
            self._solved_in_order()
        elif self._tagged:
            # gathered on arrival: the final return over the window the rows take (the last episodes by
            # the step that ended them, then the replica), not the last to reach the driver
            recent = self._recent({r: len(eps) for r, eps in self._tagged.items()})
            self.recent = deque((ret for ret, _ in recent), maxlen=RETURN_WINDOW)
            self.recent_lengths = deque((length for _, length in recent), maxlen=RETURN_WINDOW)
        self._closing_row()
        if self.progress is not None:
            self._refresh(time.perf_counter())
            self.progress.stop()

    def _eval_mean(self, returns: list[float]) -> float:
        """The mean of the last evaluation returns (a resumed run's window goes on from its checkpoint's)."""
        recent = (self._resumed_eval + returns)[-RETURN_WINDOW:]
        return sum(recent) / len(recent) if recent else math.nan

    def _closing_row(self) -> None:
        """A last row where evaluation episodes ended after the last update's row was written (a final
        evaluation after the loop, or one at the last update): its columns as the run ended, so that
        metrics.csv holds every evaluation, not only summary.json."""
        last = self.outputs.last_row if self.outputs is not None else None
        late = self._late
        if last is None or self.unwritten_rows or \
                (self.base_eval_episodes + len(self.eval_episodes) <= last.get("eval_episodes", 0) and not late):
            return   # (after rows left out of a stopped run, its counts would be those rows')
        row = self._runtime_row()
        if late:   # (the loop's values of updates whose calls were dropped as stale: see close)
            row.update(late)
        if self.marked_replicas:   # the evaluation window in replica 0's order, as the rows before
            row["eval_return_mean"] = self._eval_mean([ret for *_, ret, _ in self._eval_tagged])
        assert self.outputs is not None
        self.outputs.write_row(row)

    def _merged(self) -> list[tuple[int, int, float, int]]:
        """Every replica's episodes (its steps then, replica, return, length) in single_process's order."""
        return sorted(((t, r, ret, length) for r, eps in self._tagged.items() for t, ret, length in eps), key=_by_step)

    def _solved_step(self) -> int | None:
        """The env step of the episode whose end first brought the mean of the last episodes, in
        single_process's order, to the target (where replicas step in step, at the step it ended at)."""
        episodes: Any = self.episodes
        if self.marked_replicas and self._tagged:
            episodes = [(self.base_steps + t * self.marked_replicas, ret, length) for t, _, ret, length in self._merged()]
        window = deque((ret for ret, _ in self._resumed_recent), maxlen=RETURN_WINDOW)
        for steps, ret, _ in episodes:
            window.append(ret)
            if solves(window, self.target_return):
                return steps
        return None

    def _solved_in_order(self) -> None:
        """``solved_at_steps`` from the episodes in single_process's order, at the steps they ended at
        (heard as they arrived, it was the steps the driver had heard of then, run to run different)."""
        if self.target_return is None or self._solve_resumed:
            return
        solved = self._solved_step()
        if solved is not None and self.solved_at_seconds is None:
            self.solved_at_seconds = self.base_wall + self.wall_seconds   # (reached by the end, heard in another order)
        if solved is None:
            self.solved_at_seconds = None
        self.solved_at_steps = solved
