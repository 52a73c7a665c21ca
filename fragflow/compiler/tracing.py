"""Running a training function under the tracer: :func:`trace` (its graph) and
:func:`trace_program` (the graph and the fragments, or, with a handover, the beginning of a run in
this process). The tracer itself, what it does at each fragment call, is :mod:`fragflow.compiler.tracer`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

from fragflow import context
from fragflow.api.fragment import Fragment
from fragflow.compiler import probes
from fragflow.compiler.ir import Graph
from fragflow.compiler.loops import LoopWatcher
from fragflow.compiler.moduledata import ModuleData
from fragflow.compiler.reach import function_loads_global, function_reads
from fragflow.compiler.tracer import Tracer, _StopTracing
from fragflow.compiler.watchers import ThreadsSet, rng_state, set_rng_state, watch_env_makers
from fragflow.errors import ConfigError, FragflowError, NoFragmentError
from fragflow.source import SourceLoc, definition_of


def trace(train: Callable[..., Any], *args: Any, max_updates: int = 2, **kwargs: Any) -> Graph:
    """Trace ``train(*args, **kwargs)`` into a verified :class:`~fragflow.compiler.ir.Graph`.

    Global random states (``random``, ``numpy``, ``torch``) are restored afterwards, so a run
    that follows the trace starts exactly as an untraced one would.
    """
    return trace_program(train, *args, max_updates=max_updates, **kwargs)[0]


def trace_program(train: Callable[..., Any], *args: Any, max_updates: int = 2,
                  on_progress: Callable[[int, int], None] | None = None,
                  handover: Callable[[Tracer], Any] | None = None,
                  **kwargs: Any) -> tuple[Graph, dict[str, Fragment]]:
    """:func:`trace`, also returning the fragment objects by node name (what executors call).

    With ``handover`` the trace is the start of the run (one process): ``handover(tracer)`` is
    called where tracing would stop, with the graph so far in ``tracer.traced``; the interpreter
    it returns runs the rest of the loop from that call on, in the user's frames (random states
    are not restored, environments stay open: its resources). Returning None unwinds as without
    it. The run's outcome is then in ``tracer.taken_by`` / ``tracer.value`` (a loop that ends
    before tracing would stop has run whole, and is handed over then)."""
    train = getattr(train, "__fragflow_train__", train)
    if inspect.isgeneratorfunction(train) or inspect.iscoroutinefunction(train) or inspect.isasyncgenfunction(train):
        kind = "a generator function (it contains yield)" if inspect.isgeneratorfunction(train) else "an async function"
        raise ConfigError(f"the training function '{getattr(train, '__name__', train)}' is {kind}: calling it runs "
                          "none of its loop", where=definition_of(train),
                          fix="make it a plain function that runs its loop: send what it yields to ff.log, and "
                              "return what it ends with")
    module_fragments = tuple(v for v in getattr(train, "__globals__", {}).values()
                             if isinstance(v, Fragment) and v.role in ("actor", "learner", "buffer", "env"))
    tracer = Tracer(max_updates=max_updates, expected=module_fragments, on_progress=on_progress)
    watcher = LoopWatcher(train)
    tracer.loop_file = watcher.file
    tracer.state_use.loop_code = watcher.code
    tracer.loop_ranges = [(line, last) for line, (_, last, _) in watcher.loops.items()]
    defined_at = definition_of(train)
    # environments the program makes itself, not with ff.envs.make, and the training function's lines
    # where they were stepped
    own_envs: set[tuple[SourceLoc, int | None]] = set()

    def own_env(graph: Graph) -> SourceLoc | None:
        """The first such environment the training loop steps: at a line of a loop of the training
        function around a fragment call (or where it has no loop to tell by), not one stepped only
        before it (demonstrations for offline learning)."""
        calls = [n.called_at.line for n in graph.fragments()
                 if n.called_at is not None and n.called_at.file == watcher.file]
        loops = [(line, last) for line, (_, last, _) in watcher.loops.items()
                 if any(line <= c <= last for c in calls)]
        for made_at, line in sorted(own_envs, key=lambda e: (e[0].line, e[1] or 0)):
            if line is None or not loops or any(a <= line <= b for a, b in loops):
                return made_at
        return None

    def finish() -> tuple[Graph, dict[str, Fragment]]:
        if not tracer._nodes:
            raise NoFragmentError(
                f"the training loop '{getattr(train, '__name__', train)}' ran to its end without calling a fragment",
                where=defined_at,
                fix="mark the functions the loop calls with @ff.fragment('actor' | 'learner' | 'env' | 'buffer') "
                    "and step environments made with ff.envs.make(...)")
        graph = tracer.graph(getattr(train, "__name__", "train"), defined_at)
        graph = dataclasses.replace(graph, loops=tuple(watcher.specs()), loop_reads=tuple(r for r in tracer.loop_reads if r.what != probes.PRINTED),
                                    loop_prints=tuple(r for r in tracer.loop_reads if r.what == probes.PRINTED),
                                    remade_state=tracer.remade_state, learner_again=tracer.learner_again, _index={},
                                    changed_optimizer=tracer.changed_optimizer, nested_learner=tracer.nested_learner,
                                    stale_state=tracer.stale_state, state_read=tracer.state_read,
                                    state_printed=tracer.state_printed,
                                    state_used=tracer.state_use.first,
                                    star_state=tracer.star_state, changed_arg=tracer.changed_arg,
                                    own_env=own_env(graph),
                                    program_threads=tracer.threads_set.most if tracer.threads_set else 0,
                                    makes_evaluation=any(getattr(r, "evaluation", False) is True
                                                         for r in tracer._resources),
                                    log_columns=tuple(tracer.log_columns),
                                    log_clash=tracer.log_clash,
                                    shared_key=tracer.shared_key,
                                    loop_reads_changed=tuple((rec.name, label) for rec in tracer._nodes.values()
                                                             for ident, label in rec.changes_data.items()
                                                             if function_reads(train, label, ident)) +
                                    tuple((who, label) for (_, name), (who, label, scope) in tracer._rebound.items()
                                          if function_loads_global(train, scope, name)),
                                    uncalled_learners=tuple((f.name, f.defined_at) for f in module_fragments
                                                            if f.role == "learner" and id(f) in tracer._expected))
        return graph.verify(), tracer.fragments

    if handover is not None:
        tracer.journal = []

        def take(t: Tracer) -> Any:
            t.traced = finish()
            return handover(t)

        tracer.handover = take
        one_process = bool(getattr(handover, "one_process", False))
        tracer.quick = one_process and os.environ.get("FRAGFLOW_TRACE_EVERY_CALL", "").lower() not in ("1", "true", "yes")
        tracer.reached = getattr(handover, "reached", None) if one_process else None
        tracer.begins_run = one_process
        tracer.on_taken = watcher.stop
    saved = rng_state()
    # (the user's module data as imported: put back where the trace unwinds, as the random states are)
    module_data = tracer.module_data = ModuleData([
        getattr(train, "__globals__", {}),
        *(getattr(getattr(f.fn, "__func__", f.fn), "__globals__", {}) for f in module_fragments)])
    import torch
    from threadpoolctl import threadpool_limits

    from fragflow.runtime.worker import blas_threads, threads_for

    threads = torch.get_num_threads()
    torch.set_num_threads(threads_for(1))   # as the run will: small kernels on a busy machine crawl with more
    threads_set = tracer.threads_set = ThreadsSet(torch)   # (a program that sets its own keeps them, in the run it begins too)
    setattr(torch, "set_num_threads", threads_set)  # noqa: B010
    imported = threads_set.rebind()   # (and where the user's modules imported it by name)
    module_data.watched(imported)
    unwatch_envs = watch_env_makers(own_envs, watcher.line_now)
    completed = False   # the trace ran to its end (not raised out of)
    blas = threadpool_limits(threads_for(1), user_api="blas")   # (numpy's matrix products: as torch's)
    try:
        tracer.blas_set = blas_threads()   # (as read back: a program that sets its own keeps them, as torch's)
        ran_whole = False   # the loop ended while traced
        with context.using(tracer):
            try:
                with probes.recording(tracer.loop_reads), tracer.watching_state():
                    watcher.run(train, *args, **kwargs)
                tracer.value = watcher.value
                ran_whole = tracer.taken_by is None
            except _StopTracing:
                pass
            except (KeyboardInterrupt, Exception) as exc:
                # (Ctrl-C, SIGTERM, the program's own error) where the trace is a single_process run's beginning,
                # the run has begun: it is placed, and what it did goes to its outputs, as a later failure's
                # does (a mistake fragflow finds while tracing is a usage error: nothing is written)
                if not isinstance(exc, FragflowError) and tracer.begins_run and tracer.handover is not None \
                        and tracer.taken_by is None and tracer.failed is None:
                    try:
                        tracer.taken_by = tracer.handover(tracer)
                    except Exception:   # nothing to place yet (no fragment called): nothing was run
                        pass
                raise
        if ran_whole and tracer.handover is not None:   # that was the run, if one process runs it
            try:
                tracer.taken_by = tracer.handover(tracer)
            except BaseException as exc:
                tracer.failed = exc
        completed = True
    finally:
        unwatch_envs()
        torch.set_num_threads = threads_set.original
        for scope, name in imported:
            if scope.get(name) is threads_set:
                scope[name] = threads_set.original
        if tracer.taken_by is None:
            tracer.close()
            set_rng_state(saved)
        torch.set_num_threads(threads)
        blas.restore_original_limits()
        # the module's data put back once the graph is made (its checks compare what the loop changed
        # with the data as the fragments first read it), not where a single_process run's beginning made it
        # (what it did is the run's, as eagerly)
        restore = tracer.taken_by is None and not tracer.begins_run
        if restore and not completed:   # (the trace raised: no graph to make)
            module_data.restore()
    try:
        if tracer.failed is not None:
            raise tracer.failed
        if tracer.traced is not None:
            return tracer.traced
        return finish()
    finally:
        if restore:
            module_data.restore()
