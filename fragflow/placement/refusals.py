"""What a placement over several processes refuses of a program that runs in one: a fragment
defined in the loop's body, a view of versioned state that is not a path of keys, args or a program
that cannot be sent to the workers (and the facts those refusals go by)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from fragflow.compiler.ir import EdgeKind
from fragflow.compiler.loops import defined_in_loop, loop_around
from fragflow.errors import ConfigError, PlacementError
from fragflow.placement.placed import PlacedGraph
from fragflow.source import SourceLoc, definition_of


def refuse_defined_in_loop(placed: PlacedGraph) -> None:
    """A fragment defined in the training loop's body is a new fragment each trip: the trace sees one
    node per trip it ran, and a process apart from the loop is given those alone (the next trip's is
    none of them). Where the loop runs it (an actor beside the environments) it runs as eagerly."""
    graph = placed.graph
    served = {name for g in placed.groups if g.program != "loop" for name in g.nodes}
    sites: dict[SourceLoc, list[str]] = {}
    for n in graph.fragments():
        if n.defined_at is not None and loop_around(n.defined_at, graph.loops) is not None:
            sites.setdefault(n.defined_at, []).append(n.name)
    for at, names in sites.items():
        if len(names) > 1 and any(name in served for name in names):
            n = graph.node(next(name for name in names if name in served))
            loop = loop_around(at, graph.loops)
            assert loop is not None
            raise PlacementError(
                f"{defined_in_loop(n.role or '', names[0], at, loop)} (the trace saw {len(names)}: "
                f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), but policy '{placed.policy}' runs it in "
                "another process, which is given the fragments the trace saw: the next trip's is none of them",
                where=at,
                fix=f"define '{names[0]}' once, before the loop (at the top of the module, or above `{loop.header}`), "
                    "and call it in the loop; or run with --policy single_process")
def left_loop(graph: Any, name: str) -> tuple[Any, str, tuple[tuple[SourceLoc, str, str], ...]] | None:
    """(line, header, where its body leaves it) of the loop a fragment's call is in that replicas could
    leave at different trips: the innermost around it with an early exit or no known bound (``while
    True: ... break``), else the outermost; None outside the loops. Where it is left: each ``break``
    or ``return`` in its body, with the ``if`` around it as written (or "")."""
    loops = graph.loops_of(name)
    open_ended = [loop for loop in loops if loop.exits or loop.trips is None or loop.leaves]
    loop = open_ended[-1] if open_ended else loops[0] if loops else None
    if loop is None:
        return None
    return loop.where, loop.header, tuple((SourceLoc(loop.where.file, at), kind, test) for at, kind, test in loop.leaves)


def left_apart(loop: tuple[Any, ...] | None, values: str = "data of its own environments") -> str:
    """What a message says of loop replicas that left the loop :func:`left_loop` found (None: not
    known) at different trips: the loop's header and line, and each ``break`` or ``return`` in its
    body with the ``if`` around it, on ``values`` each replica computes on its own. It follows "left
    the loop"; every message that says so says it in these words."""
    if loop is None:
        return " at different trips (a break on data of their own environments?)"
    leaves: tuple[Any, ...] = loop[2] if len(loop) > 2 else ()
    exits = " and ".join(f"`{kind}` at {at}" + (f" (under `{test}`)" if test else "") for at, kind, test in leaves)
    return (f" (`{loop[1]}`, at {loop[0]}) at different trips"
            + (f", by its {exits}, on a value each replica computes on its own ({values})" if exits
               else " (a break on data of their own environments?)"))


def left_at(loop: tuple[Any, ...] | None) -> SourceLoc | None:
    """The line such a message is raised at: the loop's one ``break`` or ``return``, else the loop's
    own line (None: not known)."""
    if loop is None:
        return None
    leaves: tuple[Any, ...] = loop[2] if len(loop) > 2 else ()
    return leaves[0][0] if len(leaves) == 1 else loop[0]


def unimportable(module: Any) -> bool:
    """A module a worker started afresh (from the fork server, on Ray) could not import by its name:
    one the CLI loaded from its path, or one a program loaded with importlib from a file that is not
    on ``sys.path``. Its functions travel by value."""
    import importlib.machinery

    name = module.__name__
    if name.startswith("fragflow_user_"):
        return True
    if name == "__main__" or "." in name or getattr(module, "__file__", None) is None:
        return False   # (__main__'s travel by value anyway; a package's submodule is found through its package)
    return importlib.machinery.PathFinder.find_spec(name, sys.path) is None


def refuse_unsendable_views(placed: PlacedGraph) -> None:
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


def unsendable(args: Any, policy: str, train: Callable[..., Any], exc: Exception) -> ConfigError:
    """Why the program cannot be sent to worker processes: which field of its args does not pickle."""
    import cloudpickle

    fields = [f.name for f in dataclasses.fields(args)] if dataclasses.is_dataclass(args) else []
    for name in fields:
        try:
            cloudpickle.dumps(getattr(args, name))
        except Exception as bad:
            return ConfigError(f"policy '{policy}' sends the program's args to its worker processes, but "
                               f"args.{name} cannot be sent ({type(bad).__name__}: {bad})",
                               where=definition_of(train),
                               fix="keep what cannot be pickled (a lock, an open file, a generator) out of the "
                                   "args: make it in the training function from a field that can (a path, a "
                                   "seed), or run with --policy single_process")
    return ConfigError(f"policy '{policy}' sends the program to its worker processes, but it cannot be pickled "
                       f"({type(exc).__name__}: {exc})", where=definition_of(train),
                       fix="keep what cannot be pickled (a lock, an open file, a generator) out of the training "
                           "function's closure and its args, or run with --policy single_process")
