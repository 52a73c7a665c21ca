"""The environment families beyond classic control, at small budgets: the plumbing, not the learning
(benchmarks/ measure that). PettingZoo (the ``multiagent`` extra), MuJoCo (``mujoco``) and Atari
(``atari``) are installed by ``make test``."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest

import fragflow as ff
from fragflow.driver import compile
from fragflow.errors import ConfigError, UnknownEnvError
from tests.test_multiprocess import same_tree, shm_leftovers


def test_a_pettingzoo_parallel_env_has_an_agent_axis_and_counts_every_agents_episode():
    env = ff.envs.make("mpe2:simple_spread_v3", num_envs=2, seed=3, max_cycles=4)
    assert (env.num_envs, env.num_agents) == (2, 3)                    # type: ignore[attr-defined]
    obs = first = env.reset()
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
    assert np.array_equal(fresh.reset(), first)                        # seeded per environment, at the first reset
    assert not np.array_equal(env.reset(), first)                      # a later one goes on to other episodes


def _agents_leaving(life: dict[str, int], possible: list[str], ends: str = "terminated") -> type:
    """A PettingZoo parallel env of one-number observations whose agents (``life``'s, among
    ``possible``) each earn 1 a step and leave after their ``life`` steps, ended as ``ends`` says;
    the episode ends when the last one leaves."""
    from pettingzoo import ParallelEnv

    class Leaving(ParallelEnv):
        metadata = {"name": "leaving"}

        def __init__(self):
            self.possible_agents = list(possible)

        def observation_space(self, agent):
            return gym.spaces.Box(-100, 100, (1,), np.float32)

        def action_space(self, agent):
            return gym.spaces.Discrete(2)

        def reset(self, seed=None, options=None):
            self.t, self.agents = 0, list(life)
            return {a: np.zeros(1, np.float32) for a in self.agents}, {a: {} for a in self.agents}

        def step(self, actions):
            self.t += 1
            obs = {a: np.full(1, self.t, np.float32) for a in self.agents}
            done = {a: self.t >= life[a] for a in self.agents}
            still = {a: False for a in self.agents}
            term, trunc = (done, still) if ends == "terminated" else (still, done)
            out = obs, {a: 1.0 for a in self.agents}, term, trunc, {a: {} for a in obs}
            self.agents = [a for a in self.agents if not done[a]]
            return out

    return Leaving


def test_an_agent_not_in_an_episode_counts_no_episode():
    """An agent of ``possible_agents`` the env does not spawn (a reserve): each end of an episode
    counted it a (return 0, length 0) episode (helper round 27 G01)."""
    env = ff.envs.make(_agents_leaving({"a": 3, "b": 3}, ["a", "b", "c"], ends="truncated"), num_envs=2, seed=0)
    env.reset()
    finished = []
    for _ in range(6):
        env.step(np.zeros((2, 3), np.int64))
        finished += env.step.events(None)[1]
    assert finished == [(3.0, 3)] * 8   # 2 envs x 2 episodes x the 2 agents that played


def test_an_agents_episode_is_counted_when_it_ends_not_when_the_last_agent_does():
    """Agents that leave at different steps: an agent's episode was counted only once the last
    agent of its environment was done, so a run that stopped before then, or the rows before it,
    left it out (helper round 29 O01)."""
    env = ff.envs.make(_agents_leaving({"a": 5, "b": 2, "c": 3}, ["a", "b", "c"]), num_envs=1, seed=0)
    env.reset()
    finished = []
    for _ in range(7):
        env.step(np.zeros((1, 3), np.int64))
        finished.append(env.step.events(None)[1])
    # b ends at step 2, c at 3, a at 5 with the environment; the next episode's b at 7 (= 5 + 2)
    assert finished == [[], [(2.0, 2)], [(3.0, 3)], [], [(5.0, 5)], [], [(2.0, 2)]]


def test_a_multiagent_reward_of_one_number_in_an_array_is_that_number():
    """An agent's reward np.array([1.0]) passed the step's check (one number) and failed storing it:
    'setting an array element with a sequence' in fragflow's code (numpy 2)."""
    base = _agents_leaving({"a": 3, "b": 2}, ["a", "b"])

    class ArrayRewards(base):   # type: ignore[valid-type, misc]
        def step(self, actions):
            obs, rewards, term, trunc, infos = super().step(actions)
            return obs, {a: np.array([r]) for a, r in rewards.items()}, term, trunc, infos

    env = ff.envs.make(ArrayRewards, num_envs=2, seed=0)
    env.reset()
    finished = []
    for _ in range(3):
        _, reward, _, _, _ = env.step(np.zeros((2, 2), np.int64))
        finished += env.step.events(None)[1]
    assert reward.tolist() == [[1.0, 0.0], [1.0, 0.0]] and sorted(finished) == [(2.0, 2)] * 2 + [(3.0, 3)] * 2


