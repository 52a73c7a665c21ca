"""The command line: ``fragflow run``, ``fragflow graph``, ``fragflow policies``.

Usage errors (unknown file, policy, env id or ``--set`` key; a loop fragflow cannot trace) print
one message with the user's ``file:line`` and the fix, and exit with code 2. ``--debug`` (or
``FRAGFLOW_DEBUG=1``) shows the internal traceback too.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fragflow.errors import FragflowError
from fragflow.runtime.signals import Terminated, shielded

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compile and run reinforcement-learning training loops as fragmented dataflow graphs.")
err = Console(stderr=True, soft_wrap=True, emoji=False)
out = Console(soft_wrap=True, emoji=False)

DEFAULT_ALGORITHM = "ppo"

F = TypeVar("F", bound=Callable[..., Any])

AlgorithmArg = Annotated[str, typer.Argument(help="algorithm file (e.g. algorithms/ppo.py) or built-in name (ppo)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override a field of the algorithm's Args: key=value (repeatable)")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", "-p", help="distribution policy, e.g. single_process or name(key=value,...); overrides the decorator")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="show internal tracebacks")]


def _debug(flag: bool) -> bool:
    return flag or os.environ.get("FRAGFLOW_DEBUG", "") not in ("", "0")


def _tracing(name: str, status: Any) -> Callable[[int, int], None]:
    """What the spinner says while the trace runs the loop up to its learner's first updates."""
    def report(env_steps: int, updates: int) -> None:
        status.update(f"tracing {name}: {env_steps:,} env steps, {updates} learner update{'s' * (updates != 1)}")
    return report


def _fail(exc: BaseException, debug: bool) -> typer.Exit:
    if isinstance(exc, FragflowError):
        if debug:
            traceback.print_exception(exc)
        err.print(f"[bold red]error:[/] {type(exc).__name__}: ", end="", highlight=False)
        err.print(str(exc), markup=False, highlight=False)
        return typer.Exit(code=exc.exit_code)
    backends, exits = sys.modules.get("fragflow.backends"), sys.modules.get("fragflow.runtime.exits")
    if backends is not None and isinstance(exc, backends.WorkerDied):   # no code of the user's raised: nothing to show
        if debug:
            traceback.print_exception(exc)
        err.print("[bold red]error:[/] a worker process died: ", end="", highlight=False)
        err.print(str(exc), markup=False, highlight=False)
        return typer.Exit(code=1)
    if exits is not None and isinstance(exc, exits.WorkerFailed) and not debug:
        # the user's code raised in a worker: its traceback (the user's frames), as in one process
        where = f"in fragment '{exc.fragment}'" if exc.fragment else "in a worker process"
        err.print("[bold red]error:[/] ", end="", highlight=False)
        err.print(f"the training program raised {where} ({exc.who}):", markup=False, highlight=False)
        sys.stderr.write(exc.tb.rstrip() + "\n")
        err.print("(fragflow's and libraries' frames hidden; --debug shows them)", style="dim", highlight=False)
        return typer.Exit(code=1)
    # An exception from the user's own code: show the user's frames (all frames with --debug).
    tb = exc.__traceback__
    if not debug:
        from fragflow.source import user_frames

        frames = user_frames(tb)
        err.print("[bold red]error:[/] the training program raised:", highlight=False)
        sys.stderr.write("".join(traceback.format_list(frames)))
        sys.stderr.write("".join(traceback.format_exception_only(exc)))
        err.print("(fragflow's and libraries' frames hidden; --debug shows them)", style="dim", highlight=False)
    else:
        traceback.print_exception(exc)
    return typer.Exit(code=1)


def _load(algorithm: str, sets: list[str] | None) -> tuple[Any, Any]:
    from fragflow.config import apply_overrides
    from fragflow.program import load

    program = load(algorithm)
    _check_callable(program)
    if program.args_cls is None:
        if sets:
            from fragflow.errors import ConfigError

            raise ConfigError("--set was given but the training function takes no Args dataclass",
                              where=program.where, fix="annotate the first parameter: def train(args: Args)")
        return program, None
    return program, apply_overrides(program.args_cls, sets or [], where=program.where, train_params=_others(program))


