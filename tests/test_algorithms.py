"""The algorithm set under the policies that apply to it: the same result as the sequential run
wherever the policy promises it (small networks and budgets: these check the plumbing; the
benchmarks check the learning)."""

from __future__ import annotations

import csv

import pytest
import torch

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


@pytest.mark.parametrize("policy", ["actor_learner(actors=1, max_lag=0)", "pipelined"])
def test_sac_writes_one_metrics_row_per_update_with_both_learners_metrics(tmp_path, policy):
    """learn_actor's metrics (every other step) join learn_q's row of the same update, as under
    single_process, though the actor's steps reach the driver between the two."""
    def rows(run_policy: str, out: str) -> list[dict[str, str]]:
        ff.run(sac.train, sac.Args(**SAC_SMALL), policy=run_policy, out=tmp_path / out)
        with open(tmp_path / out / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))

    one, other = rows("single_process", "one"), rows(policy, "other")
    learner = [k for k in one[0] if "loss" in k or k in ("alpha", "updates")]
    assert {"updates", "qf_loss", "actor_loss"} <= set(learner), learner
    assert [float(r["updates"]) for r in other] == list(range(1, len(other) + 1))
    exact = policy.endswith("max_lag=0)")   # the same losses, bit for bit; pipelined learns a version behind
    assert len(other) == len(one) == 199
    for a, b in zip(one, other):
        assert (a["actor_loss"] == "") == (b["actor_loss"] == ""), (a, b)
        if exact:
            assert {k: a[k] for k in learner} == {k: b[k] for k in learner}


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


A2C_SMALL = dict(total_timesteps=4000, num_envs=4, hidden=16)


def test_a2c_advantages_bootstrap_truncated_episodes_and_not_terminated_ones():
    from fragflow.algorithms import a2c

    one, zero = torch.ones(3, 1), torch.zeros(3, 1)
    value = torch.full((3, 1), 0.5)
    # next_value[t] is the value of step t's true next observation: value[t + 1] within an episode,
    # that of the final observation (7.0) where step 1 ends an episode, 2.0 after the rollout
    next_value = torch.tensor([[0.5], [7.0], [2.0]])
    cont = torch.tensor([[0.5], [0.5], [2.0]])
    adv = a2c.advantages(one, value, cont, zero, zero, gamma=0.9, lam=1.0)   # no end: n-step returns
    assert torch.allclose(adv[:, 0] + 0.5, torch.tensor([1 + 0.9 + 0.81 + 0.729 * 2.0, 1 + 0.9 + 0.81 * 2.0, 1 + 0.9 * 2.0]))
    end = torch.tensor([[0.0], [1.0], [0.0]])
    adv = a2c.advantages(one, value, next_value, end, end, gamma=0.9, lam=1.0)    # terminated: no bootstrap
    assert torch.allclose(adv[:, 0] + 0.5, torch.tensor([1 + 0.9 * 1.0, 1.0, 1 + 0.9 * 2.0]))
    adv = a2c.advantages(one, value, next_value, zero, end, gamma=0.9, lam=1.0)   # truncated: from final_obs
    assert torch.allclose(adv[:, 0] + 0.5, torch.tensor([1 + 0.9 * (1 + 0.9 * 7.0), 1 + 0.9 * 7.0, 1 + 0.9 * 2.0]))


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "async_relaxed(actors=1, max_lag=0)",
                                    "actor_learner(actors=2, max_lag=0)"])
def test_a2c_reproduces_single_process(policy):
    from fragflow.algorithms import a2c

    expected = ff.run(a2c.train, a2c.Args(**A2C_SMALL), policy="single_process")
    result = ff.run(a2c.train, a2c.Args(**A2C_SMALL), policy=policy)
    assert same_tree(result.value, expected.value), policy
    assert sorted(result.episode_returns) == sorted(expected.episode_returns)
    assert result.summary["updates"] == 4000 // 20


def test_a2c_under_async_relaxed_acts_with_stale_parameters():
    from fragflow.algorithms import a2c

    result = ff.run(a2c.train, a2c.Args(**A2C_SMALL), policy="async_relaxed(actors=2, max_lag=2)")
    channel = result.summary["channels"]["trajectory"]
    assert result.summary["updates"] + channel["drops"] // 2 == 4000 // 20
    assert max(i for i, n in enumerate(channel["lag_histogram"]) if n) <= 2