def test_an_agent_kept_among_the_envs_agents_after_its_episode_ended_is_refused_not_counted_again():
    """A parallel env that leaves an agent in ``self.agents`` once its episode ended: each later step
    counted another episode of it (lengths 2, 3, 4 for one episode of length 2), and an env keeping
    them all never reset."""
    class Kept(_agents_leaving({"a": 4, "b": 2}, ["a", "b"])):   # type: ignore[misc, valid-type]
        def step(self, actions):
            agents = list(self.agents)
            out = super().step(actions)
            self.agents = agents if self.agents else []   # b stays after its step 2; all leave with a
            return out

    env = ff.envs.make(Kept, num_envs=1, seed=0)
    env.reset()
    env.step(np.zeros((1, 2), np.int64))
    env.step(np.zeros((1, 2), np.int64))
    assert env.step.events(None)[1] == [(2.0, 2)]
    with pytest.raises(ConfigError, match=r"agent 'b' of environment 0 of Kept ended its episode \(terminated or "
                                          r"truncated\) at an earlier step but is still among the env's agents"
                                          r"(.|\n)*at .*test_env_families.py:\d+\n  fix: remove an agent from "
                                          r"self.agents at the step that ends its episode"):
        env.step(np.zeros((1, 2), np.int64))


@pytest.mark.parametrize("old", ["reset", "step"])
def test_a_parallel_env_of_pettingzoos_older_api_is_refused_at_its_method(old):
    """A reset returning the observations alone failed as a KeyError in fragflow's code; a step
    returning four values (dones, not terminations and truncations) unpacked as a ValueError there."""
    class Older(_agents_leaving({"a": 3, "b": 3}, ["a", "b"])):   # type: ignore[misc, valid-type]
        def reset(self, seed=None, options=None):
            obs, info = super().reset(seed, options)
            return obs if old == "reset" else (obs, info)

        def step(self, actions):
            obs, reward, term, trunc, info = super().step(actions)
            return (obs, reward, term, info) if old == "step" else (obs, reward, term, trunc, info)

    env = ff.envs.make(Older, num_envs=1, seed=0)
    message = {"reset": r"environment Older's reset returned a dict, where a parallel env's reset returns "
                        r"\(observations, infos\)",
               "step": r"environment Older's step returned 4 values \(obs, rewards, dones, infos: PettingZoo's older "
                       r"API\), where a parallel env's step returns 5 dicts"}[old]
    with pytest.raises(ConfigError, match=message + r"(.|\n)*at .*test_env_families.py:\d+\n  fix: "):
        env.reset()
        env.step(np.zeros((1, 2), np.int64))


def test_float_actions_a_discrete_agent_cannot_hold_are_refused_not_truncated():
    # 0.9 stepped every agent with action 0 (helper round 35 V)
    env = ff.envs.make("mpe2:simple_spread_v3", num_envs=2, seed=3, max_cycles=4)
    env.reset()
    with pytest.raises(ConfigError, match=r"env.step got actions of dtype float64 \(0.9 among them\) for an action "
                                          r"space of dtype int64 \(Discrete\(5\)\): casting would change them"
                                          r"(.|\n)*at .*test_env_families.py:\d+"):
        env.step(np.full((2, 3), 0.9))
    env.step(np.full((2, 3), 2.0))   # whole numbers: cast


