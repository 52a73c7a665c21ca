from __future__ import annotations

import dataclasses

import pytest

import fragflow as ff
from fragflow.compiler.ir import Edge, EdgeKind, LeafSpec, Node, NodeKind
from fragflow.compiler.pytree import TensorSpec
from fragflow.errors import GraphError
from fragflow.placement.placed import Channel, Group, PlacedGraph
from tests.fakes import tiny


def test_verify_passes_on_traced_graph_and_networkx_view_matches():
    graph = ff.trace(tiny.train, tiny.Args()).verify()
    g = graph.to_networkx()
    assert set(g.nodes) == {n.name for n in graph.nodes}
    assert g.number_of_edges() == len(graph.edges)


def test_verify_lists_every_problem_and_prints_the_graph():
    graph = ff.trace(tiny.train, tiny.Args())
    spec = LeafSpec("", "params", TensorSpec((2,), "float32", "numpy"))
    bad = dataclasses.replace(
        graph,
        nodes=graph.nodes + (Node("act", NodeKind.FRAGMENT, role="actor"),),
        edges=graph.edges + (Edge("learn", "act", EdgeKind.DATA, "[1]", "params", (spec,), 1.0),
                             Edge("ghost", "act", EdgeKind.DATA, "", "x", (spec,), 1.0)),
        _index={},
    )
    with pytest.raises(GraphError) as info:
        bad.verify()
    msg = str(info.value)
    assert "node name 'act' is used more than once" in msg
    assert "edge ghost -> act names a node that does not exist" in msg
    assert "fragments:" in msg   # the graph is printed


def test_placement_verify_catches_unplaced_fragments_and_uncarried_edges():
    graph = ff.trace(tiny.train, tiny.Args())
    names = [n.name for n in graph.fragments()]
    acting = tuple(n for n in names if n not in ("learn", "log"))
    placed = PlacedGraph(graph, "test", (), (Group("actors", acting), Group("learner", ("learn",))), ())
    problems = placed.problems()
    assert "fragment 'log' is not placed in any group" in problems
    assert "edge buffer.collect -> learn.batch crosses groups but no channel carries it" in problems
    carried = dataclasses.replace(placed, groups=placed.groups[:1] + (Group("learner", ("learn", "log")),),
                                  channels=(Channel("traj", "trajectory", "actors", "learner",
                                                    ("buffer.collect -> learn.batch",)),))
    assert carried.problems() == []
    split = dataclasses.replace(carried, groups=(Group("a", tuple(n for n in acting if n != "env.step")),
                                                 Group("b", ("env.step", "learn", "log"))))
    assert any("fragments of 'env' are split across groups" in p for p in split.problems())


def test_every_docstring_example_holds():
    """The examples in every module's docstrings are run, so they stay true (the package's own said
    the first policy in order was single_process; ff.fragment's used np without importing it)."""
    import doctest
    import importlib
    import pkgutil

    import fragflow

    attempted, failed = 0, []
    for info in pkgutil.walk_packages(fragflow.__path__, "fragflow."):
        if info.name.startswith(("fragflow.backends.ray", "fragflow.__main__")):
            continue   # (Ray's backend starts nothing at import, but importing ray alone takes seconds)
        module = importlib.import_module(info.name)
        result = doctest.testmod(module)
        attempted += result.attempted
        if result.failed:
            failed.append(info.name)
    assert attempted > 50 and failed == []
