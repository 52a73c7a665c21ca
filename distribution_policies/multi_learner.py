"""multi_learner: K learner processes, each fed by its own actors, all-reducing gradients.

MSRL's multi-learner policy in the shape of DD-PPO. The acting side is ``actor_learner``'s,
``learners * actors`` actor processes in all; learner ``j`` takes the trajectories of actors
``j*actors ... (j+1)*actors - 1`` only, so each learner runs the user's ``learn`` on its share of
the batch. Every gradient is averaged across the learners as soon as backward has produced it
(``torch.distributed``: gloo on CPU, nccl for parameters on a GPU), before the user's code clips
it or steps the optimizer: the K learners make the update one learner would make on the whole
batch (a loss that is a mean over samples), and stay identical, so learner 0 publishes the weights
and reports the metrics (of its share) for all.

The user's update must make the same number of backward passes in every learner per update (no
early stop on a learner's own share, as in DD-PPO: ppo.py decides its target_kl stop on the
learners' mean KL), and leave every learner with the same state (a statistic of its own share is
refused as each update ends); PPO's minibatches are drawn within each learner's share, so the
minibatches differ from one learner's, while each gradient step is still an average over all
learners.

Placement::

    group actors  x K*N (program=loop):     env.reset, act, env.step, buffer.add, buffer.collect
    group learner x K   (program=service):  learn, log        (learner j <- actors j*N .. j*N+N-1)
    channel trajectory  actors -> their learner   in actor order, delivered (never dropped)
    channel parameters  learner 0 -> actors       exact version (max_lag=0) or the newest within max_lag
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from fragflow.compiler.ir import EdgeKind, Graph
from fragflow.errors import ConfigError, PlacementError
from fragflow.placement import Overflow, PlacedGraph, PolicySpec, acting_and_learning


@dataclass(frozen=True)
class Options:
    learners: int = 2
    """learner processes; gradients are averaged across them"""
    actors: int = 1
    """actor processes per learner"""
    max_lag: int = 1
    """versions a sample may lag its learner when consumed (0: sequential semantics)"""


def place(graph: Graph, options: Options) -> PlacedGraph:
    if options.learners < 1 or options.actors < 1:
        raise ConfigError(f"multi_learner needs learners >= 1 and actors >= 1, got learners={options.learners}, "
                          f"actors={options.actors}", fix="pass e.g. multi_learner(learners=2, actors=1)")
    writers = {e.src for e in graph.edges_of(EdgeKind.STATE_WRITE)}
    for n in graph.fragments("learner"):
        if n.name in writers and "torch" not in (n.backend or "").split("+"):
            raise PlacementError(
                f"multi_learner averages the torch gradients of its learners, but learner '{n.name}' computes "
                f"with {n.backend}", where=n.defined_at,
                fix="write the learner with torch (an optimizer in the versioned state, or torch.autograd.grad), "
                    "or use a single-learner policy (actor_learner, pipelined)")
    placed = acting_and_learning(
        graph, policy="multi_learner", options=tuple(asdict(options).items()),
        actors=options.learners * options.actors, max_lag=options.max_lag, overflow=Overflow.DELIVER,
        trajectory="ordered", parameters="exact" if options.max_lag == 0 else "latest")
    groups = tuple(dataclasses.replace(g, replicas=options.learners) if g.program == "service" else g
                   for g in placed.groups)
    return dataclasses.replace(placed, groups=groups)


POLICY = PolicySpec(
    name="multi_learner",
    mirrors="MSRL multi-learner; DD-PPO",
    summary="K learners, each fed by its own actors, average their gradients (torch.distributed all-reduce)",
    options=Options,
    place=place,
)
