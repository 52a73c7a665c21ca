"""The fragmented dataflow graph (FDG): a small, closed IR.

Node kinds
==========

=========  ===========================================================================================
kind       what it stands for
=========  ===========================================================================================
FRAGMENT   one fragment (a user function or a built-in such as ``env.step``): role, backend, where it
           is defined and called, and how many times it runs per learner update (``rate``; 0 = once,
           at set-up)
STATE      a versioned value (``ff.versioned``): written by learners (one or more, placed together),
           read by other fragments
LOOP       the user's training loop itself: the source of every fragment input that fragflow did not
           produce (constants, random keys, arithmetic done in the loop)
=========  ===========================================================================================

Edge kinds
==========

===========  =========================================================================================
DATA         array pytree from a fragment (or the loop) output to a fragment input; carries the specs
             of its leaves and how many times it is crossed per learner update
STATE_WRITE  a learner's output that becomes the next version of a STATE
STATE_READ   a fragment's input that reads a STATE (``path`` names the view, e.g. ``['params']``)
EFFECT       an object's mutation seen by a later call on the same object (a replay buffer's ``add``
             before its ``sample``): no data crosses, but the order is a dependency placements keep
             (the fragments of one object always share a group)
===========  =========================================================================================

Leaves carry a *named batch axis* where one is known: ``env`` (environments: env outputs, rollout
batches), ``sample`` (a replay buffer's samples), ``time`` or ``agent``. A policy that replicates a
producer splits such a leaf along its axis and the consumer merges the pieces along it; a leaf
without one must be the same in every replica.

Every dataclass is frozen; passes build new graphs. ``verify()`` checks the invariants the
policies rely on and reports every problem at once, with the graph printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fragflow.compiler.loops import LoopSpec, calls_per
from fragflow.compiler.pytree import TensorSpec
from fragflow.errors import GraphError
from fragflow.source import SourceLoc


class NodeKind(Enum):
    FRAGMENT = "fragment"
    STATE = "state"
    LOOP = "loop"


class EdgeKind(Enum):
    DATA = "data"
    STATE_WRITE = "write"
    STATE_READ = "read"
    EFFECT = "effect"


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """One leaf crossing an edge: where it leaves the producer, where it enters the consumer."""

    src_path: str
    dst_path: str
    spec: TensorSpec
    axis: int | None = None        # the leaf's named batch axis, where known ...
    axis_name: str | None = None   # ... and its name: env, sample, time or agent ("count": an env's num_envs)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    kind: NodeKind
    role: str | None = None
    backend: str | None = None
    defined_at: SourceLoc | None = None
    called_at: SourceLoc | None = None
    rate: float = 0.0              # calls per learner update in steady state; 0 = set-up only
    calls: int = 0                 # calls seen while tracing
    instance: str | None = None    # built-in object the fragment belongs to (co-located by policies)
    versions: int = 0              # STATE: versions seen while tracing
    arity: int = 0                 # number of outputs when it returns a tuple, else 0
    inputs: tuple[LeafSpec, ...] = ()   # argument leaves in call order (dst_path, spec, batch axis)
    outputs: tuple[tuple[str, TensorSpec], ...] = ()   # output leaves (path, spec) as traced
    out_skeleton: Any = field(default=None, compare=False, hash=False)   # the output without its leaves
    out_kinds: Any = field(default=None, compare=False, hash=False)   # ... and beside a written state (kind_change)
    output_axes: tuple[tuple[str, str, int], ...] = ()   # (path, axis name, axis) of its batched output leaves
    static: tuple[str, ...] = ()   # arguments that are configuration (a frozen dataclass, a string)
    splittable: bool = True        # ENV: its environments can be split across processes (ff.envs.make, or
                                   # a user's env sized with ff.envs.ids)
    evaluation: bool = False       # ENV: an evaluation env (stepped whole by every acting process)
    mutates_state: str = ""        # not a learner, yet changed the versioned state it read in place (which)
    changes_read: tuple[str, str] | None = None   # a learner that changed in place state it reads, not writes: (state, argument)
    dtype_change: tuple[str, SourceLoc | None] | None = None   # its output's dtypes changed between calls
    actor_mode: str = ""           # not a learner, sets the training mode of state modules no learner sets (which)
    learner_mode: str = ""         # not a learner, acts with modules whose training mode a learner sets (which)
    captures_state: str = ""       # reaches an object versioned state holds through a global or closure (which)
    reads_captured: str = ""       # reaches versioned state itself (a handle) through a global or closure (which)
    changes_data: tuple[str, ...] = ()   # module data (a global array, list, dict) it changes in place, or rebinds
    changes_through: tuple[str, ...] = ()   # ... of it, what it changes without naming it (a global optimizer's network)
    rebinds_data: tuple[str, ...] = ()   # ... of it, the globals it rebinds (global SHIFT; SHIFT = ...)
    names_data: tuple[str, ...] = ()     # module data its code reaches that some fragment changes
    other_rows: str = ""           # also called on another number of environments (an evaluation env): where
    other_rows_evaluation: bool = True   # ... that number is no training env's (else: two training envs)
    other_inputs: str = ""         # also given an argument of another shape: which, where
    module_arg: tuple[str, str, SourceLoc | None] | None = None   # given an nn.Module: (argument path, type, where)
    loop_changes: str = ""         # module data its code reaches that the loop changed between its calls
    torch_mode: str | None = None  # torch's mode around its calls from the loop where not the default (torch.no_grad(),
                                   # an autocast; "" where some calls had it and some not)
    torch_mode_at: SourceLoc | None = None   # ... and where the loop first called it so
    # a learner that changed a plain attribute of a module its state holds (self.epsilon = ..., which a
    # version does not carry), and the acting fragments whose code may read it: (where, readers)
    plain_attribute: tuple[str, tuple[str, ...]] | None = None
    reaches: tuple[str, ...] = ()  # module data its code reaches that no fragment changes (checked in the run)


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str
    kind: EdgeKind
    src_port: str = ""
    dst_port: str = ""
    leaves: tuple[LeafSpec, ...] = ()
    rate: float = 0.0
    where: SourceLoc | None = field(default=None, compare=False)   # the user's line that first crossed it

    @property
    def nbytes(self) -> int:
        return sum(leaf.spec.nbytes for leaf in self.leaves)


@dataclass(frozen=True, slots=True)
class LoopRead:
    """The loop itself read a fragment's output (tested, converted, compared, computed with it):
    it needs the value in the loop's process."""

    fragment: str
    path: str            # "[1]['loss']"
    what: str            # "compared with <"
    where: SourceLoc | None