def test_a_parallel_envs_observations_and_rewards_its_spaces_do_not_hold_are_refused_at_the_step():
    """Observations of another shape than the agent's space were batched as they came (or failed in
    numpy's stack where agents differed), and a None reward was a NaN reward and return."""
    class Misfit(_agents_leaving({"a": 3, "b": 3}, ["a", "b"])):   # type: ignore[misc, valid-type]
        def __init__(self, bad: str = "shape"):
            super().__init__()
            self.bad = bad

        def observation_space(self, agent):   # ("dtype": integer observations, given as float32 ones)
            return {"dtype": gym.spaces.Box(0, 100, (1,), np.int64), "wrap": gym.spaces.Box(-100, 100, (1,), np.int8)}.get(
                self.bad) or super().observation_space(agent)

        def reset(self, seed=None, options=None):
            obs, info = super().reset(seed, options)
            return ({a: np.zeros(1, np.int64) for a in obs} if self.bad == "wrap" else obs), info

        def step(self, actions):
            obs, reward, term, trunc, info = super().step(actions)
            if self.bad == "shape":
                obs = {a: np.zeros(2, np.float32) for a in obs}
            elif self.bad == "wrap":   # (int64 observations: 300 was stored as 44)
                obs = {a: np.array([300]) for a in obs}
            else:
                reward = {**reward, "b": None}
            return obs, reward, term, trunc, info

    for bad, message in (("shape", r"agent 'a' of environment 0 was given by the env's step an observation of shape "
                                   r"\(2,\) and dtype float32, but its observation space is Box\(-100.0, 100.0, \(1,\), "
                                   r"float32\): batching it would change its shape(.|\n)*at .*test_env_families.py"),
                         ("dtype", r"agent 'a' of environment 0 was given by the env's reset an observation of "
                                   r"shape \(1,\) and dtype float32, but its observation space is Box\(0, 100, \(1,\), "
                                   r"int64\): storing it would truncate or wrap its values"),
                         ("wrap", r"agent 'a' of environment 0 was given by the env's step an observation of shape "
                                  r"\(1,\) and dtype int64, but its observation space is Box\(-100, 100, \(1,\), int8\): "
                                  r"storing it would truncate or wrap its values"),
                         ("reward", r"environment Misfit's step returned None as the reward of agent 'b', where a "
                                    r"parallel env returns a dict of a number per agent(.|\n)*at .*test_env_families.py")):
        env = ff.envs.make(Misfit, num_envs=2, seed=0, bad=bad)
        with pytest.raises(ConfigError, match=message):
            env.reset()   # (where the dtype misfits: the reset's observations already)
            env.step(np.zeros((2, 2), np.int64))


def test_multiagent_actions_without_an_env_and_an_agent_axis_are_refused_at_the_call():
    """Alike agents: actions for an extra environment or extra agents were cut silently, and
    actions without the agent axis failed with an IndexError from fragflow's code (helper round 29 O02)."""
    env = ff.envs.make("mpe2:simple_spread_v3", num_envs=2, seed=3, max_cycles=4)
    env.reset()
    for bad in (np.zeros((3, 3), np.int64), np.zeros((2, 5), np.int64), np.zeros(2, np.int64)):
        with pytest.raises(ConfigError, match=rf"step got actions of shape {re.escape(str(list(bad.shape)))}(.|\n)*\[num_envs=2, "
                                              r"num_agents=3\]\n  at .*test_env_families.py:\d+\n  fix: give actions"):
            env.step(bad)
    env.step(np.zeros((2, 3), np.int64))