def _others(program: Any) -> tuple[str, ...]:
    """The training function's parameters after its Args (``train(args, log_every=2)``'s
    ``log_every``), which ``--set`` does not set: named where a key is one of them."""
    import inspect

    try:
        return tuple(inspect.signature(program.train).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def _check_callable(program: Any) -> None:
    """``fragflow run`` calls the training function with its Args (or with nothing): a parameter
    beyond those it cannot fill is a usage error at the function's line, not a TypeError."""
    import inspect

    try:
        params = list(inspect.signature(program.train).parameters.values())
    except (TypeError, ValueError):
        return
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    given = required[:1] if program.args_cls is not None and required and required[0] is params[0] \
        and params[0].kind in positional else []
    missing = [p.name for p in required if p not in given]
    if missing:
        from fragflow.errors import ConfigError

        raise ConfigError(
            f"the training function {getattr(program.train, '__name__', 'train')}({', '.join(p.name for p in params)}) needs "
            f"{', '.join(repr(m) for m in missing)}, which fragflow cannot give: it calls it with an instance of "
            "the dataclass its first parameter is annotated with (else with nothing)", where=program.where,
            fix="annotate the first parameter with a frozen dataclass of settings (def train(args: Args), its fields "
                "with defaults), and give every other parameter a default")


@app.command()
def run(
    algorithm: Annotated[str | None, typer.Argument(help="algorithm file (e.g. algorithms/ppo.py) or built-in name (default: ppo, or the one a --resume checkpoint names)")] = None,
    policy: PolicyOpt = None,
    set_: SetOpt = None,
    out: Annotated[str | None, typer.Option("--out", "-o", help="run directory (default runs/<algorithm>-<policy>-<time>)")] = None,
    target_return: Annotated[float | None, typer.Option(help="record when the mean return of the last 20 episodes first reaches R")] = None,
    stop_on_target: Annotated[bool, typer.Option(help="stop the run once --target-return is reached")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress display")] = False,
    checkpoint_every: Annotated[str | None, typer.Option("--checkpoint-every", help="write OUT/checkpoints/<updates>/ every N updates, or every duration (90s, 5m, 1h); Ctrl-C writes a last one")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="continue a run: its directory (newest checkpoint) or one checkpoint directory; algorithm, args and policy come from the checkpoint")] = None,
    backend: Annotated[str, typer.Option("--backend", help="where the placement's processes run: local (this machine, shared memory) or ray (Ray actors)")] = "local",
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster address (ray start --head prints it); default: RAY_ADDRESS, else a local Ray instance")] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, help="start an actor process that dies again, up to N times each (0: never); the learner is never restarted")] = 3,
    debug: DebugOpt = False,
) -> None:
    """Train: trace the loop, place it with a policy, run it, write metrics.csv, TensorBoard and summary.json."""
    debug = _debug(debug)
    # A shell starts a background job (``cmd &``) with SIGINT ignored, and Python then installs no
    # handler of its own: put Ctrl-C (and ``kill -INT``) back, so the run can always be stopped.
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    claimed: list[Path | None] = [None]   # the default run directory this run made, removed if refused unwritten
    overridden: list[str] = []   # a resumed run's args --set changed from the checkpoint's
    result: Any = None   # the run's, once it has completed
    try:
        from fragflow import driver
        from fragflow.placement import registry as policies
        from fragflow.runtime import checkpoint as ckpt

        if out is not None and not out.strip():   # (Path("") is ".": the run's files went into the current folder)
            from fragflow.errors import ConfigError

            raise ConfigError("--out got an empty path", fix="give the run's directory (--out runs/mine), or leave "
                                                               "--out out for runs/<algorithm>-<policy>-<time>")
        out_dir = Path(out) if out is not None else None
        start = ckpt.find(resume) if resume is not None else None
        if start is not None:
            ckpt.refuse_completed(start)
            algorithm, policy, args_data = _from_checkpoint(start, algorithm, policy)
            # the run's target goes on with it, as its schedule does (its solve is kept where it is the same)
            target_return = start.counters.get("target_return") if target_return is None else target_return
            stop_on_target = stop_on_target or bool(start.counters.get("stop_on_target", False))
            program, args = _load(algorithm, [])
            args = ckpt.args_from(program.args_cls, args_data)
            if set_:
                from fragflow.config import apply_overrides

                saved, args = args, apply_overrides(program.args_cls, set_, where=program.where, base=args,
                                                    train_params=_others(program))
                overridden = _changed_args(saved, args)
        else:
            program, args = _load(algorithm or DEFAULT_ALGORITHM, set_)
        if checkpoint_every is None and start is not None:
            checkpoint_every = start.manifest.get("checkpoint_every")   # a resumed run keeps checkpointing as it did
        every = ckpt.Every.parse(checkpoint_every) if checkpoint_every is not None else None
        spec, _ = policies.resolve(policy, program.train)   # a bad policy or option fails here, before tracing
        from fragflow import backends

        backends.get(backend)   # ... and so does an unknown backend
        if target_return is not None and not math.isfinite(target_return):
            from fragflow.errors import ConfigError

            raise ConfigError(f"--target-return {target_return}: a mean episode return to reach is a finite number",
                              fix="give the return that counts as solved, e.g. --target-return 475")
        if stop_on_target and target_return is None:
            from fragflow.errors import ConfigError

            raise ConfigError("--stop-on-target needs --target-return R", fix="add --target-return, e.g. 475")
        if address is not None and backend != "ray":
            from fragflow.errors import ConfigError

            raise ConfigError("--address names a Ray cluster, but the backend is local", fix="add --backend ray")
        run_dir = out_dir or (start.run_dir if start is not None else
                              Path("runs") / f"{program.name}-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if out_dir is None and start is None:   # a directory of its own, even beside a run started the same second
            run_dir = claimed[0] = _claim(run_dir)
        blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:   # before tracing: nothing could be written
            from fragflow.errors import ConfigError

            raise ConfigError(f"--out {run_dir}: {blocked} is a file, not a directory",
                              fix="give a directory for the run's outputs (it is made if missing)")
        _check_writable(run_dir)
        if backend == "ray" and (address or os.environ.get("RAY_ADDRESS")):   # a cluster that does not answer: before tracing
            from fragflow.backends import ray as ray_backend

            ray_backend.reachable(address or os.environ["RAY_ADDRESS"])
        if not err.is_terminal:   # (a terminal shows the spinner)
            err.print(f"{program.name}: tracing", highlight=False)
        status = err.status(f"tracing {program.name} ...", spinner="dots")

        def placed(compiled: driver.Compiled) -> None:   # traced and placed: the run's own display from here
            status.stop()
            placed = compiled.placed
            err.print(f"[bold]{program.name}[/]: {len(placed.graph.fragments())} fragments, policy "
                      f"[bold]{placed.policy}[/], writing to {run_dir}", highlight=False)
            if start is not None:
                c = start.counters
                err.print(f"resuming from {start.path}: update {c.get('updates')}, {c.get('env_steps')} env steps "
                          "(environments are reset)", highlight=False)

        status.start()
        try:
            # under single_process the trace is the run's beginning: the run goes on from where it stops
            result = driver.run(program.train, args, policy=policy, out=run_dir, target_return=target_return,
                                stop_on_target=stop_on_target, progress=not quiet, description=program.name,
                                checkpoint_every=every, resume=start,
                                program_ref=_program_ref(algorithm or DEFAULT_ALGORITHM), max_restarts=max_restarts,
                                backend=backend, address=address, on_trace=_tracing(program.name, status),
                                on_compiled=placed)
        finally:
            with shielded():
                status.stop()
    except KeyboardInterrupt as exc:
        if result is None:
            _unclaim(claimed[0])
            terminated = isinstance(exc, Terminated)
            err.print("terminated" if terminated else "interrupted", style="yellow")
            raise typer.Exit(code=143 if terminated else 130) from None
        # (a signal once the run has completed and written its outputs: it has nothing left to stop)
    except Exception as exc:
        _unclaim(claimed[0])
        raise _fail(_with_overrides(exc, overridden), debug) from None
    with shielded():   # (the run has completed: what it says of its outputs is said whole, and it exits 0)
        _report(result, run_dir, target_return)


def _changed_args(saved: Any, given: Any) -> list[str]:
    """``name=saved -> given`` for each field of a resumed run's args that --set changed."""
    import dataclasses

    return [f"{f.name}={getattr(saved, f.name)!r} -> {getattr(given, f.name)!r}" for f in dataclasses.fields(given)
            if getattr(saved, f.name) != getattr(given, f.name)]


def _with_overrides(exc: Exception, overridden: list[str]) -> Exception:
    """A checkpoint that does not fit the program it resumes, where --set changed the checkpoint's
    args (another env, another network size): the error names those changes (its fix said only
    'resume with the arguments that wrote it')."""
    from fragflow.runtime.snapshot import CheckpointError

    if not overridden or not isinstance(exc, CheckpointError) or \
            not exc.what.startswith("the checkpoint does not fit this program"):
        return exc
    return CheckpointError(exc.what, where=exc.where, detail=exc.detail,
                           fix=f"--set changed the checkpoint's args ({', '.join(overridden)}), and the program they "
                               "make no longer fits what it saved: resume without those --set (its args are the "
                               "checkpoint's), or start a new run with them")


def _report(result: Any, run_dir: Path, target_return: float | None) -> None:
    """What ``fragflow run`` says of a run that has completed: its figures and its outputs."""
    s = result.summary
    ret = s.get("final_return_mean")
    traced = (f"the first {s['trace_seconds']:.1f}s tracing" if s.get("trace_in_run")
              else f"traced first in {s['trace_seconds']:.1f}s")
    line = (f"done: {s['env_steps']} env steps in {s['wall_seconds']:.1f}s ({s['steps_per_second']:,.0f} steps/s; "
            f"{traced}), final return {'-' if ret is None else f'{ret:.1f}'}")
    if target_return is not None:
        solved = s.get("solved_at_seconds")
        line += f", target {target_return:g} " + ("not reached" if solved is None else f"reached at {solved:.1f}s / {s['solved_at_steps']} steps")
    out.print(line, highlight=False)
    written = [name for name in ("metrics.csv", "summary.json", "returns.png", "graph.txt") if (run_dir / name).is_file()]
    written += ["tensorboard/"] if any((run_dir / "tensorboard").glob("events.out.tfevents.*")) else []
    out.print(f"outputs: {run_dir}/{{{', '.join(written)}}}", highlight=False)
    if s.get("restarts"):
        out.print(f"restarts: {s['restarts']} (see summary.json notes)", highlight=False)
    if s.get("checkpoints"):
        from fragflow.runtime.checkpoint import listing

        newest = Path(s["checkpoints"][-1])   # (a run resumed into its directory keeps the earlier run's too)
        out.print(f"checkpoints: newest {newest} ({len(listing(newest.parent))} kept)", highlight=False)


def _program_ref(algorithm: str) -> str:
    """What a checkpoint records to load the algorithm again: a file's absolute path (the run may
    be resumed from another directory), or the built-in algorithm's name."""
    path = Path(algorithm)
    return str(path.resolve()) if path.suffix == ".py" or path.is_file() else algorithm


def _from_checkpoint(start: Any, algorithm: str | None, policy: str | None) -> tuple[str, str | None, Any]:
    """The algorithm, policy and args a resumed run takes from its checkpoint (``--policy`` may
    override the policy; an algorithm given on the command line must be the one saved)."""
    from fragflow.errors import ConfigError

    m = start.manifest
    saved = m.get("program")
    if saved is None:
        raise ConfigError(f"checkpoint {start.path} does not record which algorithm wrote it (written through the "
                          "Python API)", fix="resume it with fragflow.run(train, args, resume=...)")
    lacks = [k for k, kind in (("program", str), ("policy", str)) if not isinstance(m.get(k), kind)] + \
        ([] if "args" in m else ["args"])
    if lacks:
        from fragflow.runtime.checkpoint import CheckpointError

        raise CheckpointError(f"checkpoint {start.path} is corrupt: its manifest.json has no valid "
                              f"{' or '.join(lacks)}", fix="resume from another checkpoint of the run")
    gone = saved.endswith(".py") and not Path(saved).is_file()   # the file moved, or the run directory was copied
    if gone and algorithm is None:
        from fragflow.errors import UnknownFileError

        raise UnknownFileError(f"checkpoint {start.path} was written by {saved}, which no longer exists",
                               fix="give the algorithm file where it is now: fragflow run FILE --resume ...")
    if algorithm is not None and algorithm != saved:
        from fragflow.program import load

        if load(algorithm).name != (Path(saved).stem if gone else load(saved).name):
            from fragflow.runtime.checkpoint import CheckpointError

            raise CheckpointError(f"checkpoint {start.path} was written by {saved!r}, not {algorithm!r}",
                                  fix="leave the algorithm out: `fragflow run --resume DIR` reads it from the checkpoint")
    if policy is None:
        from fragflow.errors import ConfigError, UnknownPolicyError
        from fragflow.placement import registry
        from fragflow.runtime.checkpoint import CheckpointError

        options = m.get("policy_options") or {}
        if not isinstance(options, dict):
            raise CheckpointError(f"checkpoint {start.path} is corrupt: its manifest.json's policy_options is "
                                  f"{type(options).__name__}, not a dict of options",
                                  fix="pass the policy with --policy, or resume from another checkpoint of the run")
        policy = m.get("policy") + (f"({','.join(f'{k}={v}' for k, v in options.items())})" if options else "")
        try:   # (the run's policy as the manifest records it: a damaged one is the checkpoint's fault, not the user's)
            name, raw = registry.parse_policy(policy)
            registry.get(name).make_options(dict(raw))
        except (UnknownPolicyError, ConfigError) as exc:
            raise CheckpointError(f"checkpoint {start.path} is corrupt: its manifest.json records the policy "
                                  f"{policy!r}, which cannot be run ({exc.what})",
                                  fix="pass the policy with --policy, or resume from another checkpoint of the run") from None
    return algorithm or saved, policy, m.get("args")


@app.command()
def graph(
    algorithm: AlgorithmArg,
    set_: SetOpt = None,
    policy: PolicyOpt = None,
    image: Annotated[Path | None, typer.Option("--image", "-i", help="also draw the graph to this .png or .svg")] = None,
    no_image: Annotated[bool, typer.Option("--no-image", help="print the text form only (the default; kept for scripts)")] = False,
    debug: DebugOpt = False,
) -> None:
    """Trace an algorithm and print its fragmented dataflow graph (with --policy: its placement); --image draws it."""
    debug = _debug(debug)
    try:
        from fragflow import driver
        from fragflow.compiler.printer import format_graph, format_placed

        if image is not None and no_image:
            from fragflow.errors import ConfigError

            raise ConfigError(f"--image {image} asks for an image and --no-image for none",
                              fix="give one of them (the text form is always printed)")
        if policy is not None:   # (read before the trace: `-p ""` names no policy, it does not ask for the graph alone)
            from fragflow.placement.registry import parse_policy

            parse_policy(policy)
        program, args = _load(algorithm, set_)
        target = image
        no_image = no_image or image is None
        if target is not None and target.suffix.lower() not in (".png", ".svg"):
            from fragflow.errors import ConfigError

            raise ConfigError(f"cannot write an image to {target}", fix="give a path ending in .png or .svg")
        with err.status(f"tracing {program.name} ...", spinner="dots") as status:
            # the graph alone is placed in one process, which refuses nothing that runs eagerly: another
            # policy's refusal is for `--policy` (or the run) to give
            placed = driver.compile(program.train, args, policy=policy if policy is not None else "single_process",
                                    on_trace=_tracing(program.name, status)).placed
        text = format_placed(placed) if policy is not None else format_graph(placed.graph)
        if target is not None and not no_image:
            from fragflow.compiler.draw import draw

            try:
                draw(placed.graph, target)
            except OSError as exc:
                from fragflow.errors import ConfigError

                raise ConfigError(f"cannot write an image to {target}: {exc.strerror or exc}",
                                  fix="give a path in a directory you can write to") from None
    except Exception as exc:
        raise _fail(exc, debug) from None
    sys.stdout.write(text)
    if target is not None and not no_image:
        err.print(f"image: {target}", highlight=False)


@app.command("policies")
def list_policies() -> None:
    """List the distribution policies, with the system each mirrors."""
    from fragflow.placement.registry import available, default_policy

    policies = available()
    default = default_policy()
    width = max(len(n) for n in policies) + len(" (default)")
    for name, spec in policies.items():
        label = name + (" (default)" if name == default else "")
        sys.stdout.write(f"{label:<{width}}  mirrors {spec.mirrors}: {spec.summary}\n")
        sys.stdout.write(f"{'':<{width}}  options: {spec.signature() or 'none'}\n")


def _claim(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``...: the first that this process makes (runs started in the
    same second, a seed sweep started with ``&``, each get a directory of their own)."""
    for n in range(1, 1000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        missing = [p for p in candidate.parents if not p.exists()]   # (runs/ itself, on a first run)
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            _made[candidate] = missing
            return candidate
        except FileExistsError:
            continue
        except OSError:
            return candidate   # (one that cannot be made is refused with the reason, see _check_writable)
    return base


_made: dict[Path, list[Path]] = {}   # a claimed run directory -> the folders above it its claim made


def _unclaim(run_dir: Path | None) -> None:
    """The default run directory of a run refused before it wrote anything: removed, with the
    folders above it that claiming it made (the first run's runs/)."""
    if run_dir is not None:
        for folder in (run_dir, *_made.pop(run_dir, [])):
            try:
                folder.rmdir()   # (only if empty)
            except OSError:
                break


def _check_writable(run_dir: Path) -> None:
    """The run directory can be made and written (checked before tracing; nothing is left behind)."""
    from fragflow.errors import ConfigError

    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".fragflow-write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {run_dir}: cannot write there ({exc.strerror or exc})",
                          fix="give a directory you can write to for the run's outputs") from None
    finally:
        for p in made:   # the folders made for the check, innermost first: the run makes them again
            try:
                p.rmdir()
            except OSError:
                pass


def main() -> None:
    status: Any = 0
    try:
        app()
    except SystemExit as exc:
        status = exc.code
        raise
    finally:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":   # (the process's entry point: its end is near)
            _signals_end_the_process(status)


def _signals_end_the_process(status: Any) -> None:
    """The command has done its work and said so (a run: completed, its summary written): a Ctrl-C or
    SIGTERM from here to the process's end ends it with the command's own exit status, where it killed
    the process by the signal (status -2) or printed a traceback: at once while Python waits for a
    thread of the program's still running, and ignored once its atexit handlers run (torch's
    finalizers: a Ctrl-C 0.05-0.15 s after `done:` killed the process; Python puts the default handlers
    back before its last steps)."""
    import atexit
    import signal

    code = status if isinstance(status, int) else 0 if status is None else 1

    def handler(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)

    def ignored() -> None:   # (registered last: run first of the atexit handlers)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

    atexit.register(ignored)


if __name__ == "__main__":   # python -m fragflow.cli, as python -m fragflow
    main()
