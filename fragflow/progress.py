"""The live progress display: env steps, steps/s, recent return, elapsed and ETA.

On a terminal it is a rich progress bar; elsewhere (CI, a pipe) a plain line as soon as the first env
steps are counted (the workers run), then one every few seconds.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
)
from rich.table import Column


class ProgressDisplay:
    def __init__(self, description: str, total: int | None, console: Console | None = None,
                 plain_interval: float = 5.0) -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.total = total
        self.description = description
        self.interactive = self.console.is_terminal
        self.plain_interval = plain_interval
        self._last_plain = 0.0
        self._stepped = False   # a plain line has counted env steps
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def start(self) -> None:
        if self.interactive:
            # the figures, in one column, keep their width; on a narrow terminal the channels' line, the bar
            # and then the name (printed above the bar already) give way
            self._progress = Progress(
                TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                          min_width=0, ratio=1)),
                BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=0)),
                TextColumn("{task.fields[figures]}", table_column=Column(no_wrap=True)),
                TextColumn("{task.fields[extra]}", table_column=Column(ratio=2, min_width=0, no_wrap=True,
                                                                         overflow="ellipsis")),
                console=self.console, transient=False, refresh_per_second=4, expand=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, extra="",
                                                 figures=self._figures(0, 0.0, "-", 0.0))
        else:
            self.console.print(f"{self.description}: started", highlight=False)
        self._last_plain = time.monotonic()

    def update(self, env_steps: int, sps: float, recent_return: float | None, elapsed: float, extra: str = "") -> None:
        ret = "-" if recent_return is None else f"{recent_return:.1f}"
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=env_steps, extra=extra,
                                  figures=self._figures(env_steps, sps, ret, elapsed))
            return
        now = time.monotonic()
        if now - self._last_plain >= self.plain_interval or (env_steps > 0 and not self._stepped):
            self._last_plain = now
            self._stepped = env_steps > 0
            total = f"/{self.total}" if self.total else ""
            eta = ""
            if self.total and sps > 0:
                eta = f"  eta {max(0.0, (self.total - env_steps) / sps):.0f}s"
            self.console.print(f"{self.description}: {env_steps}{total} env steps  {sps:,.0f} steps/s  "
                               f"return {ret}  elapsed {elapsed:.0f}s{eta}{extra}", highlight=False)
            sys.stderr.flush()

    def _figures(self, env_steps: int, sps: float, ret: str, elapsed: float) -> str:
        total = f"/{self.total}" if self.total else ""
        eta = _clock((self.total - env_steps) / sps) if self.total and sps > 0 else "-:--:--"
        return (f"{env_steps}{total} env steps  {sps:,.0f} steps/s  return {ret}  {_clock(elapsed)} eta {eta}")

    def note(self, message: str) -> None:
        """A line printed above the bar (or on its own line): an event the user should see."""
        if self._progress is not None:
            self._progress.console.print(f"[yellow]warning:[/] {message}", highlight=False)
        else:
            self.console.print(f"warning: {message}", highlight=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _clock(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
