"""Entry point of every worker process (spawned; user code arrives cloudpickled in the plan)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Any

import cloudpickle

from fragflow import context
from fragflow.runtime.channels import ChannelHandles, ParamChannel, ParamHandles, Stopped, TrajectoryChannel
from fragflow.runtime.control import Control
from fragflow.runtime.plan import RunPlan
from fragflow.runtime.shm import Segment
from fragflow.source import is_internal


def main(*args: Any) -> None:
    """Run a worker; with ``FRAGFLOW_PROFILE=DIR`` under cProfile, stats written to DIR/<role><index>.prof."""
    out = os.environ.get("FRAGFLOW_PROFILE", "")
    if not out:
        return _main(*args)
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(_main, *args)
    finally:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"{args[0]}{args[1]}.prof"))


def _main(role: str, index: int, plan: RunPlan, trajs: list[ChannelHandles], param: ParamHandles | None,
          control_segment: str, lock: Any, stop: Any, results: Any, init: Any, threads: int) -> None:
    # The driver coordinates shutdown; Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a forked worker inherits the driver's handler
    import torch

    torch.set_num_threads(threads)
    worker: Any = None
    channels: list[TrajectoryChannel] = []
    params = None
    control = None
    try:
        channels = [TrajectoryChannel.open(h, stop) for h in trajs]
        params = ParamChannel.open(param, stop) if param is not None else None
        control = Control(Segment.attach(control_segment), lock, stop)
        if role == "learner":
            from fragflow.runtime.learner import Learner

            worker = Learner(plan, channels, params, control, results, init, stop)
            worker.run()
        else:
            from fragflow.runtime.actor import ActorInterpreter

            train, args, _ = cloudpickle.loads(plan.program)
            worker = ActorInterpreter(plan, index, channels[index], channels, params, control, results, init)
            try:
                with context.using(worker):
                    value = train(*(() if args is None else (args,)))
            finally:
                worker.close()
            worker.report()
            channels[index].close()
            if index == 0:
                results.put(("return", _dumps_or_none(value)))
        results.put(("done", role, index))
    except Stopped:
        results.put(("stopped", role, index))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the driver
        fragment = getattr(worker, "current", None)
        results.put(("error", role, index, fragment, _user_traceback(exc), _dumps_or_none(exc)))
        sys.exit(1)
    finally:
        for ch in channels:
            ch.detach()
        if params is not None:
            params.detach()
        if control is not None:
            control.detach()


def _user_traceback(exc: BaseException) -> str:
    """The traceback with fragflow's own frames left out (FRAGFLOW_DEBUG=1 keeps them)."""
    if os.environ.get("FRAGFLOW_DEBUG", "") not in ("", "0"):
        return "".join(traceback.format_exception(exc))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_internal(f.filename)]
    return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(exc)))


def _dumps_or_none(value: Any) -> bytes | None:
    try:
        return cloudpickle.dumps(value)
    except Exception:
        return None