def test_unlike_agents_are_padded_to_one_space_with_a_mask_of_each_agents_actions():
    from mpe2 import simple_speaker_listener_v4

    env = ff.envs.make("mpe2:simple_speaker_listener_v4", num_envs=2, seed=5, max_cycles=25)
    assert env.agents == ["speaker_0", "listener_0"]                   # type: ignore[attr-defined]
    assert env.single_observation_space.shape == (11,) and env.single_action_space == gym.spaces.Discrete(5)
    assert env.action_mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]   # type: ignore[attr-defined]
    obs = env.reset()
    raw = simple_speaker_listener_v4.parallel_env(max_cycles=25)
    own, _ = raw.reset(seed=5)
    assert np.array_equal(obs[0, 0, :3], own["speaker_0"]) and not obs[:, 0, 3:].any()   # zero-padded
    assert np.array_equal(obs[0, 1], own["listener_0"])
    obs, reward, *_ = env.step(np.array([[2, 4], [0, 1]]))
    own, own_reward, *_ = raw.step({"speaker_0": 2, "listener_0": 4})
    assert np.array_equal(obs[0, 1], own["listener_0"]) and reward[0, 1] == np.float32(own_reward["listener_0"])
    with pytest.raises(ConfigError, match=r"'speaker_0' of environment 1 was given action 3, outside its Discrete\(3\)"
                                          r"(.|\n)*at .*test_env_families.py:\d+\n  fix: .*env.action_mask"):
        env.step(np.array([[2, 4], [3, 1]]))

    cont = ff.envs.make("mpe2:simple_speaker_listener_v4", num_envs=1, seed=5, continuous_actions=True)
    assert cont.single_action_space.shape == (5,)                      # speaker Box(3) and listener Box(5)
    assert cont.action_mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]   # type: ignore[attr-defined]
    cont.reset()
    cont.step(np.full((1, 2, 5), 0.5, np.float32))                     # the speaker's two extra entries are dropped


def test_a_multiagent_env_renders_each_environment():
    env = ff.envs.make("mpe2:simple_tag_v3", num_envs=2, seed=0, max_cycles=5, render_mode="rgb_array")
    env.reset()
    frames = env.render()
    assert len(frames) == 2 and frames[0].ndim == 3 and frames[0].dtype == np.uint8
    env.close()


def test_agents_whose_spaces_cannot_be_padded_are_refused_with_the_fix():
    class Mixed:   # a parallel env's space interface: one agent acts with a Box, the other with Discrete
        possible_agents = ["a", "b"]

        def observation_space(self, agent):
            return gym.spaces.Box(-1, 1, (3,))

        def action_space(self, agent):
            return gym.spaces.Discrete(2) if agent == "a" else gym.spaces.Box(-1, 1, (2,))

        def close(self):
            closed.append(self)

    closed: list = []

    with pytest.raises(UnknownEnvError, match="spaces that fragflow cannot batch") as err:
        ff.envs.make(Mixed, num_envs=2)
    assert "a: Box" in err.value.what and "flatten" in err.value.fix
    assert len(closed) == 2                                             # the envs made before the refusal are closed

    class Masked(Mixed):   # alike agents, a Dict observation holding the action mask (PettingZoo's convention)
        def observation_space(self, agent):
            return gym.spaces.Dict({"observation": gym.spaces.Box(-1, 1, (3,)), "action_mask": gym.spaces.MultiBinary(2)})

        def action_space(self, agent):
            return gym.spaces.Discrete(2)

    # it was an object array of dicts, then an internal TypeError once an agent left (helper round 31 U1)
    with pytest.raises(UnknownEnvError, match="spaces that fragflow cannot batch") as err:
        ff.envs.make(Masked, num_envs=1, seed=0)
    assert "obs['observation']" in err.value.fix


def test_a_keyword_a_pettingzoo_env_does_not_take_is_refused_at_the_make_line():
    # PettingZoo's TypeError came through with its frames (helper round 31 U2)
    with pytest.raises(UnknownEnvError, match=r"does not take the keyword arguments given to ff.envs.make \(max_cycle\)"
                                              r"(.|\n)*at .*test_env_families.py:\d+") as err:
        ff.envs.make("mpe2:simple_spread_v3", num_envs=1, seed=0, max_cycle=25)
    assert err.value.fix is not None


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


