"""The driver: trace -> verify -> place -> execute, with outputs and a summary.

>>> from fragflow.algorithms import ppo                                              # doctest: +SKIP
>>> result = run(ppo.train, ppo.Args(total_timesteps=20_000), out="runs/demo")        # doctest: +SKIP
>>> result.summary["steps_per_second"]                                              # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fragflow import __version__
from fragflow.api.fragment import Fragment
from fragflow.compiler.ir import EdgeKind, Graph
from fragflow.compiler.loops import guard_of
from fragflow.compiler.printer import format_placed
from fragflow.compiler.resumable import loop_lines
from fragflow.compiler.tracing import trace_program
from fragflow.errors import ConfigError, PlacementError, VersionedStateError
from fragflow.lowering import Lowered, lower
from fragflow.placement import registry as policies
from fragflow.placement.placed import PlacedGraph
from fragflow.placement.refusals import (
    left_loop,
    refuse_defined_in_loop,
    refuse_unsendable_views,
    unimportable,
    unsendable,
)
from fragflow.progress import ProgressDisplay
from fragflow.runtime import calls, heap, kernels, serial
from fragflow.runtime.calls import state_checks
from fragflow.runtime.checkpoint import Checkpoint, CheckpointError, Every, RunCheckpoints, loop_headers
from fragflow.runtime.checkpoint import find as find_checkpoint
from fragflow.runtime.monitor import RETURN_WINDOW, Monitor, StopRun, solves
from fragflow.runtime.outputs import RunOutputs
from fragflow.runtime.signals import Terminated, deferred, keeps_interrupts, shielded
from fragflow.runtime.signals import handling as _handling
from fragflow.runtime.summary import algorithm_name, args_record, error_record, run_summary
from fragflow.source import user_callsite


def _sigterm_as_interrupt() -> Any:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    return _handling({signal.SIGTERM: handler})


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

    with _handling({signal.SIGINT: handler}):
        yield


@dataclass
class RunResult:
    value: Any                         # what the training function returned (versioned state unwrapped)
    summary: dict[str, Any]
    graph: Graph
    placed: PlacedGraph
    out: Path | None = None
    episodes: list[tuple[int, float, int]] = field(default_factory=list)   # (env steps at its end, return, length)

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


def _check_given(train: Any, policy: Any, target_return: Any = None) -> None:
    """What ff.run is given, at the caller's line: a value of another kind failed
    inside (TypeError "'int' object is not callable", "expected string or bytes-like object",
    "Unknown format code 'g'"), with no line."""
    if not callable(train):
        raise ConfigError(f"ff.run got {train!r:.60} as the training function", where=user_callsite(),
                          fix="pass the function itself, then its args: ff.run(train, Args(), policy=...)")
    if policy is not None and not isinstance(policy, str):
        raise ConfigError(f"ff.run got policy={policy!r:.60}, where it takes a policy's name", where=user_callsite(),
                          fix="give it as --policy takes it: policy=\"actor_learner(actors=2)\" (`fragflow policies` "
                              "lists them)")
    if target_return is not None and (isinstance(target_return, bool) or not isinstance(target_return, numbers.Real)
                                      or not math.isfinite(target_return)):
        raise ConfigError(f"ff.run got target_return={target_return!r:.60}, where it takes a mean episode return to "
                          "reach, a finite number", where=user_callsite(), fix="give a number: target_return=475")


def compile(train: Callable[..., Any], args: Any = None, *, policy: str | None = None,
            on_trace: Callable[[int, int], None] | None = None, handover: _Handover | None = None) -> Compiled:
    """Trace ``train(args)``, place it with ``policy`` (or the decorator's, or the default) and lower
    it; every configuration error surfaces here, before a run writes anything. ``on_trace(env_steps,
    updates)`` hears how far the trace has run, a few times a second (a warm-up before the first
    update, as DQN's, is run through while tracing). With ``handover`` (what :func:`run` passes)
    a placement that runs the loop in this process runs on from where the trace stops: the
    trace is the run's beginning, and this returns once the run has ended."""
    started = time.perf_counter()
    spec, options = policies.resolve(policy, train)
    from fragflow.compiler.resumable import resumable

    train = resumable(train)   # its top-level loops report their trips: checkpoints, resume, restarts
    # a loop that changes its args (args.lr *= 0.5) changes the trace's copy, where the trace does
    # not begin the run (the processes are given the args as they were)
    traced = args if args is None or (handover is not None and spec.one_process) else _traced_copy(args)
    call_args = () if traced is None else (traced,)
    if handover is not None:
        handover.prepare(lambda graph, fragments, restore=None: _placed(graph, fragments, spec, options, train, args,
                                                                        started, restore))
        handover.one_process = spec.one_process
    graph, fragments = trace_program(train, *call_args, on_progress=on_trace, handover=handover)
    if handover is not None and handover.compiled is not None:
        return handover.compiled
    return _placed(graph, fragments, spec, options, train, args, started)


def _placed(graph: Graph, fragments: dict[str, Fragment], spec: Any, options: Any, train: Callable[..., Any],
            args: Any, started: float, restore: Callable[[], None] | None = None) -> Compiled:
    """``restore``: puts the user's module data back as it was before the trace, where the trace is
    still under way (a handover's) and the run starts afresh in processes sent the program."""
    placed = spec.place(graph, options).verify()
    refuse_unsendable_views(placed)
    # what the program does that only one process can run: refused first, at its own line (lowering
    # would refuse some of it for a consequence, such as a learner that seems to write two states)
    apart = not (len(placed.groups) == 1 and placed.groups[0].program == "loop")
    if apart and graph.remade_state is not None:
        raise PlacementError(
            f"ff.versioned(...) made new state in the loop, after a learner had written the state made there "
            f"before, but policy '{placed.policy}' runs the learner in another process, which keeps the state it "
            "was given: state made again in the loop never reaches it", where=graph.remade_state,
            fix="make versioned state once, before the loop, and let the learner return its next value (to start "
                "it afresh, return the fresh value from the learner), or run with --policy single_process")
    if apart and graph.state_read is not None:
        what, where = graph.state_read
        raise VersionedStateError(
            f"versioned state was {what} in the training loop, but policy '{placed.policy}' runs the learner that "
            "writes it in another process: the loop holds no value of it", where=where,
            fix="pass the versioned state (or a view of it such as state['params']) to a fragment and compute with "
                "it there, returning what the loop needs; or run with --policy single_process, where the loop "
                "reads it as eagerly")
    if apart and graph.state_used is not None:
        kind, state, label, how, where = graph.state_used
        what = f"({label}, {how})" if how else f"({label})"
        if kind == "changed":
            raise VersionedStateError(
                f"the training loop changes versioned state '{state}' in place {what} through a variable of its "
                f"own, not the state's handle, but policy '{placed.policy}' runs the learner that writes the state "
                "in another process, with a copy of its own: the change would never reach it", where=where,
                fix="make the change in a learner that writes the state, passing it what the change needs as an "
                    "argument (learn(state, batch, decay), decaying there), or before ff.versioned(...) makes the "
                    "state; or run with --policy single_process, where the loop's object is the state, as eagerly")
        raise VersionedStateError(
            f"the training loop reads versioned state '{state}' {what} through a variable of its own, not the "
            f"state's handle, after a learner wrote the state, but policy '{placed.policy}' runs the learner in "
            "another process: the loop's copy is not the learner's newest version", where=where,
            fix="pass the state (or a view of it such as state['q']) to a fragment and compute with it there, "
                "returning what the loop needs (a value to log: a learner's metric); or run with --policy "
                "single_process, where the loop reads it as eagerly")
    if apart and graph.star_state is not None:
        what, who, where = graph.star_state
        raise VersionedStateError(
            f"{what}, but policy '{placed.policy}' sends versions to other processes by parameter", where=where,
            fix=f"give '{who}' a named parameter for each state or view it reads (def f(obs, w0, w1)), or pass the "
                "whole state and index it inside, or run with --policy single_process")
    captured = [n for n in graph.fragments() if n.reads_captured]
    if apart and captured:
        n = captured[0]
        raise PlacementError(
            f"{n.role} fragment '{n.name}' reads the versioned state {n.reads_captured} instead of receiving it as "
            f"an argument, but policy '{placed.policy}' runs the program in several processes: a fragment sees the "
            "version its placement gives it only through its arguments", where=n.defined_at,
            fix=f"add a parameter to '{n.name}' and pass the state (or a view such as state['model']) at the call, "
                "or run with --policy single_process")
    if apart:
        refuse_defined_in_loop(placed)
    lowered = lower(placed)
    checks = state_checks(graph)
    checks["called_at"] = {n.name: n.called_at for n in graph.fragments()}
    checks["arity"] = {n.name: n.arity for n in graph.fragments()}   # (the loop unpacks that many outputs)
    checks["torch_mode"] = {n.name: n.torch_mode for n in graph.fragments() if n.torch_mode}   # (a served call runs in it)
    checks["kinds"] = {n.name: n.out_kinds for n in graph.fragments() if n.out_kinds is not None}   # (... of the kinds traced)
    checks["loops"] = graph.loops   # (a fragment first called after the trace: defined in one?)
    checks["guarded_at"] = {n.name: guard for n in graph.fragments() if (guard := guard_of(n.called_at, graph.loops))}
    checks["left_loop"] = {n.name: loop for n in graph.fragments() if (loop := left_loop(graph, n.name)) is not None}
    # (what a refusal of replicas leaving the loop apart suggests: the policy with max_lag=0, where an evaluation
    # env's return decides)
    checks["policy"] = (placed.policy, dict(placed.options))
    # (an evaluation env first stepped after the trace, every few updates, decides it as well)
    checks["evaluates"] = graph.makes_evaluation or any(n.evaluation for n in graph.fragments("env"))
    checks["captured"] = frozenset(n.name for n in captured)
    # module data a fragment reaches, which the run checks where it is served apart (the loop changing it
    # after the trace, as from update 100 on, would never reach the fragment's copy)
    checks["reaches"] = {n.name: n.reaches for n in graph.fragments() if n.reaches}
    checks["process"] = process_settings()   # (what the training function set process-wide, for every worker)
    program = None
    if lowered.services:
        import cloudpickle

        if restore is not None:   # (the run starts from the module as imported, not as the trace left it)
            restore()

        from fragflow.api.envs import registered_by_user
        from fragflow.compiler.resumable import InModule

        module = sys.modules.get(getattr(train, "__module__", ""), None)
        by_value = module is not None and unimportable(module)
        if by_value:
            cloudpickle.register_pickle_by_value(module)   # loaded from a file path: workers cannot import it
        # (imported by its name: the recompiled function over the module's own globals in the worker)
        sent = InModule(train) if not by_value and InModule.fits(train) else train
        _modules_by_name()
        try:
            program = cloudpickle.dumps((lowered, checks, sent, args, registered_by_user()))
        except Exception as exc:
            raise unsendable(args, placed.policy, train, exc) from None
    return Compiled(placed, fragments, lowered, checks, program, train, round(time.perf_counter() - started, 3))


class _Handover:
    """Trace as run: where the placement runs the whole loop in this process (``single_process``),
    the trace is the run's beginning. Where tracing stops, the graph so far is placed; if it lowers
    to one process, a serial interpreter takes the loop over from that call on (the env steps,
    episodes, updates and logged values of the trace go to the monitor first, at the times they
    happened), so the loop runs once, as eagerly: its warm-up is not run twice, and what it prints
    or writes is printed or written once. Otherwise the trace unwinds and the run starts afresh in
    its processes."""

    def __init__(self, monitor: Monitor, begin: Callable[[Compiled], None]) -> None:
        self.monitor = monitor
        self.begin = begin           # the run's outputs and progress, once placed
        self.compiled: Compiled | None = None
        self.begun = False           # the run has begun: from here on a failure is the run's
        self.tracer: Any = None
        self.one_process = False     # the placement is one process whatever the graph (no probes needed)
        self._recent: deque[float] = deque(maxlen=RETURN_WINDOW)   # the trace's last training returns
        self._place: Callable[..., Compiled] | None = None

    def prepare(self, place: Callable[..., Compiled]) -> None:
        self._place = place

    def reached(self, finished: list[tuple[float, int]]) -> bool:
        """The training episodes heard while tracing reach the run's target, which stops it (the
        monitor's test, on the returns the monitor hears only when the trace is replayed)."""
        if not self.monitor.stop_on_target:
            return False
        self._recent.extend(ret for ret, _ in finished)
        return solves(self._recent, self.monitor.target_return)

    @property
    def finished(self) -> bool:
        """The run ended inside the trace (whole, or taken over): nothing is left to execute."""
        return self.tracer is not None and self.tracer.taken_by is not None

    def __call__(self, tracer: Any) -> Any:
        assert self._place is not None and tracer.traced is not None
        self.tracer = tracer
        compiled = self.compiled = self._place(*tracer.traced, restore=getattr(tracer.module_data, "restore", None))
        if not compiled.serial:
            return None
        import torch
        from threadpoolctl import threadpool_limits

        from fragflow.runtime.worker import blas_threads, threads_for

        interp = serial.interpreter(compiled.lowered.loop, self.monitor, compiled.checks)
        interp.events = tracer.events
        interp._names = interp._state_names = tracer._names
        interp.instance_name = tracer.instance_name
        interp.name_nodes({key: (tracer.fragments[rec.name], rec.name) for key, rec in tracer._nodes.items()})
        interp._states = dict(tracer._latest)
        self.begun = True
        self.begin(compiled)
        if self.monitor.progress is not None:
            self.monitor.progress.start()
        journal, tracer.journal = tracer.journal, None
        clock = compiled.checks.get("clock")
        monitor = self.monitor
        try:
            for entry in journal:
                monitor.replay_time = entry[1]
                if entry[0] == "steps":
                    interp.reporter.env_step(entry[2], entry[3], entry[4])
                elif entry[0] == "learn" and entry[2] == clock:
                    interp.update += 1
                    monitor.update()
                elif entry[0] == "log":
                    monitor.log_scalars(entry[2])
                elif entry[0] == "clock":
                    monitor.loop_begins(entry[1])
        finally:
            monitor.replay_time = None
        interp.resources.extend(tracer._resources)   # the environments it made: closed when the run ends
        tracer._resources = []
        set_by_program = tracer.threads_set is not None and tracer.threads_set.called
        if not set_by_program and torch.get_num_threads() == threads_for(1):   # as the trace set them: the run's
            set_threads = tracer.threads_set.original if tracer.threads_set is not None else torch.set_num_threads
            set_threads(threads_for(compiled.lowered.loop.threads))
        if blas_threads() == tracer.blas_set:   # (where the program set its own, its own)
            threadpool_limits(torch.get_num_threads(), user_api="blas")   # numpy's as torch's (put back as the trace ends)
        return interp


def process_settings() -> dict[str, Any]:
    """Process-wide numeric settings a training function may make (torch's default dtype, jax's
    64-bit mode), as the trace left them: a worker that does not fork from this process (a fork
    server, Ray) starts with the defaults, and makes them again before the program runs."""
    out: dict[str, Any] = {}
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_default_dtype() != torch.float32:
        out["torch_default_dtype"] = str(torch.get_default_dtype()).removeprefix("torch.")
    jax = sys.modules.get("jax")
    if jax is not None and bool(getattr(jax.config, "jax_enable_x64", False)):
        out["jax_enable_x64"] = True
    return out


def apply_process_settings(settings: dict[str, Any]) -> None:
    if "torch_default_dtype" in settings:
        import torch

        torch.set_default_dtype(getattr(torch, settings["torch_default_dtype"]))
    if settings.get("jax_enable_x64"):
        import jax

        jax.config.update("jax_enable_x64", True)


def _traced_copy(args: Any) -> Any:
    """A copy of the program's args for a trace the run does not continue: what the loop changes in
    them while traced must not carry into the run."""
    try:
        return copy.deepcopy(args)
    except Exception:   # (an object that cannot be copied: traced as it is)
        return args


@keeps_interrupts
def run(train: Callable[..., Any], args: Any = None, *, policy: str | None = None,
        out: str | os.PathLike[str] | None = None, target_return: float | None = None,
        stop_on_target: bool = False, progress: bool = False, description: str | None = None,
        compiled: Compiled | None = None, checkpoint_every: str | int | Every | None = None,
        resume: str | os.PathLike[str] | Checkpoint | None = None, program_ref: str | None = None,
        max_restarts: int = 3, backend: str = "local", address: str | None = None,
        on_trace: Callable[[int, int], None] | None = None,
        on_compiled: Callable[[Compiled], None] | None = None) -> RunResult:
    """Compile (unless ``compiled`` is given) and run a training function under a distribution policy.

    ``checkpoint_every`` (updates, or a duration such as ``"5m"``) writes ``out/checkpoints/<updates>/``;
    ``resume`` (a run directory or one of its checkpoints) continues a run from one: its versioned
    state, loop position, random states and counters (environments are reset). ``program_ref``
    is what the manifest records to load the algorithm again (a file path or built-in name).
    ``max_restarts``: how many times each actor process that dies is started again (placements
    whose actors can be, see ``fragflow graph --policy``); beyond it the run stops. ``backend``:
    ``local`` (processes on this machine) or ``ray`` (Ray actors; ``address`` of the cluster, else
    a local Ray instance); a one-process placement runs in this process whatever the backend.

    Without ``compiled`` (and without checkpoints), a placement that runs the loop in this process
    takes it over from the trace (see :class:`_Handover`): the warm-up the trace ran through is not
    run again. ``on_trace`` hears the trace's progress (see :func:`compile`); ``on_compiled`` gets
    the compiled program once placed, before the run's progress display starts."""
    from fragflow import backends

    _check_given(train, policy, target_return)
    backends.get(backend)   # an unknown name fails here, before anything runs
    if backend == "ray" and (address or os.environ.get("RAY_ADDRESS")):   # (and a cluster that does not answer)
        from fragflow.backends import ray as ray_backend

        ray_backend.reachable(address or os.environ["RAY_ADDRESS"])
        # joined now: one that answers but refuses the join (its token, another Ray version) before the trace
        ray_backend.connect(address)
    # so does a malformed FRAGFLOW_CHECK_EVERY, FRAGFLOW_THREADS, FRAGFLOW_START_METHOD, FRAGFLOW_ALLREDUCE,
    # FRAGFLOW_STALL_WARN, FRAGFLOW_MALLOC or FRAGFLOW_LINEAR
    calls.check_every()
    heap.malloc_setting()
    kernels.setting()
    kernels.reset()   # (the run's processes choose by the setting as it is now, at their first fragment)
    from fragflow.backends.local import given_start_method
    from fragflow.runtime import allreduce
    from fragflow.runtime.service import stall_warn
    from fragflow.runtime.worker import threads_for

    threads_for(1)
    given_start_method()
    allreduce.setting()
    stall_warn()
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts} is negative", fix="give 0 (never restart) or more")
    every = checkpoint_every if isinstance(checkpoint_every, Every) or checkpoint_every is None \
        else Every.parse(str(checkpoint_every))
    start = resume if isinstance(resume, Checkpoint) or resume is None else find_checkpoint(resume)
    if (every is not None or start is not None) and out is None:
        out = start.run_dir if start is not None else None
        if out is None:
            raise ConfigError("checkpoints need a run directory", fix="pass out=... (the CLI's --out)")
    handover: _Handover | None = None
    total = getattr(args, "total_timesteps", None)
    display = ProgressDisplay(description or str(getattr(train, "__name__", "train")), total) if progress else None
    if compiled is None and every is None and start is None:
        monitor = Monitor(target_return=target_return, stop_on_target=stop_on_target)
        run_dir = out

        def begin(compiled: Compiled) -> None:
            # (the run has begun: a Ctrl-C as it is announced stops it once its outputs are made, its summary written)
            with deferred():
                if on_compiled is not None:
                    on_compiled(compiled)
                if run_dir is not None:
                    monitor.outputs = RunOutputs(run_dir, column_order=compiled.placed.graph.log_columns)
                    monitor.outputs.write_text("graph.txt", format_placed(compiled.placed))
                monitor.progress = display

        handover = _Handover(monitor, begin)
        checkpoints = None
        monitor.start(from_first_step=True)   # (the trace is the run's beginning: the program's setup in it)
    held: list[int] = []   # a Ctrl-C (SIGTERM) once traced and placed, delivered once the run's outputs are made
    if handover is None:
        compiled = compiled or compile(train, args, policy=policy, on_trace=on_trace)
        with _handling({signal.SIGINT: lambda s, f: held.append(s), signal.SIGTERM: lambda s, f: held.append(s)}):
            if on_compiled is not None:
                on_compiled(compiled)
            monitor, checkpoints, start = _prepared(compiled, compiled.train or train, args, out, every, start, program_ref,
                                                    display, target_return, stop_on_target)
    # the memory this process frees kept for its next allocations until the run's outputs are written
    # (heap.malloc_kept: what the run's end frees is returned to the system after it)
    with heap.malloc_kept():
        status = "failed"
        value = None
        exit_code: int | None = None
        try:
            with _sigterm_as_interrupt(), heap.frozen():
                if held:   # (raised here, it stops a run that has begun: its summary says so)
                    signal.raise_signal(held[0])
                if handover is not None:
                    compiled = compile(train, args, policy=policy, on_trace=on_trace, handover=handover)
                    if handover.finished:
                        value = serial.unwrap(handover.tracer.value)
                        status = "completed"
                    else:   # several processes: the run starts afresh, and its clock with it
                        handover.begun = True
                        handover.begin(compiled)
                        monitor.start()
                assert compiled is not None
                if handover is None or not handover.finished:
                    with _checkpoint_on_interrupt(checkpoints):
                        value = _execute(compiled, compiled.train or train, args, monitor, checkpoints, max_restarts,
                                         backend, address)
                        status = "completed"
        except StopRun:
            status = "stopped_at_target"
        except SystemExit as exc:   # the program's own sys.exit(n): its code is the run's exit (0: not a failure)
            exit_code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            status = "exited"
            raise
        except KeyboardInterrupt as exc:   # (Ctrl-C; SIGTERM as Terminated)
            if status != "completed":   # (one once the run has completed, its handlers being put back, stops nothing)
                status = "terminated" if isinstance(exc, Terminated) else "interrupted"
                raise
        finally:
            with shielded():   # (outputs closed, summary written) a second Ctrl-C (or a signal sent to a process group twice) waits for the summary
                if handover is not None and handover.finished:
                    handover.tracer.taken_by.close()
                monitor.close()
                compiled = compiled or (handover.compiled if handover is not None else None)
                if compiled is not None and (handover is None or handover.begun):
                    summary = _finish(compiled, args, monitor, status, backend, start, checkpoints, target_return,
                                      handover is not None and handover.begun and compiled.serial, exit_code)
    assert compiled is not None
    placed = compiled.placed
    return RunResult(value, summary, placed.graph, placed, Path(out) if out is not None else None, list(monitor.episodes))


def _modules_by_name() -> None:
    """Modules of a ModuleType subclass (torch.backends.cudnn, .mkldnn, .cuda.matmul: what CleanRL's
    ``torch.backends.cudnn.deterministic = True`` in the training function names) pickled by their
    name, as plain modules are: cloudpickle, sending a function of a file by value with the
    submodules it uses, took them for objects, which do not pickle."""
    import copyreg
    import importlib
    import types

    for name, module in list(sys.modules.items()):
        kind = type(module)
        if kind is not types.ModuleType and isinstance(module, types.ModuleType) and kind not in copyreg.dispatch_table \
                and getattr(module, "__name__", None) == name:
            copyreg.pickle(kind, lambda m: (importlib.import_module, (m.__name__,)))


def _prepared(compiled: Compiled, train: Callable[..., Any], args: Any, out: str | os.PathLike[str] | None, every: Every | None,
              start: Checkpoint | None, program_ref: str | None, display: ProgressDisplay | None,
              target_return: float | None, stop_on_target: bool
              ) -> tuple[Monitor, RunCheckpoints | None, Checkpoint | None]:
    """The monitor of a run of a compiled program, its checkpoints, and the checkpoint it resumes."""
    placed = compiled.placed
    checkpoints = None
    if every is not None or start is not None:
        assert out is not None
        config = args_record(args)
        identity: dict[str, Any] = {"algorithm": algorithm_name(train, placed.graph.name), "fragments": sorted(n.name for n in placed.graph.fragments()),
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
    outputs = RunOutputs(out, resumed_at=resumed_at, column_order=placed.graph.log_columns,
                         history=start.run_dir if start is not None else None,
                         resumed_from=start.path if start is not None else None) if out is not None else None
    monitor = Monitor(outputs=outputs, progress=display, target_return=target_return,
                      stop_on_target=stop_on_target)
    if start is not None:
        monitor.resume(start.counters)
    if checkpoints is not None:
        checkpoints.warn = monitor.warn
        checkpoints.flush = outputs.flush if outputs is not None else None
    if outputs is not None and start is None:
        outputs.write_text("graph.txt", format_placed(placed))
    # (one process runs the program again from its start, its setup before its loop with it: not in the rate)
    monitor.start(from_first_step=compiled.program is None)
    return monitor, checkpoints, start


def _execute(compiled: Compiled, train: Callable[..., Any], args: Any, monitor: Monitor,
             checkpoints: RunCheckpoints | None, max_restarts: int, backend: str, address: str | None) -> Any:
    if compiled.program is None:
        call_args = () if args is None else (args,)
        return serial.execute(train, call_args, monitor, compiled.lowered.loop, compiled.checks, checkpoints)
    from fragflow.runtime import multiprocess

    for message in _placeholders_printed(compiled.placed):   # (printing is no read: the run goes on, saying so)
        monitor.warn(message)
    return multiprocess.execute(compiled.lowered, compiled.program, monitor, checkpoints, max_restarts,
                                backend, address)


def _placeholders_printed(placed: PlacedGraph) -> list[str]:
    """What the loop prints of values another process holds (a learner's output; versioned state a
    learner placed apart has written): a placeholder, not the value."""
    graph, messages = placed.graph, []
    if graph.state_printed is not None:
        state, where = graph.state_printed
        writers = [e.src for e in graph.edges_of(EdgeKind.STATE_WRITE) if e.dst == state]
        if any(placed.group_of(w).program != "loop" for w in writers):
            messages.append(
                f"{where}: the loop prints versioned state '{state}', which learner '{writers[0]}' writes in another "
                f"process under policy '{placed.policy}': once written it prints a placeholder (Versioned('{state}', "
                "v1)...), not the value (return what you want to see from the learner and log it with ff.log; or run "
                "with --policy single_process)")
    for read in graph.loop_prints:
        if placed.group_of(read.fragment).program != "loop":
            messages.append(
                f"{read.where}: the loop prints output {read.path} of {graph.node(read.fragment).role} "
                f"'{read.fragment}', which runs in another process under policy '{placed.policy}': it prints a "
                f"placeholder (Pending({read.fragment}{read.path})), not the value (log it with ff.log: metrics.csv "
                "and the progress line show it; or run with --policy single_process)")
    return messages


def _finish(compiled: Compiled, args: Any, monitor: Monitor, status: str, backend: str, start: Checkpoint | None,
            checkpoints: RunCheckpoints | None, target_return: float | None, trace_in_run: bool,
            exit_code: int | None = None) -> dict[str, Any]:
    """The run's summary, written with its plots to the run directory."""
    placed = compiled.placed
    outputs = monitor.outputs
    summary = run_summary(placed, args, monitor, status, backend if compiled.program is not None else "local",
                       compiled.train)
    if exit_code is not None:   # (status "exited": the program's sys.exit, with its code)
        summary["exit_code"] = exit_code
    failure = sys.exc_info()[1]
    if status == "failed" and failure is not None:   # what failed, and where
        summary["error"] = error_record(failure)
    summary["trace_seconds"] = compiled.seconds
    summary["trace_in_run"] = trace_in_run   # the trace was the run's beginning (in its wall_seconds)
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
        outputs.settle()   # (metrics.csv whole before summary.json, which says the run has ended)
        outputs.write_json("summary.json", summary)
        outputs.plot_returns(monitor.episodes, target_return)
        outputs.close()
    return summary


__all__ = ["Compiled", "RunResult", "compile", "run"]
