"""What a run writes: ``metrics.csv``, TensorBoard event files, ``summary.json``, ``returns.png``."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any

RUNTIME_COLUMNS = ("env_steps", "updates", "wall_seconds", "steps_per_second",
                   "episode_return_mean", "episode_length_mean", "episodes", "restarts")
EVAL_COLUMNS = ("eval_return_mean", "eval_episodes")
# the channel's counters, in each row of a run over several processes (its one channel is "trajectory")
CHANNEL_COLUMNS = ("trajectory/depth", "trajectory/drops", "trajectory/items_per_second", "trajectory/bytes_per_second")
# the tags the run writes itself: a logged value under one of them would share its series (env_steps is
# each point's step, not a tag)
RUN_TAGS = frozenset({f"charts/{c}" for c in RUNTIME_COLUMNS if c != "env_steps"} | {f"eval/{c}" for c in EVAL_COLUMNS} |
                     {"charts/episodic_return", "charts/episodic_length", "eval/episodic_return", "eval/episodic_length"})
TB_EVERY = 1.0   # seconds between handing TensorBoard's writer the events made since


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``, by google-crc32c's C code."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fast_event_checksums() -> bool:
    """TensorBoard's event writer checksums each record (a row's event: two) with a pure-Python
    CRC-32C where TensorFlow is not installed: 43 us for a 512-byte row here, a thread taking the
    interpreter lock from the loop for every update's row. google-crc32c's C one (0.2 us) stands in
    for it, where that package has its C extension; False where it is left as it was."""
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if record_writer.masked_crc32c is _masked_crc32c:
        return True
    if google_crc32c.implementation != "c":   # (its pure-Python fallback is no faster)
        return False
    record_writer.masked_crc32c = _masked_crc32c
    return True


def _updates(row: dict[str, str]) -> float:
    try:
        return float(row.get("updates") or 0)
    except ValueError:
        return 0.0


def _before(row: dict[str, str], at: tuple[int, int]) -> bool:
    """A row made by the checkpoint ``at`` (updates, env steps) resumes from: one of an earlier update,
    or of its update but no later env step (the loop's own rows after the update, before the cut)."""
    updates = _updates(row)
    if updates != at[0]:
        return updates < at[0]
    try:
        return float(row.get("env_steps") or 0) <= at[1]
    except ValueError:
        return True


def _steps(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("env_steps") or "nan"))
    except ValueError:
        return None