def test_mappo_with_unlike_agents_takes_only_each_agents_actions_under_every_policy():
    from fragflow.algorithms import mappo

    args = mappo.Args(env_id="mpe2:simple_speaker_listener_v4", total_timesteps=400, num_envs=4, num_steps=25,
                      update_epochs=1)
    expected = ff.run(mappo.train, args, policy="single_process")     # an action outside the speaker's 3 would raise
    assert expected.summary["episodes"] == 400 // 25 * 2
    assert expected.value["model"].action_mask[0].tolist() == [True, True, True, False, False]
    split = ff.run(mappo.train, args, policy="actor_learner(actors=2)")
    assert split.summary["episodes"] == 32 and shm_leftovers() == []
    again = ff.run(mappo.train, args, policy="pipelined(max_lag=0)")
    assert same_tree(again.value["model"].state_dict(), expected.value["model"].state_dict())


@pytest.mark.parametrize("space", [gym.spaces.Box(-1, 1, (2, 3), np.float32), gym.spaces.Discrete(4)])
def test_mappo_takes_agents_observations_of_any_shape(space):
    """Observations of more axes than one (butterfly's knights_archers_zombies: [27, 5]) or none (a
    Discrete space, classic's rps) failed in the actor's torch.cat of the agents' ids."""
    from fragflow.algorithms import mappo

    class Shaped(_agents_leaving({"a": 4, "b": 2}, ["a", "b"])):   # type: ignore[misc, valid-type]
        def __init__(self, max_cycles: int = 25) -> None:
            super().__init__()

        def observation_space(self, agent):
            return space

        def reset(self, seed=None, options=None):
            _, info = super().reset(seed, options)
            return {a: space.sample() for a in self.agents}, info

        def step(self, actions):
            obs, *rest = super().step(actions)
            return ({a: space.sample() for a in obs}, *rest)

    args = mappo.Args(env_id=Shaped, total_timesteps=32, num_envs=2, num_steps=8, update_epochs=1)  # type: ignore[arg-type]
    state = mappo.train(args)
    assert state["model"].pi[0].in_features == int(np.prod(space.shape or (1,))) + 2   # (flat, and the agent's id)


def test_mappo_critic_sees_every_agent_and_ippo_only_its_own():
    import torch

    from fragflow.algorithms import mappo

    central, own = mappo.Agents(4, 3, 5, 8, central=True), mappo.Agents(4, 3, 5, 8, central=False)
    obs = torch.zeros(2, 3, 4)
    base_c, base_o = central.value(obs), own.value(obs)
    obs[:, 2] = 1.0                                                     # only agent 2's observation changes
    assert not torch.allclose(central.value(obs)[:, 0], base_c[:, 0])   # agent 0's central critic sees it
    assert torch.equal(own.value(obs)[:, 0], base_o[:, 0])              # its independent critic does not


