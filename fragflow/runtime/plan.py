"""Wiring, in one place: from a placed graph to what every worker process needs.

The trace tells the runtime how big a trajectory slot is (the learner's input leaves, with the
environment axis divided by the number of actors), which state subtrees the actors read (and so
what the learner broadcasts), and which learner outputs reach ``ff.log``.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle

from fragflow.errors import ConfigError, GraphError
from fragflow.fragment import Fragment
from fragflow.ir import EdgeKind, Node
from fragflow.placement import Overflow, PlacedGraph
from fragflow.pytree import TensorSpec


@dataclass(frozen=True)
class RunPlan:
    policy: str
    actors: int
    max_lag: int
    trajectory: str              # ordered | arrival | balanced
    parameters: str              # exact | latest
    overflow: Overflow
    capacity: int                # trajectory slots per actor
    param_depth: int             # versions the parameter broadcast keeps (0: no broadcast)
    learner: str
    writes: str
    arity: int
    piece_specs: tuple[TensorSpec, ...]
    env_axes: tuple[int | None, ...]
    read_paths: tuple[tuple[Any, ...], ...]
    param_specs: tuple[TensorSpec, ...]
    param_counts: tuple[int, ...]
    log_outputs: tuple[int, ...]
    program: bytes               # cloudpickle of (train, args, learner fragment)


def parse_path(text: str) -> tuple[Any, ...]:
    """``"['params'][0]"`` -> ``('params', 0)``."""
    return tuple(ast.literal_eval(m) for m in re.findall(r"\[(.*?)\]", text))


def build(placed: PlacedGraph, fragments: dict[str, Fragment], train: Any, args: Any) -> RunPlan:
    graph = placed.graph
    options = dict(placed.options)
    actors = int(options.get("actors", 1))
    traj = next(c for c in placed.channels if c.kind == "trajectory")
    param = next((c for c in placed.channels if c.kind == "parameter"), None)
    learner: Node = graph.fragments("learner")[0]
    frag = fragments[learner.name]
    assert frag.writes is not None
    if actors < 1:
        raise ConfigError(f"policy '{placed.policy}' needs actors >= 1, got {actors}", fix="pass actors=1 or more")

    # trajectory pieces: the learner's inputs minus the state it writes, environments split
    inputs = list(learner.inputs)   # versioned arguments are state reads, not inputs
    env_sizes = {leaf.spec.shape[leaf.env_axis] for leaf in inputs if leaf.env_axis is not None}
    if actors > 1 and not env_sizes:
        raise GraphError(f"policy '{placed.policy}' cannot split the learner's input across {actors} actors: "
                         "no input leaf has a known environment axis", where=learner.called_at,
                         fix="pass the batch through ff.RolloutBuffer (or use actors=1)")
    if len(env_sizes) > 1:
        raise GraphError(f"the learner's input leaves disagree on the number of environments: {sorted(env_sizes)}",
                         where=learner.called_at, fix="give every batch leaf the same environment count")
    num_envs = env_sizes.pop() if env_sizes else actors
    per_actor = int(options.get("envs_per_actor", 0) or 0) or num_envs // actors
    if per_actor * actors != num_envs:
        raise ConfigError(f"policy '{placed.policy}' puts {per_actor} environments on each of {actors} actors, "
                          f"but the loop steps {num_envs}",
                          fix=f"choose actors dividing num_envs={num_envs} and envs_per_actor = num_envs / actors "
                              "(or --set num_envs=...)")
    pieces = []
    for leaf in inputs:
        shape = list(leaf.spec.shape)
        if leaf.env_axis is not None:
            shape[leaf.env_axis] //= actors
        pieces.append(replace(leaf.spec, shape=tuple(shape)))

    # parameter broadcast: the state subtrees the acting side reads (a prefix covers its extensions)
    reads = sorted({e.src_port for e in graph.edges_of(EdgeKind.STATE_READ)
                    if placed.group_of(e.dst).name == "actors"}, key=len)
    paths: list[str] = []
    for r in reads:
        if not any(r.startswith(p) for p in paths):
            paths.append(r)
    param_specs: list[TensorSpec] = []
    counts: list[int] = []
    for p in paths:
        edge = next(e for e in graph.edges_of(EdgeKind.STATE_READ) if e.src_port == p)
        param_specs.extend(leaf.spec for leaf in edge.leaves)
        counts.append(len(edge.leaves))

    logged = sorted({int(e.src_port.strip("[]")) for e in graph.edges_of(EdgeKind.DATA)
                     if e.src == learner.name and graph.node(e.dst).role == "logger" and e.src_port})

    module = sys.modules.get(getattr(train, "__module__", ""), None)
    if module is not None and module.__name__.startswith("fragflow_user_"):
        cloudpickle.register_pickle_by_value(module)   # loaded from a file path: workers cannot import it
    program = cloudpickle.dumps((train, args, frag))
    return RunPlan(placed.policy, actors, traj.max_lag, traj.discipline, param.discipline if param else "latest",
                   traj.overflow, traj.capacity, param.capacity if param else 0, learner.name, frag.writes,
                   learner.arity, tuple(pieces),
                   tuple(leaf.env_axis for leaf in inputs), tuple(parse_path(p) for p in paths), tuple(param_specs),
                   tuple(counts), tuple(logged), program)
