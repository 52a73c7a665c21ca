"""async_relaxed: relaxed assignment with staleness bounded by balance (TianJi).

No actor waits for a particular learner message and the learner never waits for a particular
actor: the learner takes pieces from whichever actors have them, first come first served. Every
piece carries the version it was produced with; one older than ``max_lag`` versions when consumed
is dropped and counted. To keep drops rare and the learner busy, producers are admitted by a
balance controller: an actor starts a rollout only while the learner's backlog (pieces queued or
being produced, and whether the learner is mid-update) says its piece will be consumed within
``max_lag`` versions; otherwise it waits for the learner to catch up.

Placement::

    group actors  x N (program=loop):    env.reset, act, env.step, buffer.add, buffer.collect
    group learner x 1 (program=service): learn, log
    channel trajectory  actors -> learner   balanced arrival, drop beyond max_lag
    channel parameters  learner -> actors   latest version
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fragflow.compiler.ir import Graph
from fragflow.placement import Overflow, PlacedGraph, PolicySpec, acting_and_learning


@dataclass(frozen=True)
class Options:
    actors: int = 2
    """actor processes"""
    envs_per_actor: int = 0
    """environments per actor (0: num_envs / actors)"""
    max_lag: int = 2
    """versions a sample may lag the learner when consumed; older ones are dropped and counted"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    return acting_and_learning(
        graph, policy="async_relaxed", options=tuple(asdict(options).items()), actors=options.actors,
        max_lag=options.max_lag, overflow=Overflow.DROP, trajectory="ordered" if options.max_lag == 0 else "arrival",
        parameters="exact" if options.max_lag == 0 else "balanced")


POLICY = PolicySpec(
    name="async_relaxed",
    mirrors="TianJi",
    summary="any actor to the learner, event-driven; staleness bounded by balancing production against consumption",
    options=Options,
    place=place,
)
