"""Lowering: from a placed graph to the program every process group runs.

A **loop group** runs the user's training loop. Lowering gives it a dispatch table: each fragment is
served *here* (called in this process) or is a :class:`Remote` call into a service group, whose
loop-side arguments go onto that fragment's :class:`Ring` and whose outputs come back to the loop
as ``Pending`` references (they can be passed on to other fragments of that group, not read).
Reads of versioned state the service group writes come from a :class:`Broadcast`.

A **service group** runs a program derived from the graph: it takes the calls the loop makes into
it, in the loop's order, from every producer replica; a call is executed once one piece from each
replica is there (merged along the named batch axes of its leaves); references to its own earlier
outputs resolve from a value table; after a call that writes versioned state it publishes the
views the loop reads, and it logs the outputs the graph sends to ``ff.log``. The learner is
"gather, learn, publish"; a learner-side replay is "add each piece; then sample and learn".

A channel of the placement carries exactly the edges that cross it: one ring per remote fragment
per producer replica, sized from the traced specs of the leaves that cross.

>>> from fragflow.algorithms import ppo                                          # doctest: +SKIP
>>> lowered = lower(placed)                                                      # doctest: +SKIP
>>> lowered.loop.remote["learn"].group                                           # doctest: +SKIP
'learner'
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fragflow.compiler.ir import EdgeKind, Graph, LeafSpec
from fragflow.compiler.pytree import TensorSpec
from fragflow.compiler.tracer import LOOP
from fragflow.errors import PlacementError
from fragflow.lowering import disciplines
from fragflow.lowering.envsplit import check_env_split, split_spec
from fragflow.placement.placed import Channel, Group, PlacedGraph, one_acting_process


def parse_path(text: str) -> tuple[Any, ...]:
    """``"['params'][0]"`` -> ``('params', 0)``."""
    return tuple(ast.literal_eval(m) for m in re.findall(r"\[(.*?)\]", text))


@dataclass(frozen=True)
class Ring:
    """The calls of one remote fragment from one producer replica: the loop-side leaves of each call."""

    name: str
    fragment: str
    replica: int
    specs: tuple[TensorSpec, ...]     # per replica (batch axes divided by the number of replicas)
    axes: tuple[int | None, ...]      # merge axis of each leaf; None: the same in every replica
    capacity: int
    counts: tuple[int, ...] = ()      # leaves that are a replica's number of environments: summed where merged
    paths: tuple[str, ...] = ()       # each leaf's place in the call's arguments (batch['obs']), for messages


WHOLE_MARK = "#whole "   # a ring path's prefix: the fingerprint of a leaf a replica sends its rows of (Remote.whole)


@dataclass(frozen=True)
class Broadcast:
    """The views of one versioned state that a loop group reads, published by its writer's group."""

    state: str
    paths: tuple[tuple[Any, ...], ...]
    specs: tuple[TensorSpec, ...]
    counts: tuple[int, ...]           # leaves per path
    depth: int


_ITEM = re.compile(r"^(.*)\[(\d+)\]$")


def _refuse_rows_in_a_list(node: Any, outs: list[LeafSpec], policy: str, replicas: int) -> None:
    """A served call answers each loop process with its rows of the output's batched arrays and the
    rest whole: a list (or tuple) of Python numbers, one per environment of the batch (``[int(a) for a
    in actions]``), has no axis to split, so every process would get every environment's and step
    its own with them (refused at the env's step, as an action array sized for the whole run)."""
    rows = {leaf.spec.shape[leaf.axis] for leaf in node.inputs
            if leaf.axis_name == "env" and leaf.axis is not None and leaf.axis < len(leaf.spec.shape)}
    items: dict[str, list[int]] = {}
    for leaf in outs:
        m = _ITEM.match(leaf.src_path)
        if m is not None and leaf.spec.backend == "python" and leaf.axis is None:
            items.setdefault(m.group(1), []).append(int(m.group(2)))
    for parent, index in items.items():
        if len(rows) == 1 and sorted(index) == list(range(len(index))) and len(index) in rows and len(index) > 1:
            raise PlacementError(
                f"actor '{node.name}' returns{f' at {parent}' if parent else ''} a list of {len(index)} Python "
                f"numbers, one per environment it acts for, but policy '{policy}' acts for the environments of its "
                f"{replicas} loop processes in one call and answers each with its rows: a list has no rows to "
                "split, so each process would get every environment's", where=node.called_at,
                fix="return an array (np.array([...]) or a tensor) with the environments on its first axis, or run "
                    "with one env worker, or with another policy")