def _rewrite(path: Path, columns: list[str], rows: list[dict[str, str]]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


class RunOutputs:
    """Writers for one run directory. Rows go to CSV and TensorBoard as they come.

    A column first met after ``metrics.csv``'s header was written (a value logged now and then, a
    name the loop makes, ``f"loss{u}"``) needs the file written again with it. Written again at each
    such column, a run that logs a new name every update rewrote its whole file every update (1,000
    updates: 44 s in the writer against 0.05 s under one name). So a row goes to the file at once with
    the columns the header has, its values of later ones are held, and the file is written again with
    their columns (empty above) once it holds at least twice the rows it held when last written: the
    rewrites of a run add up to at most twice its final file. What is still held is written by
    :meth:`settle` and at close. ``metrics.csv`` is a valid CSV all along, holding every row written;
    a run killed before its close loses only the values of columns not yet in the file.
    """

    def __init__(self, directory: str | os.PathLike[str], resumed_at: tuple[int, int] | None = None,
                 column_order: tuple[str, ...] = (), history: Path | None = None,
                 resumed_from: Path | None = None) -> None:
        """``resumed_at`` (updates, env steps of its checkpoint): a resumed run adds to the directory's
        ``metrics.csv`` (same columns) and TensorBoard, after dropping what the interrupted run wrote
        past the checkpoint (the resumed run writes it again). Nothing is touched before the first
        row or episode of a resumed run: one refused when its loop loads the checkpoint leaves the directory as it was.
        ``column_order``: the logged names in the order the loop logs them (the trace's), which
        ``metrics.csv`` keeps after the run's own columns, whatever order the values arrive in.
        ``history``: the directory of the run a resumed run continues, when it writes elsewhere: its
        rows and TensorBoard events are copied first, so that this directory holds the whole run too.
        ``resumed_from``: the checkpoint resumed; in this directory, the checkpoints written after it
        (the timeline it leaves) are removed as the resumed run begins."""
        self.dir = Path(directory)
        self._order = {name: i for i, name in enumerate(column_order)}
        self.last_row: dict[str, float] | None = None   # the last row written (a run's closing row compares with it)
        made = [p for p in (self.dir, *self.dir.parents) if not p.exists()]   # (what close removes, left empty)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._made = made
        self._csv_file: IO[str] | None = None
        self._csv: csv.DictWriter[str] | None = None
        self._columns: list[str] | None = None   # metrics.csv's header
        self._header: set[str] = set()           # (the same, to look up)
        self._known: set[str] = set()            # ... and the columns held for the next rewrite (see the class)
        self._rows = 0                           # the rows in metrics.csv
        self._written_at = 0                     # ... when its header was last written
        self._late: dict[int, dict[str, Any]] = {}   # values of columns not in the header, by row
        self._late_columns: list[str] = []
        self._resumed_at = resumed_at
        self._resumed_from = resumed_from
        self._left = self._timeline_left()   # (removed as the run begins: not one this run writes before then)
        self._history = history
        self._tb_writer: Any = None
        self._events: list[tuple[Any, int]] = []   # TensorBoard events not yet handed to its writer
        self._events_due = 0.0
        if resumed_at is None:
            self._begin()

    def _timeline_left(self) -> list[tuple[Path, int]]:
        """Resumed in place from an older checkpoint: those written after it belong to the timeline
        left, and a resume from one of them would join the two runs' rows. Listed now, removed as the
        run begins (at its first row or episode): a checkpoint the resumed run writes before then (its
        final one, where its last update's row comes after it) is not among them."""
        from fragflow.runtime.checkpoint import _written_ns, listing

        checkpoints = self.dir / "checkpoints"
        if self._resumed_at is None or self._resumed_from is None or \
                self._resumed_from.parent.resolve() != checkpoints.resolve():
            return []
        written = [p.resolve() for p in listing(checkpoints)]
        resumed = self._resumed_from.resolve()
        return [(p, _written_ns(p)) for p in written[written.index(resumed) + 1:]] if resumed in written else []

    @property
    def begun(self) -> bool:
        """Whether the run wrote anything yet (a row, an episode)."""
        return self._tb_writer is not None

    @property
    def _tb(self) -> Any:
        if self._tb_writer is None:
            self._begin()
        return self._tb_writer

    def _begin(self) -> None:
        resumed_at = self._resumed_at
        metrics = self.dir / "metrics.csv"
        purge_from: int | None = None
        if resumed_at is not None and self._history is not None:
            _carry_history(self._history, self.dir)
        if resumed_at is not None and metrics.is_file():
            with open(metrics, newline="") as f:
                reader = csv.DictReader(f)
                header, rows = reader.fieldnames, list(reader)
            if header:
                self._columns = list(header)
                self._header, self._known = set(header), set(header)
                kept = [r for r in rows if _before(r, resumed_at)]
                if len(kept) < len(rows):
                    _rewrite(metrics, self._columns, kept)
                # (gathered as they arrive, a row past the checkpoint's update counts the steps of the calls its
                # update took, fewer than the checkpoint's, which counts every step the replicas had made)
                dropped = [d for r in rows if not _before(r, resumed_at) and (d := _steps(r)) is not None]
                if dropped:   # (never past a kept row's: TensorBoard drops every event from that step on)
                    last_kept = max([d for r in kept if (d := _steps(r)) is not None], default=-1)
                    purge_from = min(resumed_at[1] + 1, max(min(dropped), last_kept + 1))
                self._rows = self._written_at = len(kept)
        from fragflow.runtime.checkpoint import listing

        checkpoints = self.dir / "checkpoints"
        if resumed_at is None:   # a new run in a directory used before: the last run's outputs go
            # (TensorBoard's event files where a fragflow run wrote that directory: another program's stay)
            events = [*(self.dir / "tensorboard").glob("events.out.tfevents.*")] if _a_run(self.dir) else []
            for old in (metrics, self.dir / "returns.png", *events):
                old.unlink(missing_ok=True)
            # ... and its checkpoints (fragflow's: numbered, with a manifest), which a resume would
            # continue into this run's rows
            for old_dir in listing(checkpoints):
                shutil.rmtree(old_dir, ignore_errors=True)
            try:
                checkpoints.rmdir()   # (where nothing else is in it)
            except OSError:
                pass
        else:
            from fragflow.runtime.checkpoint import _written_ns

            for old_dir, when in self._left:   # (one this run wrote since, of the same name, is its own)
                if old_dir.is_dir() and _written_ns(old_dir) == when:
                    shutil.rmtree(old_dir, ignore_errors=True)
        from torch.utils.tensorboard import SummaryWriter

        fast_event_checksums()
        # events past the checkpoint's env steps are hidden (TensorBoard's purge_step)
        purge = (purge_from if purge_from is not None else resumed_at[1] + 1) if resumed_at is not None else None
        self._tb_writer = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=purge)

    def write_row(self, row: dict[str, float]) -> None:
        if self._tb_writer is None:
            self._begin()
        if self._csv is None:
            if self._columns is not None:
                self._open_csv("a")
            else:
                self._columns = self._ordered(list(row))
                self._header, self._known = set(self._columns), set(self._columns)
                self._open_csv("w")
        assert self._columns is not None and self._csv is not None
        if any(key not in self._known for key in row):
            new = [key for key in row if key not in self._known]
            self._late_columns += new
            self._known.update(new)
        if self._late_columns:
            late = {key: value for key, value in row.items() if key not in self._header}
            if late:
                self._late[self._rows] = late
        self._csv.writerow(row)   # (its columns in the header: the others are held in _late)
        self._rows += 1
        self.last_row = row
        assert self._csv_file is not None
        self._csv_file.flush()
        if self._late_columns and self._rows >= 2 * self._written_at:
            self._widen()
        # skip NaN (no episode finished yet)
        self._scalars(((tb_tag(key), value) for key, value in row.items() if key != "env_steps" and value == value),
                      int(row["env_steps"]))

    def _scalars(self, values: Any, step: int) -> None:
        """Scalars at one step, as one TensorBoard event (an event per scalar, as ``add_scalar`` writes
        them, made a 30k-step DQN run spend 0.48-0.61 s writing rows and episodes; 0.28-0.30 s so).
        Events go to the writer together, every :data:`TB_EVERY` seconds: each one handed over wakes
        its writing thread, whose taking the interpreter lock from the loop was 1.9 s of a profiled
        30k-step DQN run (the writer itself flushes its file every two minutes by default)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values])
        if summary.value:
            self._events.append((summary, step))
            if time.monotonic() >= self._events_due:
                self._hand_over()

    def _hand_over(self) -> None:
        if self._events:
            writer = self._tb._get_file_writer()   # (opens the file, honouring purge_step)
            for summary, step in self._events:
                writer.add_summary(summary, step)
            self._events.clear()
        self._events_due = time.monotonic() + TB_EVERY

    def _ordered(self, names: list[str]) -> list[str]:
        """The run's own columns first, as they come; then the logged names in the loop's order (a
        name the trace did not see logged, last). Under a policy of several processes a learner's
        values and the loop's reach the driver in either order."""
        last = len(self._order)
        own = [n for n in names if n in RUNTIME_COLUMNS or n in EVAL_COLUMNS or n in CHANNEL_COLUMNS]
        logged = [n for n in names if n not in own]
        return own + sorted(logged, key=lambda n: self._order.get(n, last))   # (stable: unseen ones as they came)

    def _open_csv(self, mode: str) -> None:
        assert self._columns is not None
        self._csv_file = open(self.dir / "metrics.csv", mode, newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self._columns, restval="", extrasaction="ignore")
        if mode == "w":
            self._csv.writeheader()
            self._written_at = self._rows

    def _widen(self) -> None:
        """Metrics first logged after the header was written (an actor loss every other update, a
        value the loop logs now and then): the file is written again with a column for each, empty
        above their first values, which were held until now (see the class)."""
        assert self._csv_file is not None and self._columns is not None
        self._csv_file.close()
        path = self.dir / "metrics.csv"
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        for i, late in self._late.items():
            if i < len(rows):
                rows[i].update(late)
        self._columns = self._columns + self._ordered(self._late_columns)
        self._header = set(self._columns)
        _rewrite(path, self._columns, rows)
        self._rows = self._written_at = len(rows)
        self._late.clear()
        self._late_columns = []
        self._open_csv("a")

    def write_episode(self, env_steps: int, ret: float, length: int) -> None:
        self._scalars((("charts/episodic_return", ret), ("charts/episodic_length", length)), env_steps)

    def write_eval_episode(self, env_steps: int, ret: float, length: int) -> None:
        self._scalars((("eval/episodic_return", ret), ("eval/episodic_length", length)), env_steps)

    def write_text(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        """As strict JSON: a NaN or infinite number (an argument set to nan) is written as null."""
        (self.dir / name).write_text(json.dumps(_finite(data), indent=2, sort_keys=True, default=str,
                                                allow_nan=False) + "\n")

    def plot_returns(self, episodes: Any, target: float | None) -> None:
        if not episodes:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        steps = np.array([e[0] for e in episodes], dtype=np.int64)
        rets = np.array([e[1] for e in episodes], dtype=np.float64)
        window = 20
        # the mean of the last 20 episodes (of all of them before the 20th), from the first episode on
        total = np.concatenate([[0.0], np.cumsum(rets)])
        ends = np.arange(1, len(rets) + 1)
        smooth = (total[ends] - total[np.maximum(ends - window, 0)]) / np.minimum(ends, window)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, rets, ".", alpha=0.25, label="episode return")
        ax.plot(steps, smooth, marker="." if len(rets) == 1 else None, label=f"mean of last {window}")
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
        ax.set_xlabel("environment steps")
        ax.set_ylabel("return")
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(self.dir / "returns.png", dpi=100)
        plt.close(fig)

    def settle(self) -> None:
        """Write the values held for columns not yet in ``metrics.csv`` (see the class) now."""
        if self._late_columns and self._csv_file is not None:
            self._widen()

    def flush(self) -> None:
        """Every row and event written so far on disk (a checkpoint is about to be)."""
        if self._csv_file is not None:
            self._csv_file.flush()
        if self._tb_writer is not None:
            self._hand_over()
            self._tb_writer.flush()

    def close(self) -> None:
        if self._csv_file is not None:
            self.settle()
            self._csv_file.close()
        if self._tb_writer is not None:
            self._hand_over()
            self._tb_writer.close()
        for p in self._made:   # a resumed run refused before its first row: the folders it made go
            try:
                p.rmdir()
            except OSError:   # (not empty: something was written)
                break


