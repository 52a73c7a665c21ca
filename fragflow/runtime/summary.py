"""A run's summary.json: its status, policy, algorithm and args, the monitor's counters and rates,
and the versions and machine it ran on."""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import sys
from typing import Any

from fragflow import __version__
from fragflow.placement.placed import PlacedGraph
from fragflow.runtime.monitor import Monitor


def args_record(args: Any) -> dict[str, Any] | None:
    """An Args dataclass's fields as the run records them; a field that cannot be copied (a lock,
    an open file) as its text, so that a run's summary is still written."""
    if not dataclasses.is_dataclass(args) or isinstance(args, type):
        return None
    try:
        return dataclasses.asdict(args)
    except Exception:
        return {f.name: repr(getattr(args, f.name)) for f in dataclasses.fields(args)}


def algorithm_name(train: Any, function: str) -> str:
    """The algorithm's name: its file's (``a2c`` for ``algorithms/a2c.py``, the stem of a user's file),
    else its training function's."""
    module = getattr(train, "__module__", None) or ""
    for prefix in ("fragflow.algorithms.", "fragflow_user_"):
        if module.startswith(prefix):
            return module[len(prefix):]
    if module == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        return os.path.splitext(os.path.basename(path))[0] if path else function
    return module.rsplit(".", 1)[-1] or function


def run_summary(placed: PlacedGraph, args: Any, monitor: Monitor, status: str, backend: str = "local",
             compiled_train: Any = None) -> dict[str, Any]:
    import gymnasium
    import torch

    config = args_record(args)
    return {
        "status": status,
        "policy": placed.policy,
        "policy_options": dict(placed.options),
        "backend": backend,
        "algorithm": algorithm_name(compiled_train, placed.graph.name),
        "args": config,
        **monitor.summary(),
        "versions": {"fragflow": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                     "gymnasium": gymnasium.__version__},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')
_NOTES = ("(while executing fragment", "(while fragflow traced fragment", "(in loop replica", "(fragflow: ",
          "(fragflow's and libraries' frames hidden")


def error_record(exc: BaseException) -> dict[str, Any]:
    """What made a run fail, for its summary: the exception's type and message, and where: the
    user's ``file:line`` (the last frame of the user's code that raised, in the loop's process or in
    a worker's), with the process and fragment where a worker raised and the fix of fragflow's own
    refusals."""
    from fragflow.errors import FragflowError
    from fragflow.runtime.exits import WorkerFailed
    from fragflow.source import SourceLoc, user_frames

    if isinstance(exc, FragflowError):
        return {"type": type(exc).__name__, "message": exc.what, "where": None if exc.where is None else str(exc.where),
                "fix": exc.fix}
    if isinstance(exc, WorkerFailed):   # (the user's frames, formatted in the worker)
        lines = exc.tb.rstrip().splitlines()
        frames = [(i, m) for i, m in enumerate(map(_TB_FRAME.match, lines)) if m is not None]
        where = str(SourceLoc.of(frames[-1][1].group(1), int(frames[-1][1].group(2)))) if frames else None
        cause = exc.__cause__   # (the exception itself, where it could be sent)
        if cause is not None:
            kind, message = type(cause).__name__, str(cause)
        else:   # its lines after the last frame's (a message may have several), less the notes in brackets
            rest = lines[frames[-1][0] + 1:] if frames else lines
            rest = [x for x in rest if not x.startswith("Traceback")]
            while rest and rest[0][:1].isspace():
                rest = rest[1:]
            while rest and rest[-1].startswith(_NOTES):   # (fragflow's notes: a message's own line may start so)
                rest = rest[:-1]
            kind, _, message = "\n".join(rest).partition(": ")
        return {"type": kind.rsplit(".", 1)[-1] or "Exception", "message": message, "where": where,
                "process": exc.who, "fragment": exc.fragment}
    user = user_frames(exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc),
            "where": str(SourceLoc.of(user[-1].filename, user[-1].lineno or 0)) if user else None}
