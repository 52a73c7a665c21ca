"""learner_replay: actors send transitions; the learner keeps the replay buffer, samples and learns (Ape-X).

Every buffer the learner samples (its output feeds a learner and is not per environment) moves
into the learner process with the learners: the actors' ``add`` calls become transitions on the
trajectory channel, and the learner's derived
program is "on each piece: add; on each learning call: sample, learn, write priorities back". The
actors act with parameters broadcast by the learner: the newest one (``max_lag >= 1``, Ape-X), or
exactly the sequential version (``max_lag=0``, which reproduces single_process bit for bit).
Transitions are off-policy data: they are never dropped, whatever their lag. A rollout buffer
(whose ``collect`` is batched along the environments) stays on the actors that fill it: an
on-policy program runs as under ``actor_learner``, its rollouts delivered, never dropped.

Placement::

    group actors  x N (program=loop):    env.reset, act, env.step
    group learner x 1 (program=service): replay.add, replay.sample, learn, replay.update_priorities,
                                         sync_target, log
    channel trajectory  actors -> learner   transitions and learning calls, deliver (never dropped)
    channel parameters  learner -> actors   state['q'], latest (exact when max_lag=0)
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
    """versions the acting parameters may lag the learner (0: exactly the sequential run)"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    exact = options.max_lag == 0
    return acting_and_learning(
        graph, policy="learner_replay", options=tuple(asdict(options).items()), actors=options.actors,
        max_lag=options.max_lag, overflow=Overflow.DELIVER, trajectory="ordered" if exact else "arrival",
        parameters="exact" if exact else "latest", buffers_with_learner=True)


POLICY = PolicySpec(
    name="learner_replay",
    mirrors="Ape-X; Acme's replay-beside-learner",
    summary="actors send transitions; the learner holds the replay buffer, samples and learns",
    options=Options,
    place=place,
)
