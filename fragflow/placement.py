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
            if e.kind is EdgeKind.DATA and seen.get(e.src) != seen.get(e.dst):
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