@dataclass(frozen=True)
class Remote:
    """How a loop group serves a fragment placed in a service group."""

    fragment: str
    group: str
    writes: str | None
    arity: int
    primary: bool                     # its calls are the service's updates (the version clock)
    sync: bool = False                # the loop uses its outputs: it waits for the reply
    outputs: tuple[tuple[Any, ...], ...] = ()   # keys of each output leaf (sync calls), to rebuild them
    # the output without its leaves as traced (None, {} kept), where known: a sync call's answer is
    # rebuilt in it, and the loop unpacks another's tuple output by it (see Pending)
    skeleton: Any = None
    # (leaf, axis, rows per replica) of the leaves the loop made, batched by their size beside the
    # environments: a replica holding the whole (a constant of that size, the same in every
    # replica: a mask over as many actions) sends its rows
    whole: tuple[tuple[int, int, int], ...] = ()
    # argument leaves the loop passes at some calls, an output of the service's at others: sent with
    # the call (``("given", ...)``) where the loop passes them
    given: frozenset[str] = frozenset()
    # a learner whose calls from several loop processes are gathered as they arrive (max_lag >= 1):
    # a call with no env step since the previous one (the trace saw none) is refused where it is made
    gathered: str = ""   # how the policy gathers them, for the message (see called_again)


@dataclass(frozen=True)
class Logged:
    """A part of a fragment's output its service reports after each call: the scalars of the
    subtree at ``index``/``keys``; ``names``: the (path in it, name) pairs the trace saw it logged
    by (empty for a part reported only because it holds scalars; the loop says, at each call it
    logs, which part it logged and by what name)."""

    index: int
    keys: tuple[Any, ...]
    names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LoopProgram:
    group: str
    replicas: int
    threads: int
    local: frozenset[str]
    remote: dict[str, Remote]
    reads: dict[str, Broadcast]
    ship: dict[str, tuple[str, ...]]  # state -> the service groups that hold a copy
    choice: Any                       # a version choice (see disciplines), None without broadcast
    max_lag: int
    restartable: str | None = None    # None: a replica whose process dies is started again; else why not
    routes: dict[str, tuple[str, ...]] | None = None   # a replicated service group: its instance per loop replica
    logged: tuple[tuple[str, int, int, tuple[Any, ...]], ...] = ()   # (fragment, part, index, keys) services report
    # a fragment run here: (argument path, env axis, rows per replica) of the per-environment leaves
    # the loop may make with every environment's rows (sized with the run's count, not
    # ``env.num_envs``): named in the note of a failure of the fragment (LoopInterpreter._run_sized)
    rows: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    one_process: str = "one acting process"   # how a fix names this policy with one acting process

    def service_for(self, group: str, replica: int) -> str:
        """The service instance loop replica ``replica`` sends ``group``'s calls to."""
        if self.routes is None or group not in self.routes:
            return group
        return self.routes[group][replica]


@dataclass(frozen=True)
class ServiceProgram:
    group: str
    threads: int
    producers: int
    fragments: tuple[str, ...]
    rings: tuple[Ring, ...]
    publish: tuple[Broadcast, ...]
    logs: dict[str, tuple[Logged, ...]]
    clock: str
    ordered: bool
    overflow: Any
    max_lag: int
    states: tuple[str, ...]
    replies: tuple[Ring, ...] = ()    # per sync fragment per replica: its outputs, split back
    batch_wait: float = 0.0           # seconds a request waits for the other replicas' (arrival gathering)
    first: int = 0                    # the loop replica its first producer is (several learners: its actors')
    rank: int = 0                     # several learners: this one's place among them (0 publishes and reports)
    world: int = 1                    # the learners that all-reduce their gradients
    writes: tuple[str, ...] = ()      # the states its fragments write (what its checkpoint part holds)
    # ... and the states it holds that no fragment writes, which its part holds too (a target network
    # its learner changes in place, which no other process holds: the loop's copy is the one it began with)
    saves: tuple[str, ...] = ()
    # its fragments whose outputs the loop passes to another of its fragments: their last outputs are
    # kept (a learner's output the loop keeps past its next calls: PPG's value targets)
    keeps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lowered:
    placed: PlacedGraph
    loop: LoopProgram
    services: tuple[ServiceProgram, ...]

    @property
    def rings(self) -> tuple[Ring, ...]:
        return tuple(r for s in self.services for r in s.rings)

    @property
    def replies(self) -> tuple[Ring, ...]:
        return tuple(r for s in self.services for r in s.replies)

    @property
    def broadcasts(self) -> tuple[Broadcast, ...]:
        return tuple(b for s in self.services for b in s.publish)