@dataclass(frozen=True, slots=True)
class Graph:
    """A traced FDG. ``name`` and ``defined_at`` are the training function's."""

    name: str
    defined_at: SourceLoc | None
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    updates_traced: int = 0
    env_steps_traced: int = 0
    loops: tuple[LoopSpec, ...] = ()    # the training function's loops, outermost first
    loop_reads: tuple[LoopRead, ...] = ()   # fragment outputs the loop itself reads (first read of each)
    loop_prints: tuple[LoopRead, ...] = ()  # ... and prints (print, str, an f-string without a spec): first of each
    remade_state: SourceLoc | None = None   # a line that ran ff.versioned(...) again after a learner wrote its state
    learner_again: tuple[str, SourceLoc | None] | None = None   # a learner called with no env step since its last call
    uncalled_learners: tuple[tuple[str, SourceLoc | None], ...] = ()   # the module's learners the loop never called
    # (state, learner, its call, what) where the loop changed the hyper-parameters of a state's optimizer
    changed_optimizer: tuple[str, str, SourceLoc | None, str] | None = None
    nested_learner: tuple[str, str, SourceLoc | None] | None = None   # (learner, the fragment it ran inside, where)
    stale_state: tuple[str, int, int, str, SourceLoc | None] | None = None   # an old version passed to a fragment
    state_read: tuple[str, SourceLoc | None] | None = None   # the loop read versioned state: how, where
    state_printed: tuple[str, SourceLoc | None] | None = None   # the loop printed written state: which, where
    # the loop changed (or, once a learner wrote it, read) a tensor versioned state holds through a
    # reference of its own, not the handle: ("changed" or "read", the state, the tensor, how, where)
    state_used: tuple[str, str, str, str, SourceLoc | None] | None = None
    star_state: tuple[str, str, SourceLoc | None] | None = None   # state through a fragment's *args: what, who, where
    # a fragment changed an array argument in place and a later call was given that memory again:
    # (the changer, its argument, its call, the later fragment, its call, the array's maker: None, the loop)
    changed_arg: tuple[str, str, SourceLoc | None, str, SourceLoc | None, str | None] | None = None
    own_env: SourceLoc | None = None   # where the program made an environment itself (gymnasium.make, make_vec)
    log_columns: tuple[str, ...] = ()   # the names ff.log wrote while tracing, first seen first (metrics.csv's order)
    # a name ff.log was given both a learner's output under and a value of the loop's own: (the name, the
    # learner, where its output was logged, where the loop's value was)
    log_clash: tuple[str, str, SourceLoc | None, SourceLoc | None] | None = None
    # module data a fragment changes in place that the training loop's own code reads: (the fragment, the data)
    loop_reads_changed: tuple[tuple[str, str], ...] = ()
    # an actor given one jax.random key for all its environments: (the actor, its parameter, the call)
    shared_key: tuple[str, str, SourceLoc | None] | None = None
    # the program made an evaluation env (ff.envs.make(..., evaluation=True)), stepped while tracing or first after
    makes_evaluation: bool = False
    program_threads: int = 0   # the most torch threads the program set while traced (torch.set_num_threads; 0: none)
    _index: dict[str, Node] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({n.name: n for n in self.nodes})

    def node(self, name: str) -> Node:
        return self._index[name]

    def clock(self, among: tuple[str, ...] | None = None) -> str | None:
        """The fragment whose calls count versions: the state-writing fragment (of ``among``, or of
        the whole graph) with the highest rate, the first in trace order on a tie; None if none writes.
        Writers of a state an actor reads come first: a target network synced (Polyak) every env step
        is not what the run's updates count, the learner stepping the acted-with network is; and of
        those, one called in a loop around the acting first: a hand-over learner called once between
        two phases (outside the acting loop, so that the trace, ending at the online learner's first
        call, saw more of its calls) is not the online learner."""
        writes = self.edges_of(EdgeKind.STATE_WRITE)
        reads = [e for e in self.edges_of(EdgeKind.STATE_READ) if self.node(e.dst).role == "actor"]
        acted = {e.src for e in reads}
        writers = {e.src for e in writes}
        candidates = [n for n in self.fragments() if n.name in writers and (among is None or n.name in among)]
        first = [n for n in candidates if any(e.src == n.name and e.dst in acted for e in writes)]
        candidates = first or candidates
        actors = [self.node(e.dst).called_at for e in reads]

        def with_acting(n: Node) -> bool:
            return any(loop.encloses(n.called_at) and any(loop.encloses(at) for at in actors) for loop in self.loops)

        return max(candidates, key=lambda n: (with_acting(n), n.rate)).name if candidates else None

    def derived_rate(self, name: str) -> float | None:
        """Calls of ``name`` per clock call from the loop structure alone (see
        :func:`~fragflow.compiler.loops.calls_per`); None where the structure does not say."""
        clock = self.clock()
        if clock is None:
            return None
        return calls_per(self.node(name).called_at, self.node(clock).called_at, self.loops)

    def rate_of(self, name: str) -> float:
        """The rate the runtime sizes for: derived from the loops where they say, and never below
        what the trace observed."""
        derived = self.derived_rate(name)
        observed = self.node(name).rate
        clock_rate = self.node(self.clock() or name).rate
        if clock_rate == 0:
            # the clock was not called in the trace's steady window (an online learner first called as
            # the trace ended, after a pretraining phase with a learner of its own): the other rates
            # count that phase's updates, only the loops say how many calls each clock call brings
            return derived if derived is not None else max(observed, 1.0 if name == self.clock() else 0.0)
        return observed if derived is None else max(derived * clock_rate, observed)

    def loops_of(self, name: str) -> list[LoopSpec]:
        """The loops that enclose a fragment's call in the training function, outermost first."""
        where = self.node(name).called_at
        return [loop for loop in self.loops if loop.encloses(where)]

    def fragments(self, role: str | None = None) -> list[Node]:
        return [n for n in self.nodes if n.kind is NodeKind.FRAGMENT and (role is None or n.role == role)]

    def edges_of(self, kind: EdgeKind) -> list[Edge]:
        return [e for e in self.edges if e.kind is kind]

    def to_networkx(self) -> Any:
        """The graph as a ``networkx.MultiDiGraph`` (nodes and edges carry the IR objects)."""
        import networkx as nx  # imported here: most commands never need it

        g = nx.MultiDiGraph(name=self.name)
        for n in self.nodes:
            g.add_node(n.name, node=n)
        for e in self.edges:
            g.add_edge(e.src, e.dst, edge=e)
        return g

    def problems(self) -> list[str]:
        """Every broken invariant, as one line each (empty when the graph is sound)."""
        out: list[str] = []
        names = [n.name for n in self.nodes]
        for dup in sorted({x for x in names if names.count(x) > 1}):
            out.append(f"node name '{dup}' is used more than once")
        if not any(n.kind is NodeKind.FRAGMENT for n in self.nodes):
            out.append("the graph has no fragment")
        for e in self.edges:
            if e.src not in self._index or e.dst not in self._index:
                out.append(f"edge {e.src} -> {e.dst} names a node that does not exist")
                continue
            src, dst = self._index[e.src], self._index[e.dst]
            if e.kind is EdgeKind.DATA:
                if src.kind is NodeKind.STATE or dst.kind is not NodeKind.FRAGMENT:
                    out.append(f"data edge {e.src} -> {e.dst} must run from a fragment or the loop to a fragment")
                if not e.leaves:
                    out.append(f"data edge {e.src} -> {e.dst} carries no leaf")
            elif e.kind is EdgeKind.STATE_WRITE:
                if src.role != "learner" or dst.kind is not NodeKind.STATE:
                    out.append(f"state write {e.src} -> {e.dst} must run from a learner to a state")
            elif e.kind is EdgeKind.STATE_READ:
                if src.kind is not NodeKind.STATE or dst.kind is not NodeKind.FRAGMENT:
                    out.append(f"state read {e.src} -> {e.dst} must run from a state to a fragment")
            elif e.kind is EdgeKind.EFFECT:
                if src.instance is None or src.instance != dst.instance:
                    out.append(f"effect edge {e.src} -> {e.dst} must join two fragments of one object")
        for n in self.nodes:
            if n.kind is NodeKind.FRAGMENT and n.rate < 0:
                out.append(f"fragment '{n.name}' has negative rate {n.rate}")
        return out

    def verify(self) -> Graph:
        """Raise :class:`GraphError` listing every problem, with the graph printed; else return self."""
        problems = self.problems()
        if problems:
            from fragflow.compiler.printer import format_graph

            raise GraphError(
                f"the dataflow graph of '{self.name}' is inconsistent ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems),
                where=self.defined_at,
                fix="a graph built by hand must follow the invariants above; fragflow's own tracer and policies "
                    "check them in their tests",
                detail=format_graph(self),
            )
        return self