def _rollout(T: int, N: int, seed: int, ends: bool):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, N, generator=g)
    value, next_value = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    next_value[:-1] = value[1:]                               # within a rollout: the next step's value
    term = (torch.rand(T, N, generator=g) < 0.2).float() if ends else torch.zeros(T, N)
    behaviour, target = -torch.rand(T, N, generator=g) * 2, -torch.rand(T, N, generator=g) * 2
    return r, value, next_value, term, behaviour, target


def test_vtrace_is_n_step_returns_when_the_behaviour_policy_is_the_target_policy():
    from fragflow.algorithms import a2c, impala

    r, value, next_value, term, behaviour, _ = _rollout(12, 3, seed=0, ends=True)
    vs, adv = impala.vtrace(behaviour, behaviour, r, value, next_value, term, term, gamma=0.97)
    returns = a2c.advantages(r, value, next_value, term, term, gamma=0.97, lam=1.0) + value
    assert torch.allclose(vs, returns, atol=1e-5)
    next_vs = torch.cat([vs[1:], next_value[-1:]])            # the advantage bootstraps from the next target
    assert torch.allclose(adv, r + 0.97 * (1 - term) * next_vs - value, atol=1e-5)


RLAX_REFERENCE = """
import sys
import numpy as np
import jax.numpy as jnp
import rlax   # the reference; the dev extra that make test installs brings it
d = np.load(sys.argv[1])
out = {}
for n in range(d["r"].shape[1]):
    ref = rlax.vtrace_td_error_and_advantage(*(jnp.asarray(d[k][:, n]) for k in ("v", "next_v", "r", "discount", "rho")))
    out[f"vs{n}"] = np.asarray(ref.errors) + d["v"][:, n]
    out[f"adv{n}"] = np.asarray(ref.pg_advantage)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_vtrace_matches_rlax_on_random_off_policy_rollouts(seed, tmp_path):
    """rlax runs in a process of its own: JAX's threads in the test process would make every later
    forked worker risk a deadlock."""
    import subprocess
    import sys

    import numpy as np

    from fragflow.algorithms import impala

    T, N, gamma = 16, 4, 0.95
    r, value, next_value, term, behaviour, target = _rollout(T, N, seed=seed, ends=True)
    vs, adv = impala.vtrace(behaviour, target, r, value, next_value, term, term, gamma=gamma, rho_bar=1.0, c_bar=1.0)
    np.savez(tmp_path / "in.npz", v=value.numpy(), next_v=next_value.numpy(), r=r.numpy(),
             discount=(gamma * (1 - term)).numpy(), rho=torch.exp(target - behaviour).numpy())
    subprocess.run([sys.executable, "-c", RLAX_REFERENCE, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True)
    ref = np.load(tmp_path / "out.npz")
    for n in range(N):
        np.testing.assert_allclose(vs[:, n].numpy(), ref[f"vs{n}"], atol=1e-5)
        np.testing.assert_allclose(adv[:, n].numpy(), ref[f"adv{n}"], atol=1e-5)


IMPALA_SMALL = dict(total_timesteps=4800, num_envs=4, num_steps=20, hidden=16)


def test_impala_reproduces_single_process_without_lag_and_logs_the_lag_it_corrects(tmp_path):
    from fragflow.algorithms import impala

    expected = ff.run(impala.train, impala.Args(**IMPALA_SMALL), policy="single_process")
    result = ff.run(impala.train, impala.Args(**IMPALA_SMALL), policy="async_relaxed(actors=1, max_lag=0)")
    assert same_tree(result.value, expected.value)
    stale = ff.run(impala.train, impala.Args(**IMPALA_SMALL), policy="async_relaxed(actors=2, max_lag=3)",
                   out=tmp_path / "run")
    hist = stale.summary["channels"]["trajectory"]["lag_histogram"]
    assert sum(hist[1:]) > 0 and not any(hist[4:])            # acted with stale parameters, within the bound
    lags = [float(row["lag_mean"]) for row in csv.DictReader(open(stale.out / "metrics.csv")) if row.get("lag_mean")]
    assert lags and max(lags) > 0 and max(lags) <= 3


def test_ppo_with_its_rollout_buffer_beside_the_learner_reproduces_single_process():
    """learner_replay moves the rollout buffer to the learner: ``collect(next_obs=obs)`` passes the
    last observation through, and the loop hands ``learn`` the whole batch, resolved there."""
    from fragflow.algorithms import ppo

    args = ppo.Args(total_timesteps=1024, num_envs=2, num_steps=64)
    expected = ff.run(ppo.train, args, policy="single_process")
    result = ff.run(ppo.train, args, policy="learner_replay(max_lag=0)")
    assert same_tree(result.value, expected.value)
    assert result.summary["updates"] == 8


def test_ppo_takes_a_module_prefixed_continuous_env_id_as_continuous(tmp_path, monkeypatch):
    """A "module:Env-v0" id (the module registers the env when imported, as gymnasium allows) gets
    the continuous settings the plain id gets (action clipping, observation and reward
    normalisation); the registry alone does not know it before the import."""
    from fragflow.algorithms import ppo

    (tmp_path / "my_pendulum_envs.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('MyPendulum-v0', entry_point='gymnasium.envs.classic_control:PendulumEnv', max_episode_steps=200)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ppo.is_continuous("Pendulum-v1") and not ppo.is_continuous("CartPole-v1")
    assert ppo.is_continuous("my_pendulum_envs:MyPendulum-v0")
    assert not ppo.is_continuous("NoSuchEnv-v0") and not ppo.is_continuous("no_such_module:X-v0")


def test_dqn_anneals_prioritized_replays_importance_sampling_exponent_to_one(monkeypatch):
    """Schaul et al. anneal beta linearly from 0.4 to 1 over the run; it stayed at 0.4."""
    from fragflow.algorithms import dqn

    betas = []
    sample = ff.ReplayBuffer._sample

    def spy(self, batch_size, beta=None):
        betas.append(beta)
        return sample(self, batch_size, beta)

    monkeypatch.setattr(ff.ReplayBuffer, "_sample", spy)
    args = dqn.Args(total_timesteps=2_000, learning_starts=100, train_frequency=10, prioritized=True)
    dqn.train(args)
    assert betas[0] == pytest.approx(0.4 + 0.6 * 110 / 2_000) and betas[-1] == pytest.approx(0.4 + 0.6 * 1_990 / 2_000)
    assert betas == sorted(betas)


@pytest.mark.parametrize("name, env_id, message", [
    ("dqn", "MountainCarContinuous-v0", r"dqn.py learns Q-values of Discrete actions from vector observations"),
    ("a2c", "FrozenLake-v1", r"a2c.py's policy chooses among Discrete actions from vector observations"),
    ("impala", "Blackjack-v1", r"impala.py's policy chooses among Discrete actions"),
    ("sac", "Acrobot-v1", r"sac.py's policy acts in a continuous \(Box\) action space"),
    ("ppo", "Blackjack-v1", r"ppo.py acts on vector observations \(a Box of one axis\)"),
])
def test_an_algorithm_given_an_env_its_networks_cannot_take_says_what_it_takes(name, env_id, message):
    """DQN on a continuous env failed with "'Box' object has no attribute 'n'", SAC on a discrete one
    with "'Discrete' object has no attribute 'low'", PPO and A2C on Discrete or Tuple observations inside
    the actor's matrix product or in int(None)."""
    import importlib

    module = importlib.import_module(f"fragflow.algorithms.{name}")
    with pytest.raises(ValueError, match=message + rf"(.|\n)*{env_id} has .* observations and .* actions"):
        module.train(module.Args(env_id=env_id, total_timesteps=64))


@pytest.mark.parametrize("name", ["ppo", "a2c", "impala", "dqn", "sac"])
def test_an_algorithm_of_one_agent_given_a_pettingzoo_env_says_so_and_names_mappo(name):
    """A PettingZoo env's spaces are each agent's, so the check above let PPO, A2C and IMPALA go on, to fail
    in the actor on the agent axis ("The size of tensor a (3) must match the size of tensor b (2)",
    "operands could not be broadcast together"); DQN failed at env.step, naming the agent axis."""
    import importlib

    module = importlib.import_module(f"fragflow.algorithms.{name}")
    with pytest.raises(ValueError, match=r"mpe2:simple_spread_v3 has Box\(.*\) observations and Discrete\(5\) actions "
                                         r"for each of its 3 agents, a PettingZoo env's \(mappo.py acts for every agent\)"):
        module.train(module.Args(env_id="mpe2:simple_spread_v3", total_timesteps=64))