def _channel(placed: PlacedGraph, kind: str, src: str, dst: str) -> Channel | None:
    return next((c for c in placed.channels if c.kind == kind and c.src_group == src and c.dst_group == dst), None)


# Learner state (in floats, optimizer moments included) above which a process's torch kernels are
# big enough to share cores: below it (DQN on CartPole: 11k parameters, 33k floats with Adam's
# moments; PPO fewer) one thread is fastest, as small kernels on a busy machine crawl with more;
# SAC (202k parameters) ran 1.4x faster on two threads than on one here.
BIG_LEARNER = 50_000


def _threads(graph: Graph, group: Group, processes: int) -> int:
    """A group's torch threads: the placement's, or (0) the cores shared among the processes when the
    group runs a learner whose state is big, else one."""
    if group.threads:
        return group.threads
    learners = {n for n in group.nodes if graph.node(n).role == "learner"}
    # each state once, however many of the group's learners write it (SAC's two): leaf by leaf
    sizes: dict[tuple[str, str], int] = {}
    for e in graph.edges_of(EdgeKind.STATE_WRITE):
        if e.src in learners:
            for leaf in e.leaves:
                key = (e.dst, leaf.dst_path)
                sizes[key] = max(sizes.get(key, 0), leaf.spec.nbytes // 4)
    floats = sum(sizes.values())
    if floats < BIG_LEARNER:
        return 1
    return max(1, (os.cpu_count() or 1) // processes)


def _not_restartable(remote: dict[str, Remote], choice: Any, declared: bool = True) -> str | None:
    """Why a loop replica whose process dies cannot be started again under this placement (None: it can)."""
    if not declared:
        return "the placement declares its actors not restartable"
    if not remote:
        return "the loop runs in the driver's own process"
    if isinstance(choice, disciplines.Exact):
        return ("its replicas act with exact versions in lockstep with the learner (max_lag=0 or pipelined), "
                "which a restarted process cannot rejoin deterministically")
    if any(r.sync for r in remote.values()):
        return "its replicas wait for answers from another group (served inference), which a restart would lose"
    return None


def _clock(graph: Graph, group: Group) -> str:
    """The service's version clock: its state-writing fragment with the highest rate (first in trace order)."""
    clock = graph.clock(group.nodes)
    if clock is None:
        raise PlacementError(f"group '{group.name}' runs as a service but none of its fragments writes versioned state",
                             where=graph.defined_at,
                             fix="a service group publishes versions: give its learner the state it updates")
    return clock


def _local_rows(graph: Graph, in_loop: set[str], replicas: int) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Per fragment run in the loop's processes, the per-environment leaves the loop makes
    itself (see ``LoopProgram.rows``); none where one process steps them all."""
    if replicas < 2:
        return {}
    out: dict[str, tuple[tuple[str, int, int], ...]] = {}
    for name in sorted(in_loop & {n.name for n in graph.fragments()}):
        made = {leaf.dst_path for e in graph.edges_of(EdgeKind.DATA) if e.dst == name and e.src == LOOP
                for leaf in e.leaves}
        found = tuple((leaf.dst_path, leaf.axis, leaf.spec.shape[leaf.axis] // replicas)
                      for leaf in graph.node(name).inputs
                      if leaf.axis_name == "env" and leaf.axis is not None and leaf.dst_path in made
                      and len(leaf.spec.shape) > leaf.axis)
        if found:
            out[name] = found
    return out


def _reads(graph: Graph, state: str, readers: set[str], depth: int) -> Broadcast | None:
    """The views of ``state`` that ``readers`` read (a prefix covers its extensions)."""
    edges = [e for e in graph.edges_of(EdgeKind.STATE_READ) if e.src == state and e.dst in readers]
    if not edges:
        return None
    paths: list[str] = []
    for r in sorted({e.src_port for e in edges}, key=len):
        if not any(r.startswith(p) for p in paths):
            paths.append(r)
    specs: list[TensorSpec] = []
    counts: list[int] = []
    for p in paths:
        edge = next(e for e in edges if e.src_port == p)
        specs.extend(leaf.spec for leaf in edge.leaves)
        counts.append(len(edge.leaves))
    return Broadcast(state, tuple(parse_path(p) for p in paths), tuple(specs), tuple(counts), depth)


def _logged(graph: Graph, fragment: str, group: set[str]) -> tuple[Logged, ...]:
    """The parts of ``fragment``'s outputs its service reports after each call, for the loop to log
    what it logs of them: each part the loop sent to ``ff.log`` while tracing, as the widest subtree
    logged whole (``ff.log(metrics)``: every key the learner returns, keys first returned later
    included), with the names it was logged by; and of a learner every output that holds scalars only, or
    nothing (a metrics dict empty while tracing), which the loop may log from some call on."""
    node = graph.node(fragment)
    produced = [parse_path(path) for path, _ in node.outputs]
    parts: dict[tuple[int, tuple[Any, ...]], list[tuple[str, str]]] = {}
    for e in graph.edges_of(EdgeKind.DATA):
        if not (e.src == fragment and e.dst in group and graph.node(e.dst).role == "logger"):
            continue
        pairs: dict[tuple[tuple[Any, ...], tuple[Any, ...]], None] = {}   # (source, name) of each leaf, in order
        for leaf in e.leaves:
            param = leaf.dst_path.split("[", 1)[0]
            pairs[(parse_path(leaf.src_path), parse_path(leaf.dst_path[len(param):]))] = None
        done: set[tuple[tuple[Any, ...], tuple[Any, ...]]] = set()
        for src, dst in pairs:
            if (src, dst) in done:
                continue
            common = 0
            while common < min(len(src), len(dst)) and src[len(src) - 1 - common] == dst[len(dst) - 1 - common]:
                common += 1
            for n in range(common, -1, -1):   # the widest subtree whose every leaf went to ff.log, by the same path
                root, name = src[:len(src) - n], dst[:len(dst) - n]
                if e.src_port and not root:
                    continue   # a tuple output: its parts are logged, not the tuple
                members = {(p, name + p[len(root):]) for p in produced if p[:len(root)] == root} | {(src, dst)}
                if members <= pairs.keys():
                    break
            done |= members
            index, keys = (int(root[0]), tuple(root[1:])) if e.src_port else (-1, tuple(root))
            names = parts.setdefault((index, keys), [])
            if ("", _name(name)) not in names:
                names.append(("", _name(name)))
    if node.role == "learner":
        first = 1 if any(e.src == fragment for e in graph.edges_of(EdgeKind.STATE_WRITE)) else 0
        scalar = {parse_path(path): int(np.prod(spec.shape)) == 1 for path, spec in node.outputs}
        for index in (range(first, node.arity) if node.arity else [-1]):
            under = [ok for p, ok in scalar.items() if index < 0 or p[:1] == (index,)]
            if all(under):
                parts.setdefault((index, ()), [])
    return tuple(Logged(index, keys, tuple(names)) for (index, keys), names in parts.items())


def called_again(learner: str, how: str, gathered: str, where: Any) -> PlacementError:
    """A learner called again with no env step since its previous call, where ``gathered`` (the
    policy takes the loop processes' calls as they arrive) would merge a process's two calls."""
    return PlacementError(
        f"learner '{learner}' is called again with no environment step since its previous call ({how}), but "
        f"{gathered}: a process's second call could be merged with its first into one update, and the run would "
        "make fewer updates, each on one process's data twice, than the program does", where=where,
        fix="take those steps inside the learner (loop over the epochs or samples in the learner fragment and call "
            "it once per trip), or run with max_lag=0 (one call of each process per update, in order), with one "
            "acting process (actors=1 or env_workers=1), or with --policy pipelined")


def _name(keys: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in keys)


def lower(placed: PlacedGraph) -> Lowered:
    """One program per group: the loop group's dispatch table, each service's derived program."""
    graph = placed.graph
    loops = [g for g in placed.groups if g.program == "loop"]
    if len(loops) != 1:
        raise PlacementError(f"policy '{placed.policy}' produced {len(loops)} loop groups; one group runs the loop",
                             where=graph.defined_at, fix="fix the policy's place(): exactly one group has program='loop'")
    loop = loops[0]
    check_env_split(placed, loop)
    in_loop = set(loop.nodes)
    processes = sum(g.replicas for g in placed.groups)
    services: list[ServiceProgram] = []
    bases: list[str] = []   # each service's group before replication (several learners: one group)
    remote: dict[str, Remote] = {}
    reads: dict[str, Broadcast] = {}
    ship: dict[str, list[str]] = {}
    choice = None
    max_lag = 0
    routes: dict[str, tuple[str, ...]] = {}
    for group in placed.groups:
        if group.program != "service":
            continue
        if group.replicas > 1 and loop.replicas % group.replicas:
            raise PlacementError(f"policy '{placed.policy}' gives {group.replicas} '{group.name}' processes "
                                 f"{loop.replicas} actors to share", where=graph.defined_at,
                                 fix=f"use a number of actors divisible by {group.replicas}")
        instances = [f"{group.name}.{j}" for j in range(group.replicas)] if group.replicas > 1 else [group.name]
        per = loop.replicas // len(instances)
        if group.replicas > 1:
            routes[group.name] = tuple(instances[k // per] for k in range(loop.replicas))
        members = set(group.nodes)
        traj = _channel(placed, "trajectory", loop.name, group.name)
        param = _channel(placed, "parameter", group.name, loop.name)
        lag = traj.max_lag if traj is not None else 0
        max_lag = max(max_lag, lag)
        clock = _clock(graph, group)
        clock_rate = max(graph.rate_of(clock), 1e-9)
        rings: list[Ring] = []
        replies: list[Ring] = []
        logs: dict[str, tuple[Logged, ...]] = {}
        for name in group.nodes:
            node = graph.node(name)
            logged = _logged(graph, name, members)
            if logged:
                logs[name] = logged
            if node.role == "logger":
                continue   # sinks run after the call that feeds them (see ``logs``)
            writes = next((e.dst for e in graph.edges_of(EdgeKind.STATE_WRITE) if e.src == name), None)
            # the loop waits for its answer where a fragment with it uses an output, or where a served
            # actor's outputs reach no fragment: the loop's own code uses them (a bootstrap value in the
            # loop's arithmetic; a learner output the loop reads is refused at placement)
            consumers = {e.dst for e in graph.edges_of(EdgeKind.DATA) if e.src == name}
            sync = bool(consumers & in_loop) or (node.role == "actor" and bool(node.outputs) and not consumers)
            keys = tuple(parse_path(path) for path, _ in node.outputs) if sync else ()
            remote[name] = Remote(name, group.name, writes, node.arity, name == clock, sync, keys, node.out_skeleton)
            if sync:
                out_axis = {leaf.src_path: leaf for e in graph.edges_of(EdgeKind.DATA) if e.src == name
                            for leaf in e.leaves}
                # an output only the loop's own code reads has no edge: its batch axis is the node's
                batched = {path: (axis, name) for path, name, axis in node.output_axes}
                # the output as the fragment returns it (an edge's spec is as its consumer took it: through
                # .numpy(), a torch action reaches a buffer as numpy), batched as its edges say
                outs = [dataclasses.replace(out_axis[path], spec=spec) if path in out_axis
                        else LeafSpec(path, path, spec, *batched.get(path, (None, None))) for path, spec in node.outputs]
                if loop.replicas > 1:
                    _refuse_rows_in_a_list(node, outs, placed.policy, loop.replicas)
                out_specs = tuple(split_spec(leaf, loop.replicas, name, graph, placed) for leaf in outs)
                out_axes = tuple(leaf.axis if loop.replicas > 1 else None for leaf in outs)
                for k in range(loop.replicas):
                    replies.append(Ring(f"{name}.reply[{k}]", name, k, out_specs, out_axes, 1))
            source = {leaf.dst_path: e.src for e in graph.edges_of(EdgeKind.DATA) if e.dst == name for leaf in e.leaves}
            # what the loop holds as arrays: its own values, and the answers of the calls it waits for
            # (an action served to it and passed back as the next call's previous action)
            answered = {n for n in group.nodes
                        if any(e.src == n and e.dst in in_loop for e in graph.edges_of(EdgeKind.DATA))}
            loop_side = in_loop | answered | {LOOP}
            sources: dict[str, set[str]] = {}
            for e in graph.edges_of(EdgeKind.DATA):
                if e.dst == name:
                    for leaf in e.leaves:
                        sources.setdefault(leaf.dst_path, set()).add(e.src)
            # an argument the loop passes at some calls and an output of this group at others (a
            # learner's step size, its own output passed back, given its first value by the loop):
            # the loop's values travel with the call's definitions, not in the ring
            given = tuple(sorted(path for path, srcs in sources.items() if srcs & loop_side and srcs - loop_side))
            crossing = [leaf for leaf in node.inputs
                        if source.get(leaf.dst_path, LOOP) in loop_side and leaf.dst_path not in given]
            if given:
                remote[name] = replace(remote[name], given=frozenset(given))
            rate = graph.rate_of(name)   # from the loops where they say (a trace window may be atypical)
            per_update = max(1, math.ceil(rate / clock_rate)) if rate else 1
            capacity = (traj.capacity if traj is not None else lag + 2) * per_update
            specs = tuple(split_spec(leaf, loop.replicas, name, graph, placed) for leaf in crossing)
            axes = tuple(leaf.axis if loop.replicas > 1 else None for leaf in crossing)
            whole = tuple((i, axis, specs[i].shape[axis]) for i, (leaf, axis) in enumerate(zip(crossing, axes))
                          if axis is not None and leaf.axis_name == "env" and LOOP in sources.get(leaf.dst_path, {LOOP}))
            # only where a call merges one piece of every replica, in order: a batch of the replicas
            # that have arrived (arrival gathering) or of a learner's own (several) would miss rows
            in_order = lag == 0 or (traj.discipline if traj is not None else "ordered") == "ordered"
            paths = tuple(leaf.dst_path for leaf in crossing)
            if whole and in_order and group.replicas == 1:
                remote[name] = replace(remote[name], whole=whole)
                # each such leaf's fingerprint goes beside its rows, the same in every replica: a value that
                # differs beyond a replica's rows (a statistic whose size equals the number of environments)
                # is refused where the merge compares it, not joined from the replicas' parts
                specs += tuple(TensorSpec((), "int", "python") for _ in whole)
                axes += tuple(None for _ in whole)
                paths += tuple(WHOLE_MARK + paths[i] for i, _, _ in whole)
            counts = tuple(i for i, leaf in enumerate(crossing) if leaf.axis_name == "count") if loop.replicas > 1 else ()
            for k in range(loop.replicas):
                rings.append(Ring(f"{name}[{k}]", name, k, specs, axes, capacity, counts, paths))
        publish = []
        depth = param.capacity if param is not None else lag + 3
        for state in sorted({e.dst for e in graph.edges_of(EdgeKind.STATE_WRITE) if e.src in members}):
            b = _reads(graph, state, in_loop, depth)
            if b is not None:
                publish.append(b)
                reads[state] = b
        held = {e.src for e in graph.edges_of(EdgeKind.STATE_READ) if e.dst in members}
        held |= {e.dst for e in graph.edges_of(EdgeKind.STATE_WRITE) if e.src in members}
        for state in held:
            ship.setdefault(state, []).append(group.name)
        if param is not None:
            kind = param.discipline or "latest"
            if kind not in disciplines.VERSION_CHOICE:
                raise PlacementError(f"policy '{placed.policy}' asks for parameter discipline {kind!r}",
                                     fix=f"use one of: {', '.join(disciplines.VERSION_CHOICE)}")
            choice = disciplines.VERSION_CHOICE[kind](lag)
        gather = traj.discipline if traj is not None else "ordered"
        if gather == "balanced":
            gather = "arrival"
        overflow = disciplines.OVERFLOW[traj.overflow.value]() if traj is not None else disciplines.Deliver()
        arrival = loop.replicas > 1 and gather != "ordered" and lag > 0
        written: dict[str, list[str]] = {}
        for e in graph.edges_of(EdgeKind.STATE_WRITE):
            if e.src in members:
                written.setdefault(e.src, []).append(e.dst)
        two = next(((who, states) for who, states in written.items() if len(states) > 1), None)
        if two is not None and arrival:
            who, states = two
            raise PlacementError(
                f"learner '{who}' writes '{states[0]}' at some calls and '{states[1]}' at others (one fragment "
                f"for several states, as double Q-learning's learn(qa, qb) / learn(qb, qa)), but policy "
                f"'{placed.policy}' gathers the calls of its {loop.replicas} loop processes as they arrive "
                f"(max_lag={lag}): one process's call on '{states[0]}' could be merged with another's on "
                f"'{states[1]}' into one update", where=graph.node(who).called_at,
                fix=f"make a fragment per state (learn_b = ff.fragment('learner', writes=..., name='{who}_b')"
                    f"({who}.fn)) and call each on its own state, or run with max_lag=0 (one call of each process "
                    "per update, in order), with one acting process, or with --policy pipelined")
        if loop.replicas > 1 and gather != "ordered" and lag > 0:
            gathered = (f"policy '{placed.policy}' gathers the calls of its {loop.replicas} loop processes as they "
                        f"arrive (max_lag={lag})")
            again = graph.learner_again
            if again is not None and again[0] in members:
                raise called_again(again[0], "several learner steps on one rollout, or on several samples of one trip",
                                   gathered, again[1])
            for name in members:   # (and one the loop first calls so after the trace, at the call: see the loop)
                if name in remote and graph.node(name).role == "learner":
                    remote[name] = replace(remote[name], gathered=gathered)
        base = ServiceProgram(group.name, _threads(graph, group, processes), loop.replicas, group.nodes, tuple(rings),
                              tuple(publish), logs, clock, gather == "ordered" or lag == 0, overflow, lag,
                              tuple(sorted(held)), tuple(replies),
                              traj.batch_wait_ms / 1000 if traj is not None and lag > 0 else 0.0,
                              writes=tuple(sorted({e.dst for e in graph.edges_of(EdgeKind.STATE_WRITE)
                                                   if e.src in members})),
                              keeps=tuple(sorted({e.src for e in graph.edges_of(EdgeKind.DATA)
                                                  if e.src in group.nodes and e.dst in group.nodes
                                                  and graph.node(e.dst).role != "logger"})))
        if len(instances) == 1:
            services.append(base)
            bases.append(group.name)
            continue
        if replies:
            raise PlacementError(f"policy '{placed.policy}' replicates '{group.name}', which answers requests from the "
                                 "acting side; replicated learners take trajectories only", where=graph.defined_at,
                                 fix="keep inference with the actors")
        for state in held:
            ship[state] = [n for n in ship[state] if n != group.name] + instances
        for j, name in enumerate(instances):
            mine = range(j * per, (j + 1) * per)
            services.append(replace(base, group=name, producers=per, first=j * per, rank=j, world=len(instances),
                                    rings=tuple(r for r in rings if r.replica in mine),
                                    publish=base.publish if j == 0 else ()))
            bases.append(group.name)
    any_writes = {state for sp in services for state in sp.writes}
    first_holder: dict[str, str] = {}   # an unwritten state -> the first group holding it (its replicas: all of them)
    for sp, base_name in zip(services, bases):
        for state in sp.states:
            if state not in any_writes:
                first_holder.setdefault(state, base_name)
    services = [replace(sp, saves=tuple(st for st in sp.states if first_holder.get(st) == base_name))
                for sp, base_name in zip(services, bases)]
    program = LoopProgram(loop.name, loop.replicas, _threads(graph, loop, processes), frozenset(in_loop), remote, reads,
                          {k: tuple(v) for k, v in ship.items()}, choice, max_lag, _not_restartable(remote, choice, loop.restart),
                          routes or None,
                          tuple((f, part, item.index, item.keys) for s in services if s.rank == 0
                                for f, items in s.logs.items() for part, item in enumerate(items)),
                          _local_rows(graph, in_loop, loop.replicas), one_acting_process(placed.policy, placed.options))
    return Lowered(placed, program, tuple(services))
