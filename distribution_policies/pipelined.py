"""pipelined: acting for update i+1 overlaps learning on update i (HTS-RL, Cleanba).

Actors act for update ``i`` with exactly parameter version ``max(0, i - max_lag)`` (one version
behind with the default ``max_lag=1``), never a newer one even when it is already published, and the
learner assembles each batch from one piece per actor in actor order. Action noise comes from
per-environment keys and environment ``i`` is seeded ``seed + i`` wherever it runs, so a run is the
same for a given seed however the OS schedules the processes. ``max_lag=0`` is the single_process
run.

Placement::

    group actors  x N (program=loop):    env.reset, act, env.step, buffer.add, buffer.collect
    group learner x 1 (program=service): learn, log
    channel trajectory  actors -> learner   ordered, block (never beyond max_lag)
    channel parameters  learner -> actors   exact versions
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fragflow.compiler.ir import Graph
from fragflow.placement import Overflow, PlacedGraph, PolicySpec, acting_and_learning


@dataclass(frozen=True)
class Options:
    actors: int = 1
    """actor processes"""
    envs_per_actor: int = 0
    """environments per actor (0: num_envs / actors)"""
    max_lag: int = 1
    """how many versions behind the acting policy is (HTS-RL: 1)"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    return acting_and_learning(
        graph, policy="pipelined", options=tuple(asdict(options).items()), actors=options.actors,
        max_lag=options.max_lag, overflow=Overflow.BLOCK, trajectory="ordered", parameters="exact")


POLICY = PolicySpec(
    name="pipelined",
    mirrors="HTS-RL, Cleanba",
    summary="acting on update i+1 overlaps learning on update i, exactly one version behind; deterministic",
    options=Options,
    place=place,
)
