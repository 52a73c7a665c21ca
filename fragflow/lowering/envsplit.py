"""How the loop's environments split across its acting processes: each process's rows of a leaf with
an environment axis, and the refusals of a split that does not divide (a count asked per process
that is not the loop's, a leaf sized with the run's count)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fragflow.compiler.ir import Graph, LeafSpec
from fragflow.compiler.pytree import TensorSpec
from fragflow.errors import ConfigError, PlacementError
from fragflow.placement.placed import Group, PlacedGraph


def split_spec(leaf: LeafSpec, replicas: int, fragment: str, graph: Graph, placed: PlacedGraph) -> TensorSpec:
    if str(leaf.spec.dtype) == "object":
        raise PlacementError(
            f"'{leaf.dst_path}' of '{fragment}' is a numpy array of Python objects ({leaf.spec.short()}), and policy "
            f"'{placed.policy}' sends it between processes through shared memory, where only numbers travel",
            where=graph.node(fragment).called_at,
            fix="send numbers instead (a code per object, or an array per field), keep the objects in the loop, "
                "or run with --policy single_process")
    if leaf.axis is None or replicas == 1:
        return leaf.spec
    shape = list(leaf.spec.shape)
    counts = _env_counts(graph)
    if leaf.axis_name == "env" and leaf.axis == 0 and counts and graph.node(fragment).role != "buffer" \
            and (not shape or shape[0] not in counts):
        # (a value given to a rollout buffer's collect() is taken as [env, ...], as a bootstrap value is)
        rows = f"{shape[0]} row{'s' * (shape[0] != 1)}" if shape else "one number"
        raise PlacementError(
            f"'{leaf.dst_path}' of '{fragment}' ({leaf.spec.short()}) is taken as one row per environment, as "
            f"what a rollout buffer's collect() is given is, but it has {rows}, and the loop steps "
            f"{' or '.join(map(str, sorted(counts)))} environments: policy '{placed.policy}' would split it across "
            f"its {_processes(replicas)} as if it were", where=graph.node(fragment).called_at,
            fix=f"pass it to '{fragment}' as an argument of its own (a value that is not per environment goes "
                "whole), or give it one row per environment")
    if leaf.axis >= len(shape):   # (a Python number per step in a rollout: [T], no environment axis)
        raise PlacementError(
            f"'{leaf.dst_path}' of '{fragment}' ({leaf.spec.short()}) has no {leaf.axis_name} axis (axis "
            f"{leaf.axis}) to split across the {replicas} processes of policy '{placed.policy}': one number per "
            "step, not one per environment", where=graph.node(fragment).called_at,
            fix="give it one value per environment (np.full(env.num_envs, x) where the loop adds it, an array "
                "from the actor), keep it in the loop, or run with one acting process")
    total = shape[leaf.axis]
    if total % replicas or (leaf.axis_name == "env" and _asked_per(placed) and _asked_per(placed) * replicas != total):
        envs = _loop_envs(graph)
        if leaf.axis_name == "env" and envs is not None and envs != total and graph.node(fragment).role == "buffer":
            # (rows of the loop's own making: transitions added one at a time, an episode relabeled)
            raise ConfigError(
                f"buffer fragment '{fragment}' is given {leaf.dst_path} with {total} row{'s' * (total != 1)} "
                f"({leaf.spec.short()}), not one per environment (the loop steps {envs}), but policy "
                f"'{placed.policy}' sends it each of its {_processes(replicas)}' rows of the environments, "
                f"{envs // replicas if envs % replicas == 0 else envs / replicas} each",
                where=graph.node(fragment).called_at,
                fix="add one row per environment each call, or keep the buffer with the actors (actor_learner: each "
                    "process's buffer holds its own environments' transitions), or run with one acting process "
                    "(actors=1)")
        if leaf.axis_name == "env":
            _refuse_env_split(placed, total, replicas, graph.node(fragment).called_at)
        raise ConfigError(f"policy '{placed.policy}' splits '{leaf.dst_path}' of '{fragment}' ({total} along its "
                          f"{leaf.axis_name} axis) across {replicas} replicas, which does not divide it",
                          where=graph.node(fragment).called_at,
                          fix=f"use a size divisible by {replicas}, or another number of actors")
    shape[leaf.axis] = total // replicas
    return replace(leaf.spec, shape=tuple(shape))


def _loop_envs(graph: Graph) -> int | None:
    """The number of training environments the loop steps (its first such env's), if known."""
    for node in graph.fragments("env"):
        if node.evaluation:
            continue
        specs = dict(node.outputs)
        for path, axis_name, axis in node.output_axes:
            spec = specs.get(path)
            if axis_name == "env" and spec is not None and len(spec.shape) > axis:
                return spec.shape[axis]
    return None


def _env_counts(graph: Graph) -> set[int]:
    """The numbers of training environments the loop's envs step (empty: none known)."""
    counts = set()
    for node in graph.fragments("env"):
        specs = dict(node.outputs)
        for path, axis_name, axis in () if node.evaluation else node.output_axes:
            spec = specs.get(path)
            if axis_name == "env" and spec is not None and len(spec.shape) > axis:
                counts.add(spec.shape[axis])
    return counts


def _asked_per(placed: PlacedGraph) -> int:
    options = dict(placed.options)
    return int(options.get("envs_per_actor", 0) or options.get("envs_per_worker", 0) or 0)


def _refuse_env_split(placed: PlacedGraph, total: int, replicas: int, where: Any, several: bool = False) -> None:
    """The policy's processes cannot each step an equal share of the loop's ``total`` environments."""
    options = dict(placed.options)
    unit, per_unit = ("env_workers", "envs_per_worker") if "env_workers" in options else ("actors", "envs_per_actor")
    given = (f"learners={options['learners']} x actors={options.get('actors', 1)}" if "learners" in options
             else f"{unit}={replicas}")
    asked = _asked_per(placed)
    each = f", {per_unit}={asked}" if asked else ""
    count = "learners x actors" if "learners" in options else unit
    if asked and total % replicas == 0:   # the processes divide them: the share asked for is what is wrong
        raise ConfigError(f"policy '{placed.policy}' asks for {per_unit}={asked} in each of its {_processes(replicas)} "
                          f"({given}): {asked * replicas} environments, but the loop steps {total}", where=where,
                          fix=f"set {per_unit}={total // replicas}" + (
                              f", or {unit}={total // asked} to keep {per_unit}={asked}"
                              if total % asked == 0 and "learners" not in options else "") +
                              f", or leave {per_unit} out (each process then steps num_envs / {unit})")
    raise ConfigError(f"policy '{placed.policy}' splits the loop's {total} environments across {_processes(replicas)} "
                      f"({given}{each}): they do not divide evenly", where=where,
                      fix=f"choose {count} dividing num_envs={total} (and {per_unit} = num_envs / {count}), or "
                          f"make num_envs (given to ff.envs.make) a multiple of {count} (`--set num_envs=...` "
                          "where your Args has that field)" + (
                              "; if this env evaluates, apart from the training envs, make it with "
                              "ff.envs.make(..., evaluation=True): every acting process then steps it whole, its "
                              "episodes reported apart" if several else ""))


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def check_env_split(placed: PlacedGraph, loop: Group) -> None:
    """Every training env the loop steps is split evenly across its replicas (checked here, before
    any process starts, rather than where an env is made in each)."""
    if loop.replicas == 1 and not _asked_per(placed):   # (one process asked for 3 of 4 envs is refused too)
        return
    graph = placed.graph
    if loop.replicas > 1 and graph.own_env is not None:
        options = dict(placed.options)
        unit = "env_workers" if "env_workers" in options else "actors"
        raise ConfigError(
            f"policy '{placed.policy}' runs the loop in {loop.replicas} processes, each stepping its share of the "
            "environments, but the program makes its environment itself (gymnasium.make or make_vec, not "
            "ff.envs.make): fragflow cannot split it, nor count its steps and episodes",
            where=graph.own_env,
            fix=f"make the environments with ff.envs.make(id_or_class_or_factory, num_envs=..., seed=...), or run "
                f"with {unit}=1")
    for name in loop.nodes:
        node = graph.node(name)
        if node.role != "env" or node.evaluation or not node.splittable:
            continue
        specs = dict(node.outputs)
        for path, axis_name, axis in node.output_axes:
            spec = specs.get(path)
            if axis_name == "env" and spec is not None and len(spec.shape) > axis:
                total = spec.shape[axis]
                per = _asked_per(placed)
                if total % loop.replicas or (per and per * loop.replicas != total):
                    envs = {n.instance for n in graph.fragments("env") if not n.evaluation}
                    _refuse_env_split(placed, total, loop.replicas, node.called_at, several=len(envs) > 1)
                break
