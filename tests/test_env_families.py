"""The environment families beyond classic control, at small budgets: the plumbing, not the learning
(benchmarks/ measure that). PettingZoo (the ``multiagent`` extra), MuJoCo (``mujoco``) and Atari
(``atari``) are installed by ``make test``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import fragflow as ff
from fragflow.driver import compile
from fragflow.errors import UnknownEnvError
from tests.test_multiprocess import same_tree, shm_leftovers


def test_a_pettingzoo_parallel_env_has_an_agent_axis_and_counts_every_agents_episode():
    env = ff.envs.make("mpe2:simple_spread_v3", num_envs=2, seed=3, max_cycles=4)
    assert (env.num_envs, env.num_agents) == (2, 3)                    # type: ignore[attr-defined]
    obs = env.reset()
    assert obs.shape == (2, 3, 18) and obs.dtype == np.float32
    events = []
    for _ in range(4):
        obs, reward, terminated, truncated, info = env.step(np.zeros((2, 3), np.int64))
        events.append(env.step.events(None))
        assert reward.shape == terminated.shape == truncated.shape == (2, 3)
    assert truncated.all() and not terminated.any()                    # max_cycles ends every agent's episode
    assert not np.array_equal(info["final_obs"], obs)                  # same-step autoreset: obs is the next episode's
    assert [n for n, _ in events] == [2, 2, 2, 2]                      # env steps: one per environment
    finished = events[-1][1]
    assert len(finished) == 6 and {length for _, length in finished} == {4}   # 2 envs x 3 agents
    fresh = ff.envs.make("mpe2:simple_spread_v3", num_envs=2, seed=3, max_cycles=4)
    assert np.array_equal(fresh.reset(), env.reset())                  # seeded per environment


def test_an_env_with_unlike_agents_is_refused_with_the_fix():
    from mpe2 import simple_adversary_v3

    with pytest.raises(UnknownEnvError, match="different observation or action spaces") as err:
        ff.envs.make(simple_adversary_v3.parallel_env, num_envs=1)
    assert "pad" in err.value.fix


@pytest.mark.parametrize("critic", ["central", "independent"])
def test_mappo_runs_under_one_process_and_split_across_two_actors(critic):
    from fragflow.algorithms import mappo

    args = mappo.Args(total_timesteps=400, num_envs=4, num_steps=25, update_epochs=1, critic=critic)
    expected = ff.run(mappo.train, args, policy="single_process")
    assert expected.summary["env_steps"] == 400 and expected.summary["episodes"] == 400 // 25 * 3
    again = ff.run(mappo.train, args, policy="pipelined(max_lag=0)")
    assert same_tree(again.value["model"].state_dict(), expected.value["model"].state_dict())

    compiled = compile(mappo.train, args, policy="actor_learner(actors=2)")
    ring = next(r for r in compiled.lowered.rings if r.fragment == "learn" and r.replica == 0)
    assert (25, 2, 3, 18) in [tuple(s.shape) for s in ring.specs]     # each actor: half the envs, every agent
    split = ff.run(mappo.train, args, policy="actor_learner(actors=2)", compiled=compiled)
    assert split.summary["env_steps"] == 400 and split.summary["episodes"] == 48
    assert shm_leftovers() == []


def test_mappo_critic_sees_every_agent_and_ippo_only_its_own():
    import torch

    from fragflow.algorithms import mappo

    central, own = mappo.Agents(4, 3, 5, 8, central=True), mappo.Agents(4, 3, 5, 8, central=False)
    obs = torch.zeros(2, 3, 4)
    base_c, base_o = central.value(obs), own.value(obs)
    obs[:, 2] = 1.0                                                     # only agent 2's observation changes
    assert not torch.allclose(central.value(obs)[:, 0], base_c[:, 0])   # agent 0's central critic sees it
    assert torch.equal(own.value(obs)[:, 0], base_o[:, 0])              # its independent critic does not


def test_mujoco_continuous_ppo_runs_under_one_process_and_pipelined():
    from fragflow.algorithms import ppo

    env = ff.envs.make("HalfCheetah-v5", num_envs=2, seed=0)
    assert env.reset().shape == (2, 17) and env.single_action_space.shape == (6,)
    env.close()
    args = ppo.Args(env_id="HalfCheetah-v5", total_timesteps=256, num_envs=2, num_steps=32, update_epochs=1)
    one = ff.run(ppo.train, args, policy="single_process")
    two = ff.run(ppo.train, args, policy="pipelined(max_lag=0)")
    assert one.summary["env_steps"] == two.summary["env_steps"] == 256
    assert same_tree(one.value, two.value)
    assert shm_leftovers() == []


class Jackpot(gym.Env):
    """Reward 5 every step, 3-step episodes: clipped for learning, reported as the game's."""

    observation_space = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros((8, 8, 3), np.uint8), {}

    def step(self, action):
        self.t += 1
        return np.full((8, 8, 3), self.t, np.uint8), 5.0, self.t >= 3, False, {}


def test_wrappers_apply_per_env_and_clipped_rewards_leave_reported_returns_alone():
    env = ff.envs.make(Jackpot, num_envs=2, wrappers=[gym.wrappers.GrayscaleObservation], clip_rewards=True)
    assert env.reset().shape == (2, 8, 8)
    for _ in range(3):
        _, reward, *_ = env.step(np.zeros(2, np.int64))
    assert (reward == 1.0).all()
    assert env.pop_finished() == [(15.0, 3), (15.0, 3)]


def test_atari_preprocessing_and_the_cnn_ppo():
    from fragflow.algorithms import ppo_atari

    env = ff.envs.atari("ALE/Pong-v5", num_envs=2, seed=0)
    obs = env.reset()
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
    env.close()
    args = ppo_atari.Args(env_id="ALE/Pong-v5", total_timesteps=96, num_envs=2, num_steps=16, update_epochs=1)
    result = ff.run(ppo_atari.train, args, policy="single_process")
    assert result.summary["env_steps"] == 96 and result.summary["updates"] == 3


def test_a_missing_family_names_its_extra():
    with pytest.raises(UnknownEnvError) as err:
        ff.envs.make("nosuchfamily:Thing-v0")
    assert "pip install" in err.value.fix