def test_mappo_learns_only_from_the_agents_still_in_their_episode(monkeypatch):
    """MAPPO's active masks: an agent that left its episode while another plays on gives zero
    observations there, and the env ignores its actions; those agent-steps were samples of the
    policy and value losses, each with an advantage of -V (helper round 32 X2)."""
    import copy

    import torch

    from fragflow.algorithms import mappo

    class Leaving(_agents_leaving({"a": 5, "b": 2}, ["a", "b"])):   # type: ignore[misc, valid-type]
        def __init__(self, max_cycles: int = 25) -> None:   # (mappo passes its episode length)
            super().__init__()

    batches, learn = [], mappo.learn.fn

    def spy(state, batch, lr, args):
        batches.append(batch)
        return learn(state, batch, lr, args)

    monkeypatch.setattr(mappo, "learn", ff.fragment("learner", writes="state", name="learn")(spy))
    args = mappo.Args(env_id=Leaving, total_timesteps=20, num_envs=1, num_steps=10, update_epochs=1)  # type: ignore[arg-type]
    mappo.train(args)
    # b plays steps 0 and 1 of each 5-step episode, a all five
    assert batches[0]["active"][:, 0].tolist() == [[True, True]] * 2 + [[True, False]] * 3 + \
        [[True, True]] * 2 + [[True, False]] * 3

    # what an agent that left did there changes nothing the learner does
    torch.manual_seed(0)
    model = mappo.Agents(1, 2, 2, 8, central=True, value_norm=True)
    batch = batches[0]
    gone = ~batch["active"]
    other = {**batch, "action": np.where(gone, 1 - batch["action"], batch["action"]),
             "logprob": np.where(gone, batch["logprob"] - 3.0, batch["logprob"]),
             "value": np.where(gone, batch["value"] + 5.0, batch["value"])}
    after = []
    for b in (batch, other):
        net = copy.deepcopy(model)
        state = {"model": net, "optimizer": torch.optim.Adam(net.parameters(), lr=1e-2),
                 "key": ff.random.keys(0, np.array([mappo.LEARNER_KEY_ID]))}
        after.append(learn(state, b, 1e-2, args)[0]["model"].state_dict())
    assert gone.any() and same_tree(after[0], after[1])

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
    for option in ({"frameskip": 4}, {"wrappers": []}):   # (Python's "multiple values for keyword": round 27 G06)
        with pytest.raises(ConfigError, match=rf"ff.envs.atari was given {next(iter(option))}=(.|\n)*test_env_families.py"):
            ff.envs.atari("ALE/Pong-v5", num_envs=1, seed=0, **option)


def test_atari_refuses_what_is_not_an_atari_games_id_for_what_it_is():
    """CartPole was refused as "does not take the keyword arguments given to ff.envs.make (frameskip)" and
    a PettingZoo env as "ff.envs.make does not apply clip_rewards, wrappers": options the user never
    gave; a function making the game failed in fragflow's code ("argument of type 'function' is not
    iterable")."""
    for env_id in ("CartPole-v1", "mpe2:simple_spread_v3"):
        with pytest.raises(ConfigError, match=rf"ff.envs.atari makes Atari games \(ale-py's\), with their "
                                              rf"preprocessing, and '{env_id}' is not one") as info:
            ff.envs.atari(env_id, num_envs=1, seed=0)
        assert (info.value.fix or "").startswith(f"make it with ff.envs.make('{env_id}', num_envs, seed)")
        assert info.value.where is not None and info.value.where.file.endswith("test_env_families.py")
    with pytest.raises(ConfigError, match=r"ff.envs.atari got <lambda>, where it takes an Atari game's id") as info:
        ff.envs.atari(lambda: gym.make("ALE/Pong-v5"), num_envs=1, seed=0)   # type: ignore[arg-type]
    assert info.value.where is not None and info.value.where.file.endswith("test_env_families.py")
    for game in ("ALE/Pong-v5", "ale_py:ALE/Pong-v5", "PongNoFrameskip-v4"):   # (each of ale-py's kinds of id runs)
        env = ff.envs.atari(game, num_envs=1, seed=0)
        assert env.reset().shape == (1, 4, 84, 84)
        env.close()


def test_atari_preprocessing_refuses_the_ram_observations_it_cannot_process():
    # gymnasium's preprocessing failed at the first reset, in its own code ("Expected a numpy array with two dimensions")
    with pytest.raises(ConfigError, match=r"ff.envs.atari was given obs_type='ram': its preprocessing works on the "
                                          r"screen(.|\n)*test_env_families.py:\d+\n  fix: make the env with "
                                          r"ff.envs.make\('ALE/Pong-v5', num_envs, seed, obs_type='ram'\)"):
        ff.envs.atari("ALE/Pong-v5", num_envs=1, seed=0, obs_type="ram")
    env = ff.envs.make("ALE/Pong-v5", num_envs=1, seed=0, obs_type="ram")
    assert env.reset().shape == (1, 128)
    env.close()


