from __future__ import annotations

import os

import pytest

import fragflow as ff
from fragflow.errors import ConfigError, UnknownPolicyError
from fragflow.placement import registry as policy
from tests.fakes import tiny


def test_parse_policy_reads_name_and_options():
    assert policy.parse_policy("single_process") == ("single_process", {})
    assert policy.parse_policy(" actor_learner(actors=4, max_lag=1) ") == ("actor_learner", {"actors": "4", "max_lag": "1"})
    with pytest.raises(UnknownPolicyError, match="write options as key=value"):
        policy.parse_policy("a(b)")
    with pytest.raises(UnknownPolicyError, match="policy option 'actors' is given twice"):
        policy.parse_policy("actor_learner(actors=2, actors=3)")


def test_unknown_policy_suggests_the_close_name():
    with pytest.raises(UnknownPolicyError, match="did you mean 'single_process'"):
        policy.get("single_proces")
    with pytest.raises(UnknownPolicyError, match="unknown distribution policy 'nope'"):
        ff.distribute("nope")


def test_policy_options_are_checked():
    with pytest.raises(ConfigError, match="policy 'single_process' has no option 'actors'"):
        policy.resolve("single_process(actors=2)", tiny.train)


def test_cli_policy_overrides_decorator_and_decorator_overrides_default(monkeypatch):
    def train(args):
        pass

    assert policy.resolve(None, train)[0].name == policy.default_policy()
    assert policy.default_policy() == ("pipelined" if (os.cpu_count() or 1) >= 2 else "single_process")
    marked = ff.distribute("single_process")(train)
    assert marked.__fragflow_policy__ == ("single_process", {})
    fake = policy.PolicySpec("fake", "nothing", "a test policy", tiny.Args, lambda g, o: None)  # type: ignore[arg-type,return-value]
    real = policy.available()
    monkeypatch.setattr(policy, "available", lambda: {**real, "fake": fake})
    train.__fragflow_policy__ = ("fake", {})
    assert policy.resolve(None, train)[0].name == "fake"
    assert policy.resolve("single_process", train)[0].name == "single_process"


def test_every_registered_policy_places_a_verified_graph():
    from fragflow.errors import PlacementError

    graph = ff.trace(tiny.train, tiny.Args())
    for name, spec in policy.available().items():
        if name == "multi_learner":   # it averages torch gradients: tiny's numpy learner is refused at its line
            with pytest.raises(PlacementError, match="learner 'learn' computes with numpy") as info:
                spec.place(graph, spec.make_options({}))
            assert info.value.where == graph.node("learn").defined_at
            continue
        placed = spec.place(graph, spec.make_options({})).verify()
        assert placed.policy == name
        assert {n for g in placed.groups for n in g.nodes} == {n.name for n in graph.fragments()}