def _a_run(directory: Path) -> bool:
    """Whether a fragflow run wrote ``directory``: its summary.json says so, or, for a run killed
    before it wrote one, its metrics.csv has a run's first columns."""
    try:
        return "policy" in json.loads((directory / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        pass
    try:
        with open(directory / "metrics.csv", newline="") as f:
            return next(csv.reader(f), [])[:2] == ["env_steps", "updates"]
    except OSError:
        return False


def _carry_history(source: Path, out: Path) -> None:
    """The rows and TensorBoard events of the run a resumed run continues, copied into the resumed
    run's directory where it writes elsewhere (its outputs then drop what came after the checkpoint)."""
    if not source.is_dir() or source.resolve() == out.resolve():
        return
    if (source / "metrics.csv").is_file() and not (out / "metrics.csv").exists():
        shutil.copyfile(source / "metrics.csv", out / "metrics.csv")
    events = sorted((source / "tensorboard").glob("events.out.tfevents.*"))
    if events and not any((out / "tensorboard").glob("events.out.tfevents.*")):
        (out / "tensorboard").mkdir(exist_ok=True)
        for event in events:
            shutil.copyfile(event, out / "tensorboard" / event.name)


def tb_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.csv column (CleanRL's layout: the run's own under
    ``charts/``, logged values under ``losses/`` unless their name has a ``/`` of its own)."""
    if key in RUNTIME_COLUMNS:
        return f"charts/{key}"
    if key in EVAL_COLUMNS:   # beside eval/episodic_return, not among the losses
        return f"eval/{key}"
    return key if "/" in key else f"losses/{key}"


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
