"""The driver: trace -> verify -> place -> execute, with outputs and a summary.

>>> from fragflow.algorithms import ppo                                              # doctest: +SKIP
>>> result = run(ppo.train, ppo.Args(total_timesteps=20_000), out="runs/demo")        # doctest: +SKIP
>>> result.summary["steps_per_second"]                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fragflow import __version__
from fragflow.api.fragment import Fragment
from fragflow.compiler.ir import EdgeKind, Graph
from fragflow.compiler.printer import format_placed
from fragflow.compiler.resumable import loop_lines
from fragflow.compiler.tracer import trace_program
from fragflow.errors import ConfigError, PlacementError
from fragflow.lowering import Lowered, lower
from fragflow.placement import registry as policies
from fragflow.placement.placed import PlacedGraph
from fragflow.progress import ProgressDisplay
from fragflow.runtime import calls, serial
from fragflow.runtime.checkpoint import Checkpoint, CheckpointError, Every, RunCheckpoints, loop_headers
from fragflow.runtime.checkpoint import find as find_checkpoint
from fragflow.runtime.loop import state_checks
from fragflow.runtime.monitor import Monitor, StopRun
from fragflow.runtime.outputs import RunOutputs


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a run: handled like Ctrl-C (stop, clean up, write the summary)."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:   # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _checkpoint_on_interrupt(checkpoints: RunCheckpoints | None) -> Iterator[None]:
    """With checkpointing on, the first Ctrl-C writes a checkpoint at the loop's next trip and then
    stops the run; a second Ctrl-C stops it at once."""
    if checkpoints is None or not checkpoints.enabled:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if checkpoints.stop_after:
            raise KeyboardInterrupt
        checkpoints.stop_after = True
        checkpoints.request()
        sys.stderr.write("\ninterrupted: writing a checkpoint at the loop's next trip, then stopping "
                         "(Ctrl-C again stops now)\n")

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class RunResult:
    value: Any                         # what the training function returned (versioned state unwrapped)
    summary: dict[str, Any]
    graph: Graph
    placed: PlacedGraph
    out: Path | None = None
    episodes: list[tuple[int, float, int]] = field(default_factory=list)

    @property
    def episode_returns(self) -> list[float]:
        return [r for _, r, _ in self.episodes]


@dataclass(frozen=True)
class Compiled:
    """A traced, placed and lowered program; ``program`` is what worker processes receive."""

    placed: PlacedGraph
    fragments: dict[str, Fragment]
    lowered: Lowered
    checks: dict[str, Any]
    program: bytes | None     # None: one group in one process, run by the serial executor
    train: Callable[..., Any] | None = None   # the training function as compiled (loops report trips)
    seconds: float = 0.0      # how long tracing, placing and lowering took (a warm-up is traced through)

    @property
    def serial(self) -> bool:
        return self.program is None


def compile(train: Callable[..., Any], args: Any = None, *, policy: str | None = None,
            on_trace: Callable[[int, int], None] | None = None) -> Compiled:
    """Trace ``train(args)``, place it with ``policy`` (or the decorator's, or the default) and lower
    it; every configuration error surfaces here, before a run writes anything. ``on_trace(env_steps,
    updates)`` hears how far the trace has run, a few times a second (a warm-up before the first
    update, as DQN's, is run through while tracing)."""
    started = time.perf_counter()
    spec, options = policies.resolve(policy, train)
    from fragflow.compiler.resumable import resumable

    train = resumable(train)   # its top-level loops report their trips: checkpoints, resume, restarts
    call_args = () if args is None else (args,)
    graph, fragments = trace_program(train, *call_args, on_progress=on_trace)
    placed = spec.place(graph, options).verify()
    _refuse_unsendable_views(placed)
    lowered = lower(placed)
    if lowered.services and graph.remade_state is not None:
        raise PlacementError(
            f"ff.versioned(...) made new state in the loop, after a learner had written the state made there "
            f"before, but policy '{placed.policy}' runs the learner in another process, which keeps the state it "
            "was given: state made again in the loop never reaches it", where=graph.remade_state,
            fix="make versioned state once, before the loop, and let the learner return its next value (to start "
                "it afresh, return the fresh value from the learner), or run with --policy single_process")
    captured = [n for n in graph.fragments() if n.reads_captured]
    if lowered.services and captured:
        n = captured[0]
        raise PlacementError(
            f"{n.role} fragment '{n.name}' reads the versioned state {n.reads_captured} instead of receiving it as "
            f"an argument, but policy '{placed.policy}' runs the program in several processes: a fragment sees the "
            "version its placement gives it only through its arguments", where=n.defined_at,
            fix=f"add a parameter to '{n.name}' and pass the state (or a view such as state['model']) at the call, "
                "or run with --policy single_process")
    checks = state_checks(graph)
    checks["called_at"] = {n.name: n.called_at for n in graph.fragments()}
    checks["captured"] = frozenset(n.name for n in captured)
    program = None
    if lowered.services:
        import sys

        import cloudpickle

        module = sys.modules.get(getattr(train, "__module__", ""), None)
        if module is not None and module.__name__.startswith("fragflow_user_"):
            cloudpickle.register_pickle_by_value(module)   # loaded from a file path: workers cannot import it
        from fragflow.api.envs import registered_by_user

        program = cloudpickle.dumps((lowered, checks, train, args, registered_by_user()))
    return Compiled(placed, fragments, lowered, checks, program, train, round(time.perf_counter() - started, 3))


def _refuse_unsendable_views(placed: PlacedGraph) -> None:
    """A view of versioned state read in another process is a path of keys the broadcast names;
    one that slices (``state["w"][:4]``) runs in one process only, as eagerly."""
    if len(placed.groups) == 1 and placed.groups[0].program == "loop":
        return
    from fragflow.lowering.program import parse_path

    graph = placed.graph
    for e in graph.edges_of(EdgeKind.STATE_READ):
        try:
            parse_path(e.src_port)
        except (ValueError, SyntaxError):
            raise PlacementError(
                f"fragment '{e.dst}' reads the view {e.src}{e.src_port} of versioned state, which is not a path of "
                f"keys, and policy '{placed.policy}' sends versions to other processes by path",
                where=graph.node(e.dst).called_at,
                fix=f"pass {e.src} (or a view by keys, such as {e.src}['w']) and slice or index the array inside "
                    f"'{e.dst}', or run with --policy single_process") from None


def run(train: Callable[..., Any], args: Any = None, *, policy: str | None = None,
        out: str | os.PathLike[str] | None = None, target_return: float | None = None,
        stop_on_target: bool = False, progress: bool = False, description: str | None = None,
        compiled: Compiled | None = None, checkpoint_every: str | int | Every | None = None,
        resume: str | os.PathLike[str] | Checkpoint | None = None, program_ref: str | None = None,
        max_restarts: int = 3, backend: str = "local", address: str | None = None) -> RunResult:
    """Compile (unless ``compiled`` is given) and run a training function under a distribution policy.

    ``checkpoint_every`` (updates, or a duration such as ``"5m"``) writes ``out/checkpoints/<updates>/``;
    ``resume`` (a run directory or one of its checkpoints) continues a run from one: its versioned
    state, loop position, random states and counters (environments are reset). ``program_ref``
    is what the manifest records to load the algorithm again (a file path or built-in name).
    ``max_restarts``: how many times each actor process that dies is started again (placements
    whose actors can be, see ``fragflow graph --policy``); beyond it the run stops. ``backend``:
    ``local`` (processes on this machine) or ``ray`` (Ray actors; ``address`` of the cluster, else
    a local Ray instance); a one-process placement runs in this process whatever the backend."""
    from fragflow import backends

    backends.get(backend)   # an unknown name fails here, before anything runs
    calls.check_every()     # so does a malformed FRAGFLOW_CHECK_EVERY
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts} is negative", fix="give 0 (never restart) or more")
    every = checkpoint_every if isinstance(checkpoint_every, Every) or checkpoint_every is None \
        else Every.parse(str(checkpoint_every))
    start = resume if isinstance(resume, Checkpoint) or resume is None else find_checkpoint(resume)
    if (every is not None or start is not None) and out is None:
        out = start.run_dir if start is not None else None
        if out is None:
            raise ConfigError("checkpoints need a run directory", fix="pass out=... (the CLI's --out)")
    compiled = compiled or compile(train, args, policy=policy)
    placed = compiled.placed
    train = compiled.train or train
    call_args = () if args is None else (args,)
    total = getattr(args, "total_timesteps", None)
    checkpoints = None
    if every is not None or start is not None:
        assert out is not None
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and not isinstance(args, type) else None
        identity: dict[str, Any] = {"algorithm": placed.graph.name, "fragments": sorted(n.name for n in placed.graph.fragments()),
                    "program": program_ref, "checkpoint_every": None if every is None else
                    (str(every.updates) if every.updates is not None else f"{every.seconds:g}s"), "args": config, "policy": placed.policy,
                    "policy_options": dict(placed.options), "fragflow": __version__, "loops": loop_headers(train)}
        if start is not None:
            start = start.with_parts()   # a damaged file is refused now, before the run starts
        checkpoints = RunCheckpoints(Path(out), every, identity, start)
        checkpoints.check_fits(identity["fragments"], compiled.lowered.loop.replicas, identity["loops"])
        if every is not None and not loop_lines(train):
            raise ConfigError("this training function cannot be checkpointed: fragflow found no top-level loop in its "
                              "source", where=placed.graph.fragments()[0].called_at if placed.graph.fragments() else None,
                              fix="define the training function in a file, with its loop (for/while) in its own body")
    resumed_at = (int(start.counters.get("updates", 0)), int(start.counters.get("env_steps", 0))) \
        if start is not None else None
    outputs = RunOutputs(out, resumed_at=resumed_at) if out is not None else None
    display = ProgressDisplay(description or str(getattr(train, "__name__", "train")), total) if progress else None
    monitor = Monitor(outputs=outputs, progress=display, target_return=target_return,
                      stop_on_target=stop_on_target)
    if start is not None:
        monitor.resume(start.counters)
    if outputs is not None and start is None:
        outputs.write_text("graph.txt", format_placed(placed))
    status = "failed"
    value = None
    monitor.start()
    try:
        with _sigterm_as_interrupt():
            with _checkpoint_on_interrupt(checkpoints):
                if compiled.program is None:
                    value = serial.execute(train, call_args, monitor, compiled.lowered.loop, compiled.checks, checkpoints)
                else:
                    from fragflow.runtime import multiprocess

                    value = multiprocess.execute(compiled.lowered, compiled.program, monitor, checkpoints, max_restarts,
                                                 backend, address)
        status = "completed"
    except StopRun:
        status = "stopped_at_target"
    except Terminated:
        status = "terminated"
        raise
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        monitor.close()
        summary = _summary(placed, args, monitor, status, backend if compiled.program is not None else "local")
        summary["trace_seconds"] = compiled.seconds
        if checkpoints is not None:
            # the last ones kept, each once (a final checkpoint may rewrite the one written at its update)
            summary["checkpoints"] = list(dict.fromkeys(str(p) for p in checkpoints.written if p.exists()))
            if start is not None:
                summary["resumed_from"] = str(start.path)
        refused = start is not None and isinstance(sys.exc_info()[1], CheckpointError)
        if outputs is not None and refused and not outputs.begun:
            outputs.close()   # the checkpoint does not fit: the run directory stays as it was
        elif outputs is not None:
            if start is not None:
                outputs.write_text("graph.txt", format_placed(placed))
            outputs.write_json("summary.json", summary)
            outputs.plot_returns(monitor.episodes, target_return)
            outputs.close()
    return RunResult(value, summary, placed.graph, placed, Path(out) if out is not None else None, monitor.episodes)


def _summary(placed: PlacedGraph, args: Any, monitor: Monitor, status: str, backend: str = "local") -> dict[str, Any]:
    import gymnasium
    import torch

    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and not isinstance(args, type) else None
    return {
        "status": status,
        "policy": placed.policy,
        "policy_options": dict(placed.options),
        "backend": backend,
        "algorithm": placed.graph.name,
        "args": config,
        **monitor.summary(),
        "versions": {"fragflow": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                     "gymnasium": gymnasium.__version__},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


__all__ = ["Compiled", "RunResult", "compile", "run"]
