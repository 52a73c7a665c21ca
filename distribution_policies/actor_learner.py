"""actor_learner: N actor processes (environments + inference) and one learner.

MSRL's single-learner coarse policy, the shape of Acme and IMPALA. Each actor runs the training
loop itself over its slice of the environments; its learner call becomes a put on its trajectory
channel, stamped with the parameter version it acted with, and every read of versioned state reads
the newest version broadcast by the learner. An actor acting for update ``i`` first waits until
version ``i - max_lag`` exists. With ``max_lag=0`` the learner takes one piece from every actor in
actor order, which is exactly the single_process run; above 0 it takes pieces as they arrive, and a
piece older than ``max_lag`` versions when consumed is handled by ``overflow`` (drop and count it,
or deliver it with its version).

Placement::

    group actors  x N (program=loop):    env.reset, act, env.step, buffer.add, buffer.collect
    group learner x 1 (program=service): learn, log
    channel trajectory  actors -> learner   (one ring per actor, slots sized from the traced batch)
    channel parameters  learner -> actors   (versioned broadcast of state['params'])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from fragflow.compiler.ir import Graph
from fragflow.placement import Overflow, PlacedGraph, PolicySpec, acting_and_learning


@dataclass(frozen=True)
class Options:
    actors: int = 2
    """actor processes"""
    envs_per_actor: int = 0
    """environments per actor (0: num_envs / actors); must multiply with actors to num_envs"""
    max_lag: int = 1
    """versions a sample may lag the learner when consumed"""
    overflow: Literal["drop", "deliver", "block"] = "drop"
    """a sample beyond max_lag: drop (and count it), deliver (with its version: ff.delivered()), or
    block (actors wait for the balance controller, so none goes beyond)"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    ordered = options.max_lag == 0
    return acting_and_learning(
        graph, policy="actor_learner", options=tuple(asdict(options).items()), actors=options.actors,
        max_lag=options.max_lag, overflow=Overflow(options.overflow), trajectory="ordered" if ordered else "arrival",
        parameters="exact" if ordered else "balanced" if options.overflow == "block" else "latest")


POLICY = PolicySpec(
    name="actor_learner",
    mirrors="MSRL single-learner coarse; Acme, IMPALA",
    summary="N actor processes (env + inference) feed one learner; parameters come back by versioned broadcast",
    options=Options,
    place=place,
)
