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

from fragflow.compiler.ir import EdgeKind, Graph, NodeKind
from fragflow.compiler.pytree import fits
from fragflow.errors import GraphError, ShapeChangedError


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
    threads: int = 0               # torch intra-op threads of each process; 0: chosen by the lowering from the
                                   # learners' size (FRAGFLOW_THREADS overrides)
    restart: bool = True           # a loop group: a replica whose process dies may be started again (where the
                                   # lowering can: not with exact versions or served inference); service groups never


@dataclass(frozen=True, slots=True)
class Channel:
    name: str
    kind: str                      # "trajectory" | "parameter"
    src_group: str
    dst_group: str
    edges: tuple[str, ...]         # "src[out] -> dst.port" of the FDG edges it carries (edge_label; "src -> dst.port" is accepted too)
    max_lag: int = 0
    overflow: Overflow = Overflow.BLOCK
    capacity: int = 1
    discipline: str = ""           # how it is read (see acting_and_learning and fragflow.lowering.disciplines)
    batch_wait_ms: float = 0.0     # a consumer answering requests (inference) runs on what arrived this long after
                                   # the first request, when the rest has not come (arrival gathering only)


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
        written: dict[str, str] = {}
        for e in self.graph.edges_of(EdgeKind.STATE_WRITE):   # one process holds the state's latest version
            other = written.setdefault(e.dst, seen.get(e.src, "?"))
            if other != seen.get(e.src, "?"):
                out.append(f"state '{e.dst}' is written in both '{other}' and '{seen.get(e.src)}'")
        carried = {e for c in self.channels for e in c.edges}
        for e in self.graph.edges:
            src = self.graph.node(e.src)
            if src.kind is NodeKind.LOOP:
                continue
            if e.kind is EdgeKind.DATA and e.src != e.dst and seen.get(e.src) != seen.get(e.dst):
                label = edge_label(e.src, e.dst, e.dst_port, e.src_port)
                # (a policy may label an edge without the output it carries, as edge_label did before)
                if label not in carried and edge_label(e.src, e.dst, e.dst_port) not in carried:
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
            from fragflow.compiler.printer import format_placed

            raise GraphError(
                f"policy '{self.policy}' produced an inconsistent placement ({len(problems)} problem(s)):\n  - "
                + "\n  - ".join(problems),
                where=self.graph.defined_at, fix="this is a bug in the distribution policy; please report it",
                detail=format_placed(self))
        return self


def one_acting_process(policy: str, options: tuple[tuple[str, Any], ...]) -> str:
    """How a fix names running ``policy`` with one acting process (the option that says how many)."""
    opts = dict(options)
    if "env_workers" in opts:
        return f"{policy}(env_workers=1)"
    if "learners" in opts:   # (each learner takes its own actors: one acting process is another policy)
        return "a policy with one acting process (pipelined)"
    return f"{policy}(actors=1)"


def edge_label(src: str, dst: str, dst_port: str, src_port: str = "") -> str:
    """``act[1] -> buffer.add.step``: the output (``src_port``, as the edges are listed) and the argument."""
    return f"{src}{src_port} -> {dst}.{dst_port}"


def _refuse_writes_no_version_counts(graph: Graph, policy: str, service: set[str]) -> None:
    """Versions count the clock's calls (and take every write made before the next one), so a loop
    in which a learner writes the state an actor on the acting side acts with, but the clock is
    never called, nor in any loop around it (a second phase of training with a learner of its own,
    after pretraining with the clock), makes no new version: a policy whose actors act versions behind would act there for good
    with the version of the clock's last calls, whatever ``max_lag`` says. At ``max_lag=0`` an actor
    waits for every write made so far, and an actor served beside the learner acts with its newest
    state: both run such a loop as eagerly."""
    from fragflow.errors import PlacementError

    clock = graph.clock()
    clock_at = graph.node(clock).called_at if clock is not None else None
    if not any(loop.encloses(clock_at) for loop in graph.loops):
        return   # (called outside the loops, or from a helper of the user's: where it runs is not known here)
    acting = [(e.src, e.dst) for e in graph.edges_of(EdgeKind.STATE_READ)
              if graph.node(e.dst).role == "actor" and e.dst not in service]
    for write in graph.edges_of(EdgeKind.STATE_WRITE):
        writer = graph.node(write.src)
        if writer.name == clock or writer.called_at is None:
            continue
        around = [loop for loop in graph.loops if loop.encloses(writer.called_at)]
        if not around or any(loop.encloses(clock_at) for loop in around):
            continue   # (a loop around both: each of its trips calls the clock too, and makes versions)
        loop = around[0]
        for state, actor in acting:
            if state != write.dst or not loop.encloses(graph.node(actor).called_at):
                continue
            raise PlacementError(
                f"learner '{writer.name}' writes '{state}', which actor '{actor}' acts with, in `{loop.header}`, where "
                f"learner '{clock}' (whose calls count the run's versions: the writer called most while tracing, at "
                f"{clock_at}) is never called: no new version is made there, so under policy '{policy}' the actors "
                f"would act for good with the version of the last calls of '{clock}', not within max_lag of what "
                f"'{writer.name}' learns", where=writer.called_at,
                fix="give the other phase a versioned value of its own (pre = ff.versioned(..., name='pre'), which its "
                    "learner writes) and hand it to the acted-with state by a learner called once between the phases "
                    "(state = adopt(state, pre)): the versions then count this loop's learner; or run with max_lag=0, "
                    "with central_inference (which acts beside the learner with its newest state) or with --policy "
                    "single_process")


