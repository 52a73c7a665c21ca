"""single_process: every fragment in one process, in the loop's own order.

The reference semantics of every other policy (``max_lag = 0`` anywhere must reproduce it) and the
easiest place to debug an algorithm: exceptions surface where the loop called the fragment.

Placement::

    group main x1 (program=loop, device=cpu): env.reset, act, env.step, buffer.add, ..., learn, log
    channels: none
"""

from __future__ import annotations

from dataclasses import dataclass

from fragflow.compiler.ir import Graph
from fragflow.placement import Group, PlacedGraph, PolicySpec


@dataclass(frozen=True)
class Options:
    """single_process takes no options."""


def place(graph: Graph, options: Options) -> PlacedGraph:
    group = Group("main", tuple(n.name for n in graph.fragments()), replicas=1, program="loop")
    return PlacedGraph(graph, "single_process", (), (group,), ())


POLICY = PolicySpec(
    name="single_process",
    mirrors="CleanRL-style single loop; the debugging reference",
    summary="everything in one process, in order: the source of truth every other policy must reproduce",
    options=Options,
    place=place,
    one_process=True,
)
