"""The canonical text form of a graph (FDG or placed graph). Golden tests pin it.

Fragments are listed in the order the loop first called them, edges in the order they were
first crossed; rates are per learner update (``once`` = set-up only), marked ``(loops)`` where
the loops around the calls give them (trip counts, no ``if`` around the call) and ``(traced)``
where they are what the traced updates showed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fragflow.compiler.ir import Edge, EdgeKind, Graph, LeafSpec, NodeKind

if TYPE_CHECKING:
    from fragflow.placement.placed import PlacedGraph


def _rate(rate: float, unit: str) -> str:
    if rate == 0:
        return "once"
    return f"{int(rate) if rate == int(rate) else round(rate, 2)}/{unit}"


def _bytes(n: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _endpoint(graph: Graph, name: str, port: str) -> str:
    return f"{name}{port}" if port else name


MAX_LEAVES = 8   # edges with more leaves are summarized per top-level entry


def _summarize_leaves(e: Edge) -> list[str]:
    groups: dict[str, list[LeafSpec]] = {}
    for leaf in e.leaves:
        if e.kind is EdgeKind.DATA:
            head = e.dst_port
        else:
            head = leaf.src_path.split("]")[0] + "]" if "[" in leaf.src_path else leaf.src_path
        groups.setdefault(head, []).append(leaf)
    lines = []
    for head, leaves in groups.items():
        kinds = sorted({f"{leaf.spec.short().split('[')[0]} {leaf.spec.backend}" for leaf in leaves})
        size = sum(leaf.spec.nbytes for leaf in leaves)
        what = leaves[0].spec.short() + " " + leaves[0].spec.backend if len(leaves) == 1 else f"{len(leaves)} leaves ({', '.join(kinds)})"
        lines.append(f"      {head}  {what}  {_bytes(size)}")
    return lines


def format_edge(graph: Graph, e: Edge, unit: str) -> list[str]:
    src = _endpoint(graph, e.src, e.src_port)
    if e.kind is EdgeKind.EFFECT:
        return [f"  {e.src} -> {e.dst}  effect  rate={_rate(e.rate, unit)}"]
    if e.kind is EdgeKind.STATE_WRITE:
        dst = e.dst
    elif e.kind is EdgeKind.STATE_READ:
        src = f"{e.src}{e.src_port}"
        dst = f"{e.dst}.{e.dst_port}"
    else:
        dst = f"{e.dst}.{e.dst_port}"
    head = f"  {src} -> {dst}  {e.kind.value}  rate={_rate(e.rate, unit)}  size={_bytes(e.nbytes)}"
    lines = [head]
    if len(e.leaves) > MAX_LEAVES:
        return lines + _summarize_leaves(e)
    for leaf in e.leaves:
        name = leaf.dst_path if e.kind is EdgeKind.DATA else (leaf.dst_path or "<root>")
        origin = f" <- {leaf.src_path}" if e.kind is EdgeKind.DATA and leaf.src_path else ""
        axis = f"  {leaf.axis_name}_axis={leaf.axis}" if leaf.axis is not None else ""
        lines.append(f"      {name}{origin}  {leaf.spec.short()} {leaf.spec.backend}{axis}")
    return lines


def format_graph(graph: Graph) -> str:
    """The FDG as stable text: header, fragments, state, edges."""
    unit = "update" if graph.updates_traced else "run"
    where = f" at {graph.defined_at}" if graph.defined_at else ""
    lines = [f"fdg {graph.name}{where}  (traced {graph.updates_traced} updates, {graph.env_steps_traced} env steps)"]
    frags = graph.fragments()
    width = max((len(n.name) for n in frags), default=4)
    bwidth = max((len(n.backend or "") for n in frags), default=5)
    lines.append("fragments:")
    for n in frags:
        defined = str(n.defined_at) if n.defined_at else "builtin"
        derived = graph.derived_rate(n.name) if n.role != "logger" else None
        source = "loops" if derived is not None else "traced"
        rate = graph.rate_of(n.name) if derived is not None else n.rate
        lines.append(f"  {n.name:<{width}}  role={n.role or '-':<7}  backend={n.backend or '-':<{bwidth}}  "
                     f"rate={_rate(rate, unit) + f' ({source})':<19}  called={n.called_at}  defined={defined}")
    if graph.loops:
        lines.append("loops:")
        for loop in graph.loops:
            inside = [n.name for n in frags if loop.encloses(n.called_at)]
            trips = "?" if loop.trips is None else str(loop.trips)
            lines.append(f"  {loop.where}  {loop.header}  trips={trips}  calls={', '.join(inside) or '-'}")
    states = [n for n in graph.nodes if n.kind is NodeKind.STATE]
    if states:
        lines.append("state:")
        for n in states:
            lines.append(f"  {n.name}  versions=0..{n.versions - 1}  created={n.defined_at}")
    lines.append("edges:")
    for e in graph.edges:
        lines.extend(format_edge(graph, e, unit))
    return "\n".join(lines) + "\n"


def format_placed(placed: PlacedGraph) -> str:
    """The placement: groups with their fragments, channels with their bounds, then the FDG."""
    lines = [f"placement by policy {placed.policy}({', '.join(f'{k}={v}' for k, v in placed.options)})"]
    lines.append("groups:")
    for g in placed.groups:
        lines.append(f"  {g.name}  x{g.replicas}  program={g.program}  device={g.device}  fragments={', '.join(g.nodes)}")
    lines.append("channels:")
    if not placed.channels:
        lines.append("  (none: every edge stays inside one process)")
    for c in placed.channels:
        lines.append(f"  {c.name}  {c.kind}  {c.src_group} -> {c.dst_group}  max_lag={c.max_lag}  "
                     f"overflow={c.overflow.value}  capacity={c.capacity}  discipline={c.discipline or '-'}")
        for label in c.edges:
            lines.append(f"      {label}")
    return "\n".join(lines) + "\n\n" + format_graph(placed.graph)