def acting_and_learning(graph: Graph, *, policy: str, options: tuple[tuple[str, Any], ...], actors: int,
                        max_lag: int, overflow: Overflow, trajectory: str, parameters: str,
                        buffers_with_learner: bool = False, inference_with_learner: bool = False,
                        batch_wait_ms: float = 0.0) -> PlacedGraph:
    """The placement shared by the single-learner policies: the acting side (envs, actors,
    buffers and the loop itself) replicated ``actors`` times; every learner fragment, and the sinks
    they feed, in one service process; a trajectory channel for the calls the acting side makes
    into the learner group and a parameter channel for every state read on the acting side.

    ``buffers_with_learner`` also moves every buffer whose output feeds a learner (a replay
    buffer's add, sample and priority updates) into the learner group: the acting side then sends
    transitions, and the learner adds, samples and learns (the Ape-X shape).
    ``inference_with_learner`` moves the actor fragments there too: the acting side keeps only
    the environments and the loop, and each inference call becomes a request the learner's
    process answers for all actors at once, with its newest parameters (the SEED RL shape).
    With ``arrival`` gathering, ``batch_wait_ms`` bounds how long a request waits for the other
    actors' requests before it is answered with whatever has arrived.

    ``trajectory`` is the consumer's discipline: ``ordered`` (one piece per actor per call, in
    actor order) or ``arrival`` (first come, first served). ``parameters`` is ``exact`` (an actor
    acting for update ``i`` reads version ``max(0, i - max_lag)``), ``latest`` (it waits for
    ``i - max_lag`` and reads the newest) or ``balanced`` (it waits until the balance controller
    admits a rollout whose piece will be consumed within ``max_lag`` versions).

    Trajectory rings hold ``max_lag + 2`` items per actor per call per update (a fragment called
    ten times per update gets ten times the slots): the ``max_lag`` versions an actor may run
    ahead, the one being produced and the one being consumed. The parameter broadcast keeps one
    version more, so the oldest version an actor may still ask for is never the slot the learner
    is writing.
    """
    from fragflow.errors import ConfigError, LearnerOutputOnActingSideError, PlacementError

    if batch_wait_ms < 0:
        raise ConfigError(f"policy '{policy}' got a batching wait of {batch_wait_ms} ms",
                          fix="pass wait_ms=0 (answer what has arrived) or more")
    if max_lag < 0:
        raise ConfigError(f"policy '{policy}' got max_lag={max_lag}; a staleness bound is a number of versions",
                          fix="pass max_lag=0 (sequential semantics) or more")
    if actors < 1:
        raise ConfigError(f"policy '{policy}' needs actors >= 1, got {actors}", fix="pass actors=1 or more")
    learners = graph.fragments("learner")
    writers = {e.src for e in graph.edges_of(EdgeKind.STATE_WRITE)}
    if not any(n.name in writers for n in learners):
        found = ", ".join(n.name for n in learners) or "none"
        if not learners and graph.nested_learner is not None:
            name, outer, at = graph.nested_learner
            raise PlacementError(
                f"policy '{policy}' needs a learner called by the training loop, but learner '{name}' is called "
                f"inside fragment '{outer}', whose work it then is: it would run where '{outer}' runs, not as "
                "the learner", where=at,
                fix=f"call '{name}' from the training loop, passing it what '{outer}' returns, or run with "
                    "--policy single_process")
        if not learners and graph.uncalled_learners:
            name, at = graph.uncalled_learners[0]
            leaving = next((loop for loop in graph.loops if loop.exits), None)   # (a break: not the budget, maybe)
            raise PlacementError(
                f"policy '{policy}' needs a learner, but the loop ended ({graph.env_steps_traced} env "
                f"steps) without calling learner '{name}'" + (f" (defined at {at})" if at is not None else "")
                + ": no update is made", where=graph.defined_at,
                fix=(f"call learner '{name}' in the training loop: the loop stepped its environments but never "
                     "reached a call of it (none written in the loop, or one under a condition the run never met, "
                     "as a warm-up longer than the budget); or give the run a budget of at least one update"
                     if graph.env_steps_traced else "give the run a budget of at least one update")
                    + " (--set the field of your Args that sets its steps or "
                    "updates, as total_timesteps in the algorithms/ programs)"
                    + (f"; where `{leaving.header}` ({leaving.where}) leaves early (a break), call the learner "
                       "before it does" if leaving is not None else "")
                    + ", or run with --policy single_process")
        raise PlacementError(f"policy '{policy}' needs a learner fragment that writes versioned state; found: {found}"
                             + (" (none writes: declared with writes=None, or given no versioned state)" if learners
                                else ""),
                             where=graph.defined_at,
                             fix=("give a learner the state it updates, made with ff.versioned(...), as its first "
                                  "parameter (or name it: @ff.fragment('learner', writes='state')), and return the "
                                  "new state first" if learners else
                                  "mark the update function @ff.fragment('learner') and give it the state from "
                                  "ff.versioned(...)") + ", or run with --policy single_process")
    service = {n.name for n in learners}
    if inference_with_learner:
        service |= {n.name for n in graph.fragments("actor")}
    if max_lag > 0:
        _refuse_writes_no_version_counts(graph, policy, service)
    if buffers_with_learner:
        # a buffer the learner samples moves; one whose output is per environment (a rollout buffer's
        # collect, batched along 'env') stays with the actors that stepped those environments, and
        # its rollouts travel as they do under actor_learner
        feeding = {graph.node(e.src).instance for e in graph.edges_of(EdgeKind.DATA)
                   if e.dst in service and graph.node(e.src).role == "buffer"
                   and not any(leaf.axis_name == "env" for leaf in e.leaves)}
        service |= {n.name for n in graph.fragments() if n.instance is not None and n.instance in feeding}
    for read in graph.loop_reads:   # the loop holds Pending references to what runs in the service
        if read.fragment in service and not (inference_with_learner and graph.node(read.fragment).role == "actor"):
            buffer = graph.node(read.fragment).role == "buffer"   # (a replay buffer moved beside the learner)
            raise LearnerOutputOnActingSideError(
                f"output {read.path} of {graph.node(read.fragment).role} '{read.fragment}' is {read.what} in the "
                f"training loop, but policy '{policy}' runs '{read.fragment}' in another process, so the loop does "
                "not have its value", where=read.where,
                fix="compute it in the learner it is given to and return it with the learner's metrics (to ff.log), "
                    "keep the buffer with the actors (--policy actor_learner), or run with --policy single_process"
                if buffer else
                "send it whole to ff.log (logged where it is computed) or to fragments placed with it (indexing it "
                "there); for a decision the loop takes on it (`if m['loss'] < x: break`), have the learner keep it "
                "in the versioned state and decide in an actor fragment given that state (`if should_stop(state): "
                "break`: an actor's answer is the loop's); or run with --policy single_process")
    if graph.log_clash is not None and graph.log_clash[1] in service:
        column, writer, by_learner, by_loop = graph.log_clash
        raise PlacementError(
            f"ff.log is given '{column}' both from an output of learner '{writer}' (at {by_learner}) and as a value "
            f"of the loop's own, but policy '{policy}' runs '{writer}' in another process: the two values reach "
            "the driver in either order, so the row would hold one or the other", where=by_loop,
            fix=f"log the loop's value under a name of its own (ff.log({{'loop_{column.replace('/', '_')}': ...}})), "
                "or run with --policy single_process")
    sinks = {e.dst for e in graph.edges_of(EdgeKind.DATA) if e.src in service and graph.node(e.dst).role == "logger"}
    service |= sinks
    for e in graph.edges_of(EdgeKind.DATA):
        dst = graph.node(e.dst)
        if e.src in service and e.dst not in service:
            src = graph.node(e.src)
            if src.role == "actor" and inference_with_learner:
                continue   # an inference request: the acting side waits for its reply
            if src.role == "learner":
                raise LearnerOutputOnActingSideError(
                    f"output {e.leaves[0].src_path if e.leaves else e.src_port} of learner '{e.src}' is used as plain "
                    f"data by {dst.role} fragment '{e.dst}' (argument '{e.dst_port}'), but policy '{policy}' runs the "
                    "learner in another process",
                    where=e.where or dst.called_at,
                    fix=("keep the buffer with the learner (--policy learner_replay) or run with --policy single_process"
                         if dst.role == "buffer" else
                         "the acting side only sees learner state through a versioned broadcast: return it as part of "
                         "the learner's versioned state and pass state[...] to the fragment, send metrics to ff.log, "
                         "or run with --policy single_process"))
            raise PlacementError(
                f"policy '{policy}' places '{e.src}' in the learner process, but its output {e.src_port} is used by "
                f"{dst.role} fragment '{e.dst}' on the acting side", where=e.where or dst.called_at,
                fix="use a policy that keeps the buffer with the actors (actor_learner), or --policy single_process")
    for n in graph.fragments():
        if n.name in service and n.module_arg is not None:
            arg, kind, at = n.module_arg
            raise PlacementError(
                f"{n.role} fragment '{n.name}' is given a torch module, {arg} (a {kind}), as an argument, but policy "
                f"'{policy}' runs '{n.name}' in another process, and what a call sends there is arrays, Python numbers "
                "and configuration: a module goes there as versioned state", where=at,
                fix="make it versioned state (x = ff.versioned({'net': module}, name='x') before the loop) and pass "
                    "that: a learner fragment that writes it trains or syncs it, and every fragment reads its newest "
                    "version; or run with --policy single_process")
        if n.name in service and n.other_inputs and not n.other_rows:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' is given {n.other_inputs}, but policy '{policy}' runs it in another "
                "process, whose channels are sized for one shape", where=n.defined_at or n.called_at,
                fix=("where two calls add different numbers of transitions (model-made or relabeled ones beside "
                     "the environments' own), keep the others in a buffer of their own (a second ff.ReplayBuffer, "
                     "sampled beside the first), or add them in calls of one size; or run with a policy that keeps "
                     "the buffer with the actors (actor_learner, pipelined), or --policy single_process"
                     if n.role == "buffer" else
                     f"where one call is given data of varying size (an episode, a filtered batch), pad it to a fixed "
                     f"size and pass the true length or a mask beside it; where two calls differ, give the calls with "
                     f"the other shape a fragment of their own: the same function under another name "
                     f"({n.name}_b = ff.fragment(..., name='{n.name}_b')({n.name}.fn), with the arguments of "
                     f"'{n.name}''s decorator); or run with --policy single_process"))
        if n.name in service and n.other_rows and not n.other_rows_evaluation:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' is called on {n.other_rows} (two training envs of different sizes), "
                f"but policy '{policy}' answers it in the learner's process through channels sized for one number "
                "of environments", where=n.defined_at,
                fix=f"give the calls on the other env a fragment of their own ({n.name}_b = ff.fragment('{n.role}', "
                    f"name='{n.name}_b')({n.name}.fn)), or run with a policy that acts where the envs step "
                    "(actor_learner, single_process)")
        if n.name in service and n.other_rows:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' is called on {n.other_rows}, but policy '{policy}' answers it "
                "in the learner's process through channels sized for one number of environments",
                where=n.defined_at,
                fix=f"give the evaluation its own fragment ({n.name}_eval = ff.fragment('{n.role}', "
                    f"name='{n.name}_eval')({n.name}.fn))"
                    + (" and run with env_workers=1 (each worker steps the evaluation env whole, which one answer "
                       "cannot serve)" if inference_with_learner and actors > 1 else "")
                    + ", or run with a policy that acts where the envs step (actor_learner, single_process)")
    for n in graph.fragments():
        if n.dtype_change is not None:
            raise ShapeChangedError(
                f"{n.dtype_change[0]}\n    policy '{policy}' runs its calls in several processes, whose channels "
                "carry each leaf in the dtype of its first call", where=n.dtype_change[1],
                fix="return the same dtypes every call (cast where it is returned: np.asarray(action, np.int64), "
                    "x.astype(np.float32)), or run with --policy single_process, which runs it as eagerly")
    acting = tuple(n.name for n in graph.fragments() if n.name not in service)
    sides: dict[str, Any] = {}
    for n in graph.fragments():
        if n.instance:
            other = sides.setdefault(n.instance, n)
            if (other.name in service) != (n.name in service):
                learner, actor = (n, other) if n.name in service else (other, n)
                raise PlacementError(
                    f"{actor.role} fragment '{actor.name}' and {learner.role} fragment '{learner.name}' are methods of "
                    f"one object ('{n.instance}'), whose fragments run in one process, but policy '{policy}' runs "
                    f"'{learner.name}' in the learner's process and '{actor.name}' on the acting side",
                    where=learner.defined_at,
                    fix=f"make '{learner.name}' a function of its own (or a method of another object) that takes the "
                        "state it needs as arguments, or run with --policy single_process")
    for n in graph.fragments():
        if n.changes_read is not None and n.name not in acting:
            state, pname = n.changes_read
            readers = sorted({e.dst for e in graph.edges_of(EdgeKind.STATE_READ) if e.src == state and e.dst in acting})
            if readers:
                first = graph.node(readers[0])
                raise PlacementError(
                    f"learner '{n.name}' changes the versioned state '{state}' in place (argument '{pname}'), which it "
                    f"does not write, and {first.role} fragment '{first.name}' reads that state, but policy "
                    f"'{policy}' runs '{first.name}' apart from the learner: a state changes for other processes only "
                    "by a new version, which a learner that writes it returns, so the change would never reach it",
                    where=n.defined_at,
                    fix=f"make the change in a learner that writes '{state}' (@ff.fragment(\"learner\", "
                        f"writes=\"{pname}\") returning it, as dqn.py's sync_target writes its target network), or "
                        f"keep what changes in the state '{n.name}' writes; or run with --policy single_process")
        if n.name in acting and n.mutates_state:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' changes the versioned state {n.mutates_state} in place, but policy "
                f"'{policy}' runs it apart from the learner: the change would stay in its process, and the next "
                "version broadcast would overwrite it", where=n.defined_at,
                fix="leave state a fragment reads unchanged (work on a copy: tensor.clone(), array.copy(); in-place "
                    "ops change it even under torch.no_grad()), make the change in a learner that writes the state, "
                    "or run with --policy single_process (a module's buffers travel with each version, those "
                    "registered with persistent=False too: a cache the actor builds for itself belongs in a plain "
                    "attribute, self.cache = ..., not a buffer)")
        if n.name in acting and n.actor_mode:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' changes the versioned state {n.actor_mode} in place, but policy "
                f"'{policy}' runs it apart from the learner: eagerly the learner then learns in the mode it set (no "
                "dropout after .eval()), but apart the learner's copy keeps its own mode", where=n.defined_at,
                fix="set the mode in the learner too (state['q'].train() at its start: then each side acts in the "
                    "mode it sets), or leave the mode to the learner, or run with --policy single_process")
        if n.name in acting and n.learner_mode:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' acts with versioned state {n.learner_mode} (.eval() or .train()), but "
                f"policy '{policy}' runs it apart from the learner: eagerly it acts in the mode the learner leaves, "
                "apart its copy keeps its own (a version carries the tensors, not the mode)", where=n.defined_at,
                fix=f"set the mode in '{n.name}' itself (q.eval() at its start), or leave the modules in training "
                    "mode at the learner's end, or run with --policy single_process")
        if n.name in acting and n.captures_state:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' reaches an object of the versioned state {n.captures_state} instead "
                f"of receiving the state as an argument, but policy '{policy}' runs it apart from the learner: it "
                "would act with the object as it was when its process started, never with a new version",
                where=n.defined_at,
                fix=f"add a parameter to '{n.name}' and pass the state (or a view such as state['model']) at the "
                    "call, or run with --policy single_process")
        readers_apart = [r for r in (n.plain_attribute[1] if n.plain_attribute else ()) if r in acting]
        if n.name in service and readers_apart and n.plain_attribute is not None:
            first_reader = graph.node(readers_apart[0])
            raise PlacementError(
                f"learner '{n.name}' changes {n.plain_attribute[0]}, which {first_reader.role} fragment '{first_reader.name}' "
                f"may read, but policy '{policy}' runs '{first_reader.name}' apart from the learner: a version carries a "
                "module's parameters and buffers, not its plain attributes, so it would act with the attribute's "
                "first value throughout", where=n.defined_at,
                fix="keep it where a version carries it: a buffer (self.register_buffer('name', torch.tensor(x)), "
                    "changed in place or assigned a tensor), or an entry of the versioned state (ff.versioned({'q': q, "
                    "'epsilon': 1.0})); or run with --policy single_process or central_inference (which acts in the "
                    "learner's process)")
        if n.name in service and n.torch_mode is not None and (not n.torch_mode or "autocast" in n.torch_mode):
            # (gradients off around every call: the process that runs it turns them off as the loop did)
            how = (f"with {n.torch_mode} around its calls" if n.torch_mode else
                   "with torch's mode around some of its calls and not others (torch.no_grad(), an autocast)")
            raise PlacementError(
                f"{n.role} fragment '{n.name}' is called from the loop {how} (at {n.torch_mode_at}), but policy "
                f"'{policy}' runs it in another process, where the loop's mode does not reach: "
                + ("it would compute in float32 where eagerly it computes in the autocast's dtype" if n.torch_mode
                   else "each call there runs in the one mode its process is given"),
                where=n.torch_mode_at,
                fix=(f"enter the autocast inside '{n.name}' (`with torch.autocast(...):` around its body, as its own "
                     "part of the work)" if n.torch_mode else
                     f"call '{n.name}' the same way every time, or set the mode inside it (`with torch.no_grad():` "
                     "around its body)") + ", or run with --policy single_process or a policy that runs it where the "
                    "loop runs")
        if n.name in service and n.captures_state:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' reaches an object of the versioned state {n.captures_state} instead "
                f"of receiving the state as an argument, but policy '{policy}' runs it in the learner's process, "
                "which is given the state apart from the program: the object the variable names there is a copy "
                "of it as it was at the start, which the learner's updates never reach (an optimizer stepping "
                "stale parameters, a scheduler of another optimizer)", where=n.defined_at,
                fix=f"reach it through the state '{n.name}' is given (state['opt'], state['sched']: a scheduler may be "
                    "part of the state and stepped in the learner; an optimizer of the state's parameters belongs in "
                    "it: ff.versioned({'net': net, 'opt': opt})); or run with --policy single_process")
    for n in graph.fragments():
        for m in graph.fragments():
            through = sorted(set(n.changes_through) & set(m.names_data)) if m.name != n.name else []
            if through:   # (each fragment is sent with its own copy of the module's data, in one process too)
                raise PlacementError(
                    f"{n.role} fragment '{n.name}' changes the {through[0]} in place through another object its "
                    f"code reaches (an optimizer of its parameters) and {m.role} fragment '{m.name}' reads it, but "
                    f"policy '{policy}' runs the program in several processes, each fragment sent with a copy of "
                    f"the module's data of its own: the copy '{n.name}' changes is not the one '{m.name}' reads",
                    where=n.defined_at,
                    fix="keep the network and its optimizer in versioned state (ff.versioned({'net': net, 'opt': "
                        f"opt}})), written by '{n.name}' and passed to '{m.name}', or run with --policy single_process")
            shared = sorted(set(n.changes_data) & set(m.names_data)) if m.name != n.name else []
            if shared and (n.name in service) != (m.name in service):
                how = (f"rebinds the {shared[0]} (`global {shared[0].split(chr(39))[1]}` and an assignment)"
                       if shared[0] in n.rebinds_data else f"changes the {shared[0]} in place")
                raise PlacementError(
                    f"{n.role} fragment '{n.name}' {how} and {m.role} fragment "
                    f"'{m.name}' reads it, but policy '{policy}' runs them in different processes, each with a "
                    f"copy of it of its own: '{m.name}' would never see the changes", where=n.defined_at,
                    fix=f"return what '{m.name}' needs from '{n.name}' and pass it on in the loop (or keep it in "
                        "versioned state a learner writes), or run with --policy single_process")
    if graph.shared_key is not None and actors > 1 and graph.shared_key[0] not in service:
        actor, param, at = graph.shared_key
        raise PlacementError(
            f"actor '{actor}' is given one jax.random key ('{param}') for all its environments, but policy '{policy}' "
            f"splits the environments across {actors} acting processes, each with a copy of the loop's key: they "
            "would draw the same numbers for their environments", where=at,
            fix="give each environment a key of its own, made from its id: ff.random.keys(seed, env.ids) (split "
                "with ff.random.split), or jax.random.split(key, n)[env.ids] with the run's n; or act in one process "
                "(actors=1)")
    for changer, data in graph.loop_reads_changed:
        if changer not in service:
            continue
        node = graph.node(changer)
        how = (f"rebinds the {data} (`global {data.split(chr(39))[1]}` and an assignment)" if data in node.rebinds_data
               else f"changes the {data} in place")
        raise PlacementError(
            f"{node.role} fragment '{changer}' {how} and the training loop reads it, but policy "
            f"'{policy}' runs '{changer}' in another process, with a copy of it of its own: the loop would never see "
            "the changes", where=node.defined_at,
            fix=f"return what the loop needs from '{changer}' (a metric goes to ff.log; what must last, to the "
                "versioned state), or run with --policy single_process")
    for n in graph.fragments():
        if n.name in service and n.loop_changes:
            raise PlacementError(
                f"{n.role} fragment '{n.name}' reads the {n.loop_changes}, which the training loop changes between "
                f"its calls, but policy '{policy}' runs '{n.name}' in another process, with a copy of it as it was "
                "when the process started: the loop's changes would never reach it", where=n.defined_at,
                fix=f"pass the value to '{n.name}' as an argument at the call (act(..., epsilon)), or keep it in "
                    "versioned state a learner writes (a network the loop syncs, a target network: "
                    "ff.versioned({'net': net}, name='target'), passed to the fragment and synced by a learner "
                    f"fragment that writes it); if '{n.name}' never reads the part that changes, read only "
                    f"the keys it needs by name (CFG['gamma']: those alone are checked; the dict used otherwise is "
                    "checked whole); or run with --policy single_process")
    changed = graph.changed_arg
    if changed is not None and changed[0] in service and not (changed[5] in service and changed[3] in service):
        # (made, changed and read again in one process, as a batch the learner's buffer samples: as eagerly)
        changer, label, at, reader, read_at, _ = changed
        node = graph.node(changer)
        later = f"its next call ({read_at})" if reader == changer else f"'{reader}' ({read_at})"
        raise PlacementError(
            f"{node.role} fragment '{changer}' changes its argument {label} in place, and {later} is given that "
            f"same array afterwards, but policy '{policy}' runs '{changer}' in another process, which is sent a "
            "copy: the change would never reach the loop's array", where=at,
            fix=f"work on a copy inside '{changer}' (x = x - mean rather than x -= mean; array.copy(), "
                f"tensor.clone()), or return the changed value and pass that on, or run with --policy single_process")
    if graph.stale_state is not None:
        state, old, new, fragment, at = graph.stale_state
        raise PlacementError(
            f"the training loop passes version {old} of versioned state '{state}' to '{fragment}' after a learner "
            f"wrote version {new} (a learner's new state was dropped, as in `_, metrics = learn(state, ...)`, or an "
            f"old handle kept), but policy '{policy}' runs the learner in another process, which keeps every "
            "write: the fragment would get the newest version", where=at,
            fix="assign every learner call's new state (state, metrics = learn(state, ...)); to compute metrics "
                "without an update, use a fragment that does not write the state; or run with --policy single_process")
    if graph.changed_optimizer is not None:
        state, learner, at, what = graph.changed_optimizer
        raise PlacementError(
            f"the training loop changes the optimizer of versioned state '{state}' between calls of learner "
            f"'{learner}' ({what}: a learning-rate schedule?), but policy '{policy}' runs '{learner}' in "
            "another process, whose optimizer the change never reaches", where=at,
            fix=f"keep the scheduler in the versioned state and step it in '{learner}' (state['sched'].step()), or "
                f"compute the rate in the loop, pass it to '{learner}' and set it there (for g in "
                "opt.param_groups: g['lr'] = lr), or run with --policy single_process")
    if inference_with_learner and actors == 1:
        # an actor served for the training envs and also given an evaluation env's observations: with
        # one env worker both go through its requests, as a second training env's would, where they
        # fit the slots its first call sized (another number of environments is refused above)
        for n in graph.fragments("actor"):
            into = [e for e in graph.edges_of(EdgeKind.DATA) if e.dst == n.name]
            evaluated = {leaf.dst_path: (leaf.spec, e) for e in into if graph.node(e.src).evaluation
                         for leaf in e.leaves}
            slots = {leaf.dst_path: leaf.spec for leaf in n.inputs}
            for e in into:
                for leaf in () if graph.node(e.src).evaluation else e.leaves:
                    on_eval, slot = evaluated.get(leaf.dst_path), slots.get(leaf.dst_path)
                    if on_eval is None or slot is None or (fits(on_eval[0], slot) and fits(leaf.spec, slot)):
                        continue
                    spec, eval_edge = on_eval
                    raise PlacementError(
                        f"actor '{n.name}' is given {leaf.dst_path} as {spec.short()} on evaluation env "
                        f"'{graph.node(eval_edge.src).instance or eval_edge.src}' and as {leaf.spec.short()} on the training envs "
                        f"(at {e.where or n.called_at}), but policy '{policy}' answers it in the learner's process "
                        "through channels sized for one of them", where=eval_edge.where or n.called_at,
                        fix=f"give the evaluation its own fragment ({n.name}_eval = ff.fragment('actor', "
                            f"name='{n.name}_eval')({n.name}.fn)) and call that on the evaluation env, or give both "
                            "calls arrays of one dtype and shape, or run with a policy that acts where the envs step "
                            "(actor_learner, pipelined, single_process)")
    if inference_with_learner and actors > 1:
        for e in graph.edges_of(EdgeKind.DATA):
            src, dst = graph.node(e.src), graph.node(e.dst)
            if src.evaluation and e.dst in service and dst.role == "actor":
                raise PlacementError(
                    f"policy '{policy}' answers actor '{e.dst}' for {actors} env workers at once, each sending the "
                    f"observations of its slice of the environments, but '{e.dst}' acts on evaluation env "
                    f"'{src.instance or e.src}', which every worker steps whole", where=e.where or dst.called_at,
                    fix="run with env_workers=1, or evaluate under a policy that acts in its actor processes "
                        "(actor_learner, pipelined, async_relaxed)")
    if actors > 1:
        opts = dict(options)
        who = "env worker" if "env_workers" in opts else "actor"
        one = one_acting_process(policy, options)
        # the acting processes a learner process merges the calls of (multi_learner: each learner its own)
        n_learners = int(opts["learners"]) if "learners" in opts else 1
        merged = actors // n_learners
        # buffers of the user's own fed per-environment data (each process's then holds its own): several
        # merged into one learner's call, or one per learner whose gradients are averaged
        fed = {graph.node(e.dst).instance for e in graph.edges_of(EdgeKind.DATA)
               if graph.node(e.dst).role == "buffer" and any(leaf.axis_name == "env" for leaf in e.leaves)} - {None} \
            if merged > 1 or n_learners > 1 else set()
        for e in graph.edges_of(EdgeKind.DATA):
            src = graph.node(e.src)
            if src.role != "buffer" or src.instance not in fed or e.src not in acting or e.dst not in service:
                continue
            unbatched = next((leaf for leaf in e.leaves if leaf.axis is None and leaf.axis_name is None), None)
            if unbatched is not None:
                apart = (f"and '{e.dst}' in another process: it would get one of their samples, with nothing to "
                         "merge them along") if merged > 1 else (
                         f"and each of its {n_learners} learners learns from its own processes' sample, their "
                         "gradients averaged: a batch of as many samples, where one process learns from one, with "
                         "nothing to split its size along")
                raise PlacementError(
                    f"{e.dst_port} of '{e.dst}' comes from buffer fragment '{e.src}' ({unbatched.dst_path}, "
                    f"{unbatched.spec.short()}), which declares no batch axis, but policy '{policy}' runs it in "
                    f"each of {actors} {who} processes, each with a buffer of its own, " + apart,
                    where=e.where or graph.node(e.dst).called_at,
                    fix="use ff.ReplayBuffer or ff.RolloutBuffer (which declare their batch axes), keep the buffer "
                        f"with the learner (--policy learner_replay), or run with {one}")
        for n in graph.fragments("env"):
            if n.name in acting and not n.splittable:
                raise PlacementError(
                    f"policy '{policy}' splits the environments across {actors} {who} processes, but env fragment "
                    f"'{n.name}' does not know which of them it steps: every {who} would step all of them",
                    where=n.defined_at,
                    fix="size your env with n = len(ff.envs.ids(num_envs)) and seed environment i with seed + i "
                        f"(or build it with ff.envs.make(YourEnv, ...)), or run with {one}")
    ordered_service = tuple(n.name for n in graph.fragments() if n.name in service)
    calls = tuple(edge_label(e.src, e.dst, e.dst_port, e.src_port) for e in graph.edges_of(EdgeKind.DATA)
                  if e.dst in service and e.src not in service)
    read_edges = tuple(f"{e.src}{e.src_port} -> {e.dst}.{e.dst_port}" for e in graph.edges_of(EdgeKind.STATE_READ)
                       if e.dst in acting)
    channels = [Channel("trajectory", "trajectory", "actors", "learner", calls, max_lag, overflow, max_lag + 2,
                        trajectory, batch_wait_ms if trajectory == "arrival" and max_lag > 0 else 0.0)]
    if read_edges:
        channels.append(Channel("parameters", "parameter", "learner", "actors", read_edges, max_lag, Overflow.DELIVER,
                                max_lag + 3, parameters))
    replies = tuple(edge_label(e.src, e.dst, e.dst_port, e.src_port) for e in graph.edges_of(EdgeKind.DATA)
                    if e.src in service and e.dst not in service)
    if replies:
        channels.append(Channel("replies", "reply", "learner", "actors", replies, 0, Overflow.BLOCK, 1, "request"))
    groups = (Group("actors", acting, replicas=actors, program="loop"),
              Group("learner", ordered_service, program="service"))
    return PlacedGraph(graph, policy, options, groups, tuple(channels))