def test_a_mistyped_pettingzoo_env_and_gymnasiums_episode_limit_are_refused_with_what_the_package_takes():
    # the typo was matched against gymnasium's ids; max_episode_steps= got the constructor's TypeError alone
    with pytest.raises(UnknownEnvError, match=r"unknown environment id 'mpe2:simple_tagg_v3': mpe2 has no environment "
                                              r"'simple_tagg_v3'") as info:
        ff.envs.make("mpe2:simple_tagg_v3", num_envs=1, seed=0)
    assert (info.value.fix or "").startswith("did you mean 'mpe2:simple_tag_v3'")
    with pytest.raises(UnknownEnvError, match=r"does not take the keyword arguments given to ff.envs.make "
                                              r"\(max_episode_steps\)") as info:
        ff.envs.make("mpe2:simple_tag_v3", num_envs=1, seed=0, max_episode_steps=10)
    assert "max_cycles=" in (info.value.fix or "")


def test_the_atari_ids_cleanrl_uses_are_found_before_ale_py_is_imported():
    """'BreakoutNoFrameskip-v4' (CleanRL's and SB3's id) was an unknown id unless ale_py had been
    imported already: only ALE/ ids imported it. (A fresh process: this one has imported it.)"""
    import subprocess
    import sys

    code = ("import sys, fragflow as ff\nassert 'ale_py' not in sys.modules\n"
            "env = ff.envs.atari('BreakoutNoFrameskip-v4', num_envs=1, seed=0)\nprint(env.reset().shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(1, 4, 84, 84)" in out.stdout


def test_a_missing_family_names_its_extra():
    with pytest.raises(UnknownEnvError) as err:
        ff.envs.make("nosuchfamily:Thing-v0")
    assert "pip install" in err.value.fix


def test_options_make_does_not_apply_to_a_pettingzoo_env_are_refused_not_ignored():
    with pytest.raises(UnknownEnvError, match=r"ff.envs.make does not apply normalize_obs, wrappers to a PettingZoo "
                                              r"environment"):
        ff.envs.make("mpe2:simple_spread_v3", num_envs=1, max_cycles=4, normalize_obs=True, wrappers=[lambda e: e])


def test_a_pettingzoo_id_of_an_aec_env_or_of_an_env_whose_package_is_missing_is_refused_with_the_cause(
        tmp_path, monkeypatch):
    """Both were 'pettingzoo.classic has no environment 'tictactoe_v3'', fixed with 'did you mean
    'pettingzoo.classic:tictactoe_v3''; the AEC env's module given itself was 'got module ...'."""
    from pettingzoo.classic import tictactoe_v3

    for env_id in ("pettingzoo.classic:tictactoe_v3", tictactoe_v3):
        with pytest.raises(UnknownEnvError, match=r"PettingZoo AEC environment, whose agents act one at a time") as info:
            ff.envs.make(env_id, num_envs=2, seed=0)
        assert "aec_to_parallel" in (info.value.fix or "")
        assert info.value.where is not None and info.value.where.file.endswith("test_env_families.py")
    family = tmp_path / "myfamily"
    family.mkdir()
    (family / "__init__.py").write_text("")
    (family / "board_v1.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownEnvError, match=r"environment 'myfamily:board_v1' needs the package "
                                              r"'not_installed_dependency_xyz', which is not installed") as info:
        ff.envs.make("myfamily:board_v1", num_envs=2, seed=0)
    assert (info.value.fix or "").startswith("pip install not_installed_dependency_xyz")
    with pytest.raises(UnknownEnvError, match=r"myfamily has no environment 'board_v2'"):   # (a typo: still one)
        ff.envs.make("myfamily:board_v2", num_envs=2, seed=0)


@pytest.mark.parametrize("typo, meant", [("ALE/Breakot-v5", "ALE/Breakout-v5"), ("ALE/pong-v5", "ALE/Pong-v5")])
def test_a_typo_in_an_atari_id_is_answered_with_the_id_meant_not_an_install(typo, meant):
    """With ale-py installed, 'ALE/Breakot-v5' was answered 'pip install "fragflow[atari]"'."""
    with pytest.raises(UnknownEnvError, match=f"unknown environment id '{typo}'") as err:
        ff.envs.make(typo, num_envs=1, seed=0)
    assert (err.value.fix or "").startswith(f"did you mean '{meant}'"), err.value.fix
