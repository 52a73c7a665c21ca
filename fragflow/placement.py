"""The placed graph: what a distribution policy produces from an FDG.

A policy assigns every fragment to a *group* (one loop running in one process, possibly
replicated) and turns every edge cut between groups into a *channel*:

=============  =====================================================================================
trajectory     a data edge between groups: a bounded queue; items carry the parameter version they
               were produced with, and ``max_lag`` bounds how stale an item may be when consumed
parameter      a state read from another group: a latest-value, versioned broadcast
=============  =====================================================================================

``overflow`` is what a trajectory channel does with an item beyond its staleness bound: ``drop``
it (and count it), ``block`` its producer, or ``deliver`` it with its version so the algorithm can
correct for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from fragflow.errors import GraphError
from fragflow.ir import EdgeKind, Graph, NodeKind


class Overflow(Enum):
    DROP = "drop"
    BLOCK = "block"
    DELIVER = "deliver"


@dataclass(frozen=True, slots=True)
class Group:
    """Fragments that run together in one process. ``program`` is ``loop`` (the user's training
    loop drives them) or ``service`` (a loop over the group's input channels)."""

    name: str
    nodes: tuple[str, ...]
    replicas: int = 1
    program: str = "loop"
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class Channel:
    name: str
    kind: str                      # "trajectory" | "parameter"
    src_group: str
    dst_group: str
    edges: tuple[str, ...]         # "src -> dst.port" of the FDG edges it carries
    max_lag: int = 0
    overflow: Overflow = Overflow.BLOCK
    capacity: int = 1
    discipline: str = ""           # how the consumer reads it (see acting_and_learning)


@dataclass(frozen=True, slots=True)
class PlacedGraph:
    graph: Graph
    policy: str
    options: tuple[tuple[str, Any], ...]
    groups: tuple[Group, ...]
    channels: tuple[Channel, ...]

    def group_of(self, node: str) -> Group:
        for g in self.groups:
            if node in g.nodes:
                return g
        raise KeyError(node)

    def problems(self) -> list[str]:
        out = self.graph.problems()
        seen: dict[str, str] = {}
        for g in self.groups:
            if g.replicas < 1:
                out.append(f"group '{g.name}' has {g.replicas} replicas")
            for n in g.nodes:
                if n in seen:
                    out.append(f"fragment '{n}' is placed in both '{seen[n]}' and '{g.name}'")
                seen[n] = g.name
        instances: dict[str, str] = {}
        for frag in self.graph.fragments():
            if frag.name not in seen:
                out.append(f"fragment '{frag.name}' is not placed in any group")
            elif frag.instance:
                other = instances.setdefault(frag.instance, seen[frag.name])
                if other != seen[frag.name]:
                    out.append(f"fragments of '{frag.instance}' are split across groups '{other}' and '{seen[frag.name]}'")
        carried = {e for c in self.channels for e in c.edges}
        for e in self.graph.edges:
            src = self.graph.node(e.src)
            if src.kind is NodeKind.LOOP:
                continue
            if e.kind is EdgeKind.DATA and e.src != e.dst and seen.get(e.src) != seen.get(e.dst):
                label = edge_label(e.src, e.dst, e.dst_port)
                if label not in carried:
                    out.append(f"edge {label} crosses groups but no channel carries it")
        for c in self.channels:
            if c.max_lag < 0:
                out.append(f"channel '{c.name}' has negative max_lag {c.max_lag}")
            if c.capacity < 1:
                out.append(f"channel '{c.name}' has capacity {c.capacity}")
        return out

    def verify(self) -> PlacedGraph:
        problems = self.problems()
        if problems:
            from fragflow.printer import format_placed

            raise GraphError(
                f"policy '{self.policy}' produced an inconsistent placement ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems),
                where=self.graph.defined_at, fix="this is a bug in the distribution policy; please report it",
                detail=format_placed(self))
        return self


def edge_label(src: str, dst: str, dst_port: str) -> str:
    return f"{src} -> {dst}.{dst_port}"


def acting_and_learning(graph: Graph, *, policy: str, options: tuple[tuple[str, Any], ...], actors: int,
                        max_lag: int, overflow: Overflow, trajectory: str, parameters: str) -> PlacedGraph:
    """The placement shared by the single-learner policies: the acting side (envs, actors,
    buffers and the loop itself) replicated ``actors`` times; the learner, and the sinks it feeds,
    in one service process; a trajectory channel for every data edge into the learner and a
    parameter channel for every state read on the acting side.

    ``trajectory`` is the consumer's discipline: ``ordered`` (one piece per actor per update, in
    actor order), ``arrival`` (first come, first served) or ``balanced`` (arrival, with producers
    admitted only while their samples will be fresh enough). ``parameters`` is ``exact`` (an
    actor acting for update ``i`` reads version ``max(0, i - max_lag)``) or ``latest`` (it waits for
    ``i - max_lag`` and reads the newest).

    The trajectory channel holds ``max_lag + 2`` items per actor: the ``max_lag`` versions an actor
    may run ahead, the one being produced and the one being consumed. The parameter broadcast keeps
    one version more, so the oldest version an actor may still ask for is never the slot the
    learner is writing.
    """
    capacity = max_lag + 2
    learners = graph.fragments("learner")
    writers = {e.src for e in graph.edges_of(EdgeKind.STATE_WRITE)}
    if len(learners) != 1 or learners[0].name not in writers:
        found = ", ".join(n.name for n in learners) or "none"
        raise GraphError(f"policy '{policy}' needs exactly one learner fragment that writes versioned state; found: {found}",
                         where=graph.defined_at,
                         fix="mark the update function @ff.fragment('learner') and give it the state from ff.versioned(...)")
    learner = learners[0].name
    fed_by_learner = {e.dst for e in graph.edges_of(EdgeKind.DATA) if e.src == learner}
    sinks = tuple(n.name for n in graph.fragments("logger") if n.name in fed_by_learner)
    service = (learner, *sinks)
    acting = tuple(n.name for n in graph.fragments() if n.name not in service)
    traj_edges = tuple(edge_label(e.src, e.dst, e.dst_port) for e in graph.edges_of(EdgeKind.DATA)
                       if e.dst == learner and e.src != learner)
    read_edges = tuple(f"{e.src}{e.src_port} -> {e.dst}.{e.dst_port}" for e in graph.edges_of(EdgeKind.STATE_READ)
                       if e.dst in acting)
    channels = [Channel("trajectory", "trajectory", "actors", "learner", traj_edges, max_lag, overflow, capacity,
                        trajectory)]
    if read_edges:
        channels.append(Channel("parameters", "parameter", "learner", "actors", read_edges, max_lag, Overflow.DELIVER,
                                max_lag + 3, parameters))
    groups = (Group("actors", acting, replicas=actors, program="loop"), Group("learner", service, program="service"))
    return PlacedGraph(graph, policy, options, groups, tuple(channels))
