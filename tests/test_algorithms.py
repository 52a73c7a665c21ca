"""The algorithm set under the policies that apply to it: the same result as the sequential run
wherever the policy promises it (small networks and budgets: these check the plumbing; the
benchmarks check the learning)."""

from __future__ import annotations

import pytest

import fragflow as ff
from fragflow.algorithms import sac
from fragflow.compiler.ir import EdgeKind
from fragflow.driver import compile
from tests.test_multiprocess import same_tree, shm_leftovers

SAC_SMALL = dict(total_timesteps=1200, learning_starts=1000, batch_size=32, hidden=32)


@pytest.fixture(scope="module")
def sac_reference():
    return {n: ff.run(sac.train, sac.Args(num_envs=n, **SAC_SMALL), policy="single_process") for n in (1, 2)}


def test_sac_graph_has_two_learners_writing_one_state_and_a_target_sync():
    graph = compile(sac.train, sac.Args(**SAC_SMALL), policy="single_process").placed.graph
    writers = sorted((e.src, e.dst) for e in graph.edges_of(EdgeKind.STATE_WRITE))
    assert writers == [("learn_actor", "state"), ("learn_q", "state"), ("sync_target", "target")]
    assert graph.clock() == "learn_q"                     # every step; learn_actor every other one
    assert graph.node("learn_actor").rate == pytest.approx(0.5)


@pytest.mark.parametrize("policy,envs", [("learner_replay(actors=1, max_lag=0)", 1),
                                         ("actor_learner(actors=1, max_lag=0)", 1),
                                         ("learner_replay(actors=1, max_lag=0)", 2)])
def test_sac_reproduces_single_process_bit_for_bit(sac_reference, policy, envs):
    """The actor step writes the state after the clock (learn_q): a version is only complete with
    it, so an actor acting with version v must wait for both writes of v (the broadcast's stamp)."""
    result = ff.run(sac.train, sac.Args(num_envs=envs, **SAC_SMALL), policy=policy)
    expected = sac_reference[envs]
    assert same_tree(result.value, expected.value), policy
    assert result.episode_returns == expected.episode_returns
    assert result.summary["updates"] == expected.summary["updates"] == (1200 - 1000) // envs - 1
    assert shm_leftovers() == []


def test_sac_transitions_from_two_actors_reach_one_learner_side_buffer(sac_reference):
    """The warm-up actions are made in the loop (uniform noise from per-env keys): the replay
    buffer's add declares its arguments as rows, so the policy splits and merges them per env."""
    result = ff.run(sac.train, sac.Args(num_envs=2, **SAC_SMALL), policy="learner_replay(actors=2, max_lag=0)")
    expected = sac_reference[2]
    assert result.summary["updates"] == expected.summary["updates"] and result.summary["env_steps"] == 1200
    # each env plays two whole episodes (200 steps each) of warm-up's random actions: the same ones
    first = [sorted(ret for _, ret, _ in sorted(r.episodes)[:4]) for r in (result, expected)]
    assert first[0] == first[1] and len(first[0]) == 4
    # acting is batched per actor (one env each instead of two): float rounding differs, so
    # later episodes are not compared bit for bit


def test_sac_with_stale_parameters_runs_to_the_end():
    result = ff.run(sac.train, sac.Args(**SAC_SMALL), policy="learner_replay(max_lag=2)")
    assert result.summary["updates"] == 199 and result.summary["env_steps"] == 1200
