from __future__ import annotations

import numpy as np
import pytest
import torch

import fragflow as ff
import fragflow.api.envs
from fragflow.algorithms import ppo
from fragflow.compiler.pytree import leaf_paths, to_numpy

ARGS = ppo.Args(total_timesteps=3072, num_envs=4, num_steps=64, seed=3)


def assert_same_tree(a, b):
    pa, pb = leaf_paths(a), leaf_paths(b)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (path, x), (_, y) in zip(pa, pb):
        assert np.array_equal(to_numpy(x), to_numpy(y)), path


def eager(args):
    """Call the training loop directly, without fragflow's runtime; capture its environment."""
    made = []
    real = fragflow.api.envs.make

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    fragflow.api.envs.make = spy
    try:
        state = ppo.train(args)
    finally:
        fragflow.api.envs.make = real
    return state, made[0].finished_episodes


def test_single_process_reproduces_the_eager_loop_exactly():
    state, episodes = eager(ARGS)
    result = ff.run(ppo.train, ARGS, policy="single_process")
    assert isinstance(state["params"]["actor"][0]["w"], torch.Tensor)
    assert_same_tree(result.value, state)
    assert [(r, n) for _, r, n in result.episodes] == episodes
    assert len(episodes) > 20


def test_same_seed_same_result_and_other_seed_differs():
    a = ff.run(ppo.train, ARGS, policy="single_process")
    b = ff.run(ppo.train, ARGS, policy="single_process")
    assert_same_tree(a.value, b.value)
    assert a.episode_returns == b.episode_returns
    c = ff.run(ppo.train, ppo.Args(total_timesteps=3072, num_envs=4, num_steps=64, seed=4), policy="single_process")
    assert c.episode_returns != a.episode_returns


def test_run_reports_steps_updates_and_target():
    result = ff.run(ppo.train, ARGS, target_return=15.0, policy="single_process")
    s = result.summary
    assert s["status"] == "completed" and s["policy"] == "single_process"
    assert s["env_steps"] == 3072 and s["updates"] == 12
    assert s["solved_at_steps"] is not None and s["solved_at_steps"] <= 3072
    stopped = ff.run(ppo.train, ARGS, target_return=15.0, stop_on_target=True, policy="single_process")
    assert stopped.summary["status"] == "stopped_at_target"
    assert stopped.summary["env_steps"] == s["solved_at_steps"]


def test_ppo_learns_cartpole():
    result = ff.run(ppo.train, ppo.Args(total_timesteps=40_960, seed=1), policy="single_process")
    first = np.mean(result.episode_returns[:20])
    assert result.summary["final_return_mean"] > 3 * first and result.summary["final_return_mean"] > 100


def test_ppo_continuous_actions_run():
    args = ppo.Args(env_id="Pendulum-v1", total_timesteps=2048, num_envs=2, num_steps=256, seed=1)
    result = ff.run(ppo.train, args, policy="single_process")
    params = result.value["params"]
    assert params["logstd"].shape == (1, 1)
    assert result.summary["env_steps"] == 2048 and len(result.episodes) == 10   # 1024 steps per env, 200-step episodes
    [traj] = [e for e in result.graph.edges if e.src == "buffer.collect" and e.kind.value == "data"]
    assert {leaf.dst_path: leaf.spec.dtype for leaf in traj.leaves}["batch['action']"] == "float32"


def test_user_exception_in_fragment_names_the_fragment(write_algo):
    path, marks = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(obs):
            if obs.sum() > 2:
                raise ValueError("boom")  # @raise
            return obs

        def train():
            for i in range(5):
                act(np.full(2, float(i)))  # @call
    """)
    from fragflow.program import load

    program = load(str(path))
    with pytest.raises(ValueError, match="boom") as info:
        ff.run(program.train, policy="single_process")
    assert any("while fragflow traced fragment 'act'" in n for n in info.value.__notes__)
