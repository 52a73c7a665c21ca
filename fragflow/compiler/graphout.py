"""The graph a trace recorded (see :mod:`fragflow.compiler.tracer`), built from its records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fragflow.compiler.ir import Edge, EdgeKind, Graph, Node, NodeKind
from fragflow.compiler.modes import names_read
from fragflow.compiler.recording import LOOP, NodeRec
from fragflow.source import SourceLoc

if TYPE_CHECKING:
    from fragflow.compiler.tracer import Tracer


def graph_of(t: Tracer, name: str, defined_at: SourceLoc | None) -> Graph:
    """The graph a trace recorded: its nodes (fragments, states, the loop) and edges, with each one's
    calls and crossings per update in the steady window."""
    if not t.begins_run:
        t._loop_changed()   # (changed after the last learner call traced)
        t._state_changed(t._learned_at, "after")
    steady = 1 if t.window.window_updates[1] else 0
    per = max(t.window.window_updates[steady], 1)   # updates inside the window the rates come from
    nodes: list[Node] = []
    loop_used = any(k[0] == LOOP for k in t._edges)
    if loop_used:
        nodes.append(Node(LOOP, NodeKind.LOOP, defined_at=defined_at))
    for sname, srec in t._states.items():
        nodes.append(Node(sname, NodeKind.STATE, defined_at=srec.created_at, versions=srec.versions))
    for rec in t._nodes.values():
        backend = "+".join(sorted(rec.backends)) or "python"
        nodes.append(Node(rec.name, NodeKind.FRAGMENT, role=rec.role, backend=backend,
                          defined_at=rec.defined_at, called_at=rec.called_at,
                          rate=_per(rec.calls[steady], per), calls=sum(rec.calls), instance=rec.instance,
                          arity=rec.arity, inputs=tuple(rec.inputs or ()), outputs=tuple(rec.out_specs or ()),
                          out_skeleton=rec.out_skeleton, out_kinds=rec.out_kinds,
                          output_axes=rec.out_axes or (),
                          static=rec.static, splittable=_splittable(t, rec),
                          evaluation=t.fragments[rec.name].evaluation,
                          mutates_state=rec.mutates, dtype_change=rec.dtype_change, captures_state=rec.captures, actor_mode=t.modes.actor_mode(rec.name),
                          learner_mode=t.modes.learner_mode(rec.name),
                          reads_captured=rec.reads_captured, other_rows=rec.other_rows,
                          other_rows_evaluation=rec.other_rows_n not in t._env_sizes,
                          other_inputs=rec.other_inputs, module_arg=rec.module_arg, loop_changes=rec.loop_changes,
                          torch_mode=rec.torch_mode[0], torch_mode_at=rec.torch_mode[1],
                          plain_attribute=_attribute_readers(t, rec.name),
                          reaches=tuple(dict.fromkeys(label for label, _, _, value, _ in rec.reached or ()
                                                      if id(value) not in t._changed_data
                                                      and id(value) not in t._state_objects)),
                          changes_data=tuple(sorted(set(rec.changes_data.values()) | set(rec.rebinds.values()))),
                          rebinds_data=tuple(sorted(set(rec.rebinds.values()))),
                          changes_through=tuple(sorted(set(rec.changes_through.values()))),
                          changes_read=rec.changes_read,
                          names_data=tuple(sorted({label for i, label in rec.names_data.items()
                                                   if i in t._changed_data} |
                                                  {label for label, _, _, value, _ in rec.reached or ()
                                                   if id(value) in t._changed_data} |
                                                  {t._rebound[(id(holder), name)][1]
                                                   for _, holder, name, _, _ in rec.reached or ()
                                                   if (id(holder), name) in t._rebound
                                                   and t._rebound[(id(holder), name)][0] != rec.name}))))
    edges = [
        Edge(src, dst, kind, src_port, dst_port, tuple(er.leaves.values()),
             _per(er.crossings[steady], per), er.where)
        for (src, dst, kind, src_port, dst_port), er in t._edges.items()
    ]
    return Graph(name, defined_at, tuple(nodes), tuple(edges), t.window.updates, t.env_steps)

def _splittable(t: Tracer, rec: NodeRec) -> bool:
    """An env made by ff.envs.make slices itself; a user's own env only if the program asked
    ff.envs.ids for its slice (an evaluation env is never split)."""
    if rec.role != "env":
        return True
    frag = t.fragments[rec.name]
    return frag.evaluation or getattr(frag.instance, "slices_itself", False) or t.sized_by_ids


def _per(count: int, updates: int) -> float:
    return round(count / updates, 4)


def _attribute_readers(t: Any, name: str) -> tuple[str, tuple[str, ...]] | None:
    """A learner's change of a plain attribute of a module in its state, with the fragments (not
    learners) that read that state and whose code, or the module's methods they run, may read the
    attribute (the first such change)."""
    reads = {(key[0], key[1]) for key in t._edges if key[2] == EdgeKind.STATE_READ}
    for state, where, attribute, cls in t.modes.attributes.get(name, ()):
        readers = tuple(sorted(rec.name for rec in t._nodes.values() if rec.role != "learner"
                               and (state, rec.name) in reads and attribute in names_read(t.fragments[rec.name].fn, cls)))
        if readers:
            return where, readers
    return None
