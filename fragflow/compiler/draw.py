"""An image of the FDG (PNG or SVG), drawn with networkx and matplotlib.

Columns follow the dataflow: the loop and environments, actors, buffers, learners, then state
and sinks. Data edges are solid, state reads dashed blue, state writes dashed red; each edge is
labelled with its rate per update.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from fragflow.compiler.ir import EdgeKind, Graph, NodeKind

_COLUMN = {"env": 0, "actor": 1, "buffer": 2, "learner": 3, "logger": 4}
_COLOR = {"env": "#b7e4c7", "actor": "#a9d6e5", "buffer": "#ffe5a8", "learner": "#f4acb7", "logger": "#dddddd"}


def _column(graph: Graph, name: str) -> int:
    node = graph.node(name)
    if node.kind is NodeKind.LOOP:
        return 0
    if node.kind is NodeKind.STATE:
        return 4
    return _COLUMN.get(node.role or "", 2)


def draw(graph: Graph, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n.name, layer=_column(graph, n.name))
    labels: dict[tuple[str, str], str] = {}
    styles: dict[tuple[str, str], EdgeKind] = {}
    for e in graph.edges:
        key = (e.src, e.dst)
        g.add_edge(*key)
        rate = "once" if e.rate == 0 else f"{e.rate:g}/upd"
        labels[key] = rate if key not in labels else labels[key]
        styles.setdefault(key, e.kind)
    pos = nx.multipartite_layout(g, subset_key="layer", align="vertical", scale=2.0)
    fig, ax = plt.subplots(figsize=(13, 7))
    ax.set_title(f"fragmented dataflow graph of '{graph.name}' ({graph.defined_at})", fontsize=11)
    for kind, style, color in ((EdgeKind.DATA, "solid", "#444444"), (EdgeKind.STATE_READ, "dashed", "#1f77b4"),
                               (EdgeKind.STATE_WRITE, "dashed", "#d62728")):
        edges = [k for k, v in styles.items() if v is kind]
        nx.draw_networkx_edges(g, pos, edgelist=edges, ax=ax, style=style, edge_color=color, arrows=True,
                               arrowsize=14, node_size=3200, connectionstyle="arc3,rad=0.12")
    for n in graph.nodes:
        if n.kind is NodeKind.FRAGMENT:
            text = f"{n.name}\n{n.role} · {n.backend}\n" + ("once" if n.rate == 0 else f"{n.rate:g}/update")
            color = _COLOR.get(n.role or "", "#eeeeee")
        elif n.kind is NodeKind.STATE:
            text, color = f"{n.name}\nstate v0..v{n.versions - 1}", "#e0c3fc"
        else:
            text, color = "loop", "#ffffff"
        x, y = pos[n.name]
        ax.text(x, y, text, ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round,pad=0.4", "facecolor": color, "edgecolor": "#555555"})
    nx.draw_networkx_edge_labels(g, pos, edge_labels=labels, ax=ax, font_size=7, label_pos=0.4,
                                 connectionstyle="arc3,rad=0.12")
    ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
