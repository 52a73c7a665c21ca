"""A run's summary.json: its status, policy, algorithm and args, the monitor's counters and rates,
and the versions and machine it ran on."""

from __future__ import annotations

import dataclasses
import os
import platform
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


def _algorithm_name(train: Any, function: str) -> str:
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
        "algorithm": _algorithm_name(compiled_train, placed.graph.name),
        "args": config,
        **monitor.summary(),
        "versions": {"fragflow": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                     "gymnasium": gymnasium.__version__},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }
