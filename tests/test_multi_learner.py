"""multi_learner: K learners on K shards of the batch make the update one learner makes on all of it."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

import fragflow as ff
from fragflow.errors import ConfigError
from fragflow.program import load
from tests.test_multiprocess import shm_leftovers

# A regression learner whose loss is a mean over samples: each env draws its own inputs from its
# key, so actor j's share of the batch is the same data the single learner sees in those columns.
PROGRAM = '''
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff


@dataclass(frozen=True)
class Args:
    num_envs: int = 4
    num_updates: int = 6
    steps: int = 8
    functional: bool = False     # torch.autograd.grad and a hand-written step, else backward() + torch.optim
    own_optimizer: bool = False  # an optimizer the learner makes at each call (plain SGD keeps no state)
    seed: int = 0


@ff.fragment("env")
def observe(key):
    x = ff.random.normal(key, (3,)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]


@ff.fragment("learner", writes="state")
def learn(state, xs, ys, args: Args):
    net = state["net"]
    opt = torch.optim.SGD(net.parameters(), lr=0.05) if args.own_optimizer else state["opt"]
    x, y = torch.as_tensor(np.stack(xs)).reshape(-1, 3), torch.as_tensor(np.stack(ys)).reshape(-1, 1)
    for _ in range(2):                                   # two gradient steps per update
        loss = ((net(x) - y) ** 2).mean()
        if args.functional:
            grads = torch.autograd.grad(loss, list(net.parameters()))
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads):
                    p -= 0.05 * g
        else:
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)   # on the averaged gradient
            opt.step()
    return state, {"loss": loss.detach()}


def train(args: Args):
    torch.manual_seed(args.seed)
    net = torch.nn.Linear(3, 1)
    state = ff.versioned({"net": net} if args.own_optimizer else
                         {"net": net, "opt": torch.optim.Adam(net.parameters(), lr=0.05)})
    key = ff.random.keys(args.seed, ff.envs.ids(args.num_envs))
    for update in range(args.num_updates):
        xs, ys = [], []
        for t in range(args.steps):
            key, sub = ff.random.split(key)
            x, y = observe(sub)
            xs.append(x)
            ys.append(y)
        state, metrics = learn(state, xs, ys, args)   # lists of [env, ...] arrays: the env axis is known
        ff.log(metrics)
    return state
'''


def _initial(args):
    torch.manual_seed(args.seed)
    return torch.nn.Linear(3, 1)


@pytest.fixture
def program(write_algo):
    path, _ = write_algo(PROGRAM, "regress.py")
    return load(str(path))


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_two_learners_on_two_shards_equal_one_learner_on_the_whole_batch(program, functional, via, monkeypatch):
    from fragflow.backends.local import sharedsum

    if via == "gloo":   # (the learners' sums go through shared memory on x86-64, else gloo)
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    elif not sharedsum.available():
        pytest.skip("the shared-memory sum runs on x86-64 only")
    args = program.args_cls(functional=functional)
    one = ff.run(program.train, args, policy="single_process")
    two = ff.run(program.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    a, b = one.value["net"], two.value["net"]
    assert not torch.equal(a.weight, _initial(args).weight)   # (it learned: not the program's own first weights)
    for p, q in zip(a.parameters(), b.parameters()):
        # equal up to the order of float sums (each learner's mean, then the mean of the two)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert two.summary["updates"] == 6 and two.summary["env_steps"] == one.summary["env_steps"]
    # where each learner's update time went: its calls, its all-reduces (each update: one per
    # gradient step, two, and one closing it), its threads
    learners = two.summary["channels"]["trajectory"]["learners"]
    assert [t["learner"] for t in learners] == [0, 1]
    for t in learners:
        assert t["updates"] == 6 and t["all_reduces"] == 3 * 6 and t["threads"] >= 1 and t["via"] == via
        assert 0 < t["sync_s"] < t["busy_s"] and 0 < t["call_s"] < t["busy_s"]
    assert "learners" not in one.summary.get("channels", {}).get("trajectory", {})
    assert mp.active_children() == [] and shm_leftovers() == []


def test_two_learners_stepping_an_optimizer_the_learner_makes_equal_one_learner(program):
    """An optimizer the learner makes itself over the state's module (the state holds none): its
    gradients are averaged as those of one in the state; the learner was refused as one that
    'computed none (no backward() into a torch.optim optimizer's parameters' (helper round 35)."""
    args = program.args_cls(own_optimizer=True)
    one = ff.run(program.train, args, policy="single_process")
    two = ff.run(program.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    a, b = one.value["net"], two.value["net"]
    assert not torch.equal(a.weight, _initial(args).weight)   # (it learned: not the program's own first weights)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert two.summary["updates"] == 6
    assert mp.active_children() == [] and shm_leftovers() == []


def test_multi_learner_runs_ppo_and_refuses_indivisible_actors(program):
    from fragflow.algorithms import ppo

    result = ff.run(ppo.train, ppo.Args(total_timesteps=8 * 256, num_envs=4, num_steps=64),
                    policy="multi_learner(learners=2, actors=1)")
    assert result.summary["updates"] == 8 and result.summary["env_steps"] == 8 * 256
    assert np.isfinite(result.summary["final_return_mean"] or 0.0)
    from fragflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"splits the loop's 4 environments across 3 processes \(learners=3 x actors=1\): they do not divide evenly"):
        ff.run(program.train, program.args_cls(), policy="multi_learner(learners=3, actors=1)")


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_learner_that_computes_no_torch_gradient_is_refused(write_algo, library):
    """A numpy (or jax) learner is refused at placement, at its definition; a torch learner that
    takes no gradient when it runs is refused at its first update."""
    path, marks = write_algo('''
        from dataclasses import dataclass
        import numpy as np
        import torch
        import fragflow as ff

        @dataclass(frozen=True)
        class Args:
            num_envs: int = 2
            library: str = "numpy"

        @ff.fragment("env")
        def observe(key):
            return ff.random.uniform(key, (2,))

        @ff.fragment("learner", writes="state")
        def learn(state, x):                             # @learn
            return {"w": state["w"] * 0.9 + x.mean()}   # no gradient to average

        def train(args: Args):
            w = np.zeros(2) if args.library == "numpy" else torch.zeros(2)
            state = ff.versioned({"w": w})
            key = ff.random.keys(0, ff.envs.ids(args.num_envs))
            for update in range(4):
                key, sub = ff.random.split(key)
                x = observe(sub)
                state = learn(state, x if args.library == "numpy" else torch.as_tensor(x))   # the same memory
            return state
    ''', "numpy_learner.py")
    prog = load(str(path))
    from fragflow.errors import ConfigError, PlacementError

    if library == "numpy":
        with pytest.raises(PlacementError, match=rf"learner 'learn' computes with numpy\n  at {path}:{marks['learn'] - 1}"):
            ff.run(prog.train, prog.args_cls(library=library), policy="multi_learner(learners=2, actors=1)")
    else:
        with pytest.raises(ConfigError, match=rf"averages the gradients 'learn' computes, and it computed none(.|\n)*"
                                              rf"\n  at {path}:{marks['learn'] - 1}"):   # (no line: round 27 I09)
            ff.run(prog.train, prog.args_cls(library=library), policy="multi_learner(learners=2, actors=1)")
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_torch_learner_returning_numpy_is_a_torch_learner(write_algo):
    """A torch learner (its state a module and an optimizer) returning its metrics as numpy was
    refused as one that 'computes with numpy' (helper round 27 H02)."""
    path, _ = write_algo(LOOP_LOGS.replace('{"loss": loss.detach()}', '{"loss": loss.detach().numpy()}'))
    prog = load(str(path))
    result = ff.run(prog.train, prog.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert result.summary["updates"] == 5
    assert mp.active_children() == [] and shm_leftovers() == []


LOOP_LOGS = '''
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff


@dataclass(frozen=True)
class Args:
    updates: int = 5


@ff.fragment("actor")
def act(net, obs):
    with torch.no_grad():
        return net(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()


@ff.fragment("learner", writes="state")
def learn(state, roll):
    net, opt = state["net"], state["opt"]
    loss = net(torch.as_tensor(roll["obs"], dtype=torch.float32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return state, {"loss": loss.detach()}


def train(args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for u in range(args.updates):
        for _ in range(4):
            obs, *_ = env.step(act(state["net"], obs))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
        ff.log({"trip": u})
    return state
'''


def test_multi_learner_rows_count_what_the_loops_had_made_at_each_update(write_algo, tmp_path):
    """Each update takes one call of every loop replica: its row has the steps, episodes and loop
    values single_process's has (they were counted as they arrived: the loop's values a row early,
    two extra rows, the last value lost). The learner's metrics are learner 0's, on its share."""
    from tests.test_multiprocess import unclocked_rows

    path, _ = write_algo(LOOP_LOGS, "loop_logs.py")
    program = load(str(path))
    rows = []
    for run, pol in (("one", "single_process"), ("other", "multi_learner(learners=2, actors=1, max_lag=0)")):
        ff.run(program.train, program.args_cls(), policy=pol, out=tmp_path / run)
        rows.append([{k: v for k, v in r.items() if k != "loss"} for r in unclocked_rows(tmp_path / run)])
    assert [r["trip"] for r in rows[0]] == ["0.0", "1.0", "2.0", "3.0", "4.0"] and rows[1] == rows[0]


def test_an_element_past_learner_0s_share_that_the_loop_logs_is_said_missing_for_that_reason(write_algo, tmp_path):
    """ff.log({"late": m["td"][15]}) of a per-sample output of 16 rows: learner 0 reports its share's
    8, and the warning said the call "did not return" a key its traced calls returned, with a fix
    (return every metric from the first call) that cannot help. It says why: the learners' shares."""
    import csv

    from fragflow import driver

    path, _ = write_algo("""
        import numpy as np
        import torch
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            obs = torch.as_tensor(batch["obs"], dtype=torch.float32).reshape(-1, 4)
            loss = (state["net"](obs) ** 2).mean()
            state["opt"].zero_grad()
            loss.backward()
            state["opt"].step()
            return state, {"loss": loss.detach(), "td": state["net"](obs).detach()[:, 0]}

        def train():
            torch.manual_seed(0)
            env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
            net = torch.nn.Linear(4, 1)
            state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.01)})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for u in range(3):
                for _ in range(4):
                    obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
                    buf.add(obs=obs)
                state, m = learn(state, buf.collect())
                ff.log({"first": m["td"][0], "late": m["td"][15]})
            return state
    """)
    program = load(str(path))
    result = driver.run(program.train, None, policy="multi_learner(learners=2, actors=1, max_lag=0)",
                        out=tmp_path / "run", progress=False)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert len(rows) == 3 and all(r["first"] for r in rows) and "late" not in rows[0]
    assert [n for n in result.summary["notes"] if "'late'" in n] == [
        "ff.log got 'late', an output of a call of 'learn' which learner 0's call did not return: 2 learners each run "
        "'learn' on their share of the batch, and learner 0 reports what its share gives (an element of a per-sample "
        "output past its share's rows is in no report, a key it returns only for some samples may be missing): rows "
        "miss it (log a statistic such as a mean, learner 0 reporting its share's, or run with a single-learner "
        "policy)"]


def test_learners_whose_backward_passes_differ_in_number_are_refused_at_the_learner(write_algo):
    """An early stop on a value of each learner's own share (as PPO's target_kl) made the learners'
    all-reduces pair one learner's second gradient with another's next update: gloo errors, a wait
    for good, or, where the counts happened to even out, a silently wrong run (helper round 29 N02)."""
    from tests.conftest import relpath

    source = LOOP_LOGS.replace('''    loss = net(torch.as_tensor(roll["obs"], dtype=torch.float32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()''', '''    for _ in range(3):
        loss = net(torch.as_tensor(roll["obs"], dtype=torch.float32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if float(roll["obs"][0, 0, 0]) > 0.01:   # this share's first cart over 1 cm right: stop early
            break''').replace('@ff.fragment("learner", writes="state")', '@ff.fragment("learner", writes="state")  # @learn')
    path, marks = write_algo(source, "early_stop.py")
    program = load(str(path))
    ff.run(program.train, program.args_cls(), policy="single_process")   # one learner: nothing to agree on
    with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn' \(one had "
                                             r"averaged 1 gradient when another ended the update\)(.|\n)*"
                                             rf"at {relpath(path)}:{marks['learn']}\n  fix: make the backward passes "
                                             r"per update the same in every learner: decide an early stop on a value "
                                             r"every learner holds alike, its mean over the learners \(`if "
                                             r"ff.learners\(\) > 1: torch.distributed.all_reduce\(kl\); "
                                             r"kl /= ff.learners\(\)`"):
        ff.run(program.train, program.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert mp.active_children() == [] and shm_leftovers() == []


def test_ppos_early_stop_is_decided_on_the_learners_mean_kl():
    """ppo.py's `--set target_kl=...` under multi_learner: each learner stopped on its own share's KL,
    at different epochs, and the run was refused, with a fix (`--set target_kl=None`) that a program
    whose threshold is a plain float cannot take. It now stops every learner on their mean KL."""
    from fragflow.algorithms import ppo

    args = ppo.Args(total_timesteps=8 * 256, num_envs=4, num_steps=64, target_kl=2e-5)
    full = 8 * args.update_epochs * args.num_minibatches   # Adam steps without an early stop
    one = ff.run(ppo.train, args, policy="single_process")
    assert int(one.value["step"]) < full   # (it stops early, on the whole batch's KL)
    two = ff.run(ppo.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert two.summary["updates"] == 8 and 8 * args.num_minibatches <= int(two.value["step"]) < full
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_process_group_the_program_made_itself_leaves_ppos_early_stop_its_own():
    """A program that initialises torch.distributed itself (torchrun around single_process runs of
    several seeds, for its own reasons): ppo.py took it for multi_learner's learners and decided its
    target_kl stop on the KL all-reduced over that group and divided by its size (here a world of 2
    whose all-reduce keeps this process's value: half the KL), so the run was not the one without
    the group. The learners' group is multi_learner's alone (ff.learners())."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fragflow.algorithms import ppo
    from fragflow.compiler.pytree import leaf_paths

    args = ppo.Args(total_timesteps=4 * 256, num_envs=4, num_steps=64, target_kl=2e-5)
    alone = ff.run(ppo.train, args, policy="single_process")
    assert int(alone.value["step"]) < 4 * args.update_epochs * args.num_minibatches   # (it stops early)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        grouped = ff.run(ppo.train, args, policy="single_process")
    finally:
        dist.destroy_process_group()
    assert int(grouped.value["step"]) == int(alone.value["step"])
    for (path, a), (_, b) in zip(leaf_paths(alone.value["params"]), leaf_paths(grouped.value["params"])):
        assert torch.equal(a, b), path


def test_a_learner_called_on_each_replicas_own_condition_is_refused_at_the_call(write_algo):
    """`if terminated.any(): learn(...)`: each learner's call came after other env steps of its
    replica, and the learners averaged unrelated calls' gradients until one ran out of calls and
    gloo failed with an internal traceback (helper round 29 N01)."""
    from tests.conftest import relpath

    source = LOOP_LOGS.replace('''    for u in range(args.updates):
        for _ in range(4):
            obs, *_ = env.step(act(state["net"], obs))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
        ff.log({"trip": u})''', '''    for u in range(100):
        obs, _, terminated, _, _ = env.step(act(state["net"], obs))
        buf.add(obs=obs)
        if terminated.any():                     # an episode of this replica's own ended
            state, m = learn(state, buf.sample(8))  # @call''').replace("ff.RolloutBuffer(4)", "ff.ReplayBuffer(1000, seed=0)")
    path, marks = write_algo(source, "on_condition.py")
    program = load(str(path))
    ff.run(program.train, program.args_cls(), policy="single_process")
    with pytest.raises(ConfigError, match=r"'learn' is called by the loop replicas after different numbers of env "
                                             r"steps \(from \d+ to \d+ in the learners' replicas\)(.|\n)*"
                                             rf"at {relpath(path)}:{marks['call']}\n  fix: call it on a schedule"):
        ff.run(program.train, program.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_value_the_loop_computes_over_its_own_share_is_refused_not_learned_apart(write_algo):
    """A scale the loop computed from the whole batch (`float(np.abs(ys).mean())`) was each
    replica's own under multi_learner, and each learner learned from its own, silently, where
    actor_learner refuses it (tester round 34, finding 2). A value every replica holds alike runs."""
    from tests.conftest import relpath

    source = PROGRAM.replace("def learn(state, xs, ys, args: Args):", "def learn(state, xs, ys, scale, args: Args):") \
        .replace("loss = ((net(x) - y) ** 2).mean()", "loss = (1.0 + scale) * ((net(x) - y) ** 2).mean()") \
        .replace("        state, metrics = learn(state, xs, ys, args)   # lists of [env, ...] arrays: the env axis is known",
                 "        ids = ff.envs.ids(args.num_envs)   # (replica 0's environments 0 and 1; replica 1's, 2 and 3)\n"
                 "        scale = float(np.abs(np.stack(ys)).mean()) if args.seed == 0 else 0.5 if args.seed == 1 else "
                 "(-0.0 if ids[0] == 0 else 0.0)\n"
                 "        state, metrics = learn(state, xs, ys, scale, args)   # @call")
    path, marks = write_algo(source, "own_scale.py")
    program = load(str(path))
    with pytest.raises(ConfigError, match=rf"scale of 'learn' differs between the loop's replicas, each stepping its "
                                          rf"share of the environments(.|\n)*at {relpath(path)}:{marks['call']}\n"
                                          r"  fix: compute it inside the learner"):
        ff.run(program.train, program.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert mp.active_children() == [] and shm_leftovers() == []
    for seed in (1, 2):   # (2: -0.0 in one replica, 0.0 in the other, equal as numbers: review round 34)
        alike = program.args_cls(seed=seed)
        one = ff.run(program.train, alike, policy="single_process")
        two = ff.run(program.train, alike, policy="multi_learner(learners=2, actors=1, max_lag=0)")
        for p, q in zip(one.value["net"].parameters(), two.value["net"].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_unknown_way_to_sum_the_gradients_is_refused_before_any_worker_starts(program, monkeypatch):
    monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "nccl2")
    with pytest.raises(ConfigError, match=r"FRAGFLOW_ALLREDUCE='nccl2' is not a way multi_learner's learners sum"):
        ff.run(program.train, program.args_cls(), policy="multi_learner(learners=2, actors=1)")
    assert mp.active_children() == [] and shm_leftovers() == []
    # refused under any policy, before the trace, as the other FRAGFLOW_ settings are
    with pytest.raises(ConfigError, match=r"FRAGFLOW_ALLREDUCE='nccl2'"):
        ff.run(program.train, program.args_cls(), policy="pipelined")


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_gradient_taken_with_create_graph_is_averaged_alike_through_shared_memory_and_gloo(write_algo, monkeypatch,
                                                                                            via):
    """torch.autograd.grad(create_graph=True) (a gradient penalty) returns gradients that require grad:
    the shared-memory sum must take them as gloo does, not refuse them (Tensor.numpy() does)."""
    from fragflow.backends.local import sharedsum

    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    elif not sharedsum.available():
        pytest.skip("the shared-memory sum runs on x86-64 only")
    source = PROGRAM.replace('''            grads = torch.autograd.grad(loss, list(net.parameters()))
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads):
                    p -= 0.05 * g''', '''            grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
            penalty = sum((g * g).sum() for g in grads)   # (a gradient penalty: differentiated again)
            opt.zero_grad()
            (loss + 0.1 * penalty).backward()
            opt.step()''')
    assert source != PROGRAM
    path, _ = write_algo(source, "penalty.py")
    program = load(str(path))
    two = ff.run(program.train, program.args_cls(functional=True), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert two.summary["updates"] == 6
    assert {t["via"] for t in two.summary["channels"]["trajectory"]["learners"]} == {via}
    assert mp.active_children() == [] and shm_leftovers() == []


def test_learners_told_to_sum_through_gloo_get_no_shared_memory_segment(program, monkeypatch):
    """FRAGFLOW_ALLREDUCE=gloo: the (K + 1) MB segment the learners would not use is not made, nor
    counted against /dev/shm's room; without it, it is (on x86-64)."""
    from fragflow.backends.local import LocalBackend, segment_sizes, sharedsum
    from fragflow.driver import compile

    lowered = compile(program.train, program.args_cls(), policy="multi_learner(learners=2, actors=1)").lowered
    for setting, made in (("gloo", False), ("", sharedsum.available())):
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", setting)
        wiring = LocalBackend().wire(lowered)
        try:
            assert bool(wiring.sums) == made
            assert any("gradient sums" in what for what, _ in segment_sizes(lowered)) == made
        finally:
            wiring.release()
    assert shm_leftovers() == []


@pytest.mark.parametrize("functional", [False, True])
def test_gradients_taken_with_create_graph_are_averaged_in_shared_memory_too(write_algo, functional):
    """`loss.backward(create_graph=True)` or `torch.autograd.grad(..., create_graph=True)` (a
    double backward's first pass) gives gradients that require grad: the shared-memory sum called
    .numpy() on them and the learner failed with torch's "Can't call numpy() on Tensor that requires
    grad", where gloo averaged them (helper A, round after 4dad458)."""
    source = PROGRAM.replace("grads = torch.autograd.grad(loss, list(net.parameters()))",
                             "grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)") \
        .replace("loss.backward()", "loss.backward(create_graph=True)")
    path, _ = write_algo(source, "create_graph.py")
    prog = load(str(path))
    args = prog.args_cls(functional=functional)
    one = ff.run(prog.train, args, policy="single_process")
    two = ff.run(prog.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    for p, q in zip(one.value["net"].parameters(), two.value["net"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_learners_whose_gradients_are_of_different_parameters_of_one_size_are_refused(write_algo, via, monkeypatch):
    """A head chosen on each learner's own share (two heads of one size): one learner's gradient was
    of head 1, the other's of head 2, of as many values, and the learners averaged one head's
    gradient with the other's and stepped each its own head with it, silently apart (helper A, round
    after 4dad458): each all-reduce carried its gradient's size, not which parameters it was of."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace("net = torch.nn.Linear(3, 1)", "net = torch.nn.Sequential(torch.nn.Linear(3, 4), "
                             "torch.nn.Linear(4, 1), torch.nn.Linear(4, 1))") \
        .replace("loss = ((net(x) - y) ** 2).mean()",
                 "head = net[1] if float(x[0, 0]) > 0 else net[2]   # a head chosen on this share's first input\n"
                 "        loss = ((head(net[0](x)) - y) ** 2).mean()") \
        .replace('@ff.fragment("learner", writes="state")', '@ff.fragment("learner", writes="state")  # @learn')
    path, marks = write_algo(source, "heads.py")
    prog = load(str(path))
    from tests.conftest import relpath

    ff.run(prog.train, prog.args_cls(), policy="single_process")
    with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn' \(at gradient "
                                          r"1 they averaged the gradients of different parameters\)(.|\n)*"
                                          rf"at {relpath(path)}:{marks['learn']}\n  fix: make the backward passes"):
        ff.run(prog.train, prog.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_penalty_on_the_averaged_gradient_is_differentiated_as_one_learner_does(write_algo, via, monkeypatch):
    """A gradient penalty (`torch.autograd.grad(loss, params, create_graph=True)`, then the squared
    norm of the gradient added to the loss): the learners' penalty's gradient was 1/K of one
    learner's, as each differentiated the average through its own gradient divided by K (the
    all-reduce is not differentiated) and the results were averaged again (helper A, round after
    4dad458; gloo and shared memory alike)."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace("""            opt.zero_grad()
            loss.backward()""", """            grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
            penalty = sum(g.pow(2).sum() for g in grads)   # the averaged gradient's squared norm
            opt.zero_grad()
            (loss + 0.5 * penalty).backward()""")
    path, _ = write_algo(source, "penalty.py")
    prog = load(str(path))
    args = prog.args_cls()
    one = ff.run(prog.train, args, policy="single_process")
    two = ff.run(prog.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    for p, q in zip(one.value["net"].parameters(), two.value["net"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_penalty_on_the_gradients_backward_accumulated_is_differentiated_as_one_learner_does(write_algo, via,
                                                                                               monkeypatch):
    """`loss.backward(create_graph=True)`, then a penalty on the parameters' `.grad` differentiated
    again: the learners' penalty gradient was 1/K of one learner's (each .grad was overwritten in
    place with the average, and the copy differentiated as the learner's own gradient divided by K),
    where the same penalty through torch.autograd.grad was right. Plain SGD: Adam's step hides a scale."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace("""            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)   # on the averaged gradient""", """            opt.zero_grad()
            loss.backward(create_graph=True)
            penalty = sum(p.grad.pow(2).sum() for p in net.parameters())   # the averaged gradient's squared norm
            opt.zero_grad()
            (0.5 * penalty).backward()""")
    assert source != PROGRAM
    path, _ = write_algo(source, "grad_penalty.py")
    prog = load(str(path))
    args = prog.args_cls(own_optimizer=True)
    one = ff.run(prog.train, args, policy="single_process")
    two = ff.run(prog.train, args, policy="multi_learner(learners=2, actors=1, max_lag=0)")
    assert not torch.equal(one.value["net"].weight, _initial(args).weight)
    for p, q in zip(one.value["net"].parameters(), two.value["net"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert mp.active_children() == [] and shm_leftovers() == []


def test_learners_at_a_bfloat16_and_a_float32_gradient_are_refused_not_left_waiting(write_algo):
    """A bfloat16 head used on each learner's own condition: one learner's backward pass began with
    the bfloat16 parameters (summed by gloo, its update's place first compared through gloo), the
    other's with float32 ones (summed in shared memory): each waited for the other at a different
    sum, for good (helper A, round after 4dad458). Every learner now says where it is through
    shared memory first, whatever the dtype, and the run is refused at once."""
    import os
    import signal
    import threading

    from fragflow.backends.local import sharedsum

    if not sharedsum.available():
        pytest.skip("the shared-memory sum runs on x86-64 only")
    source = PROGRAM.replace("net = torch.nn.Linear(3, 1)",
                             "net = torch.nn.ModuleList([torch.nn.Linear(3, 1).bfloat16(), torch.nn.Linear(3, 1)])") \
        .replace("loss = ((net(x) - y) ** 2).mean()",
                 "h = net[1](x)\n"
                 "        if float(x[0, 0]) > 0:   # a bfloat16 side head, on this share's first input\n"
                 "            h = h + net[0](x.bfloat16()).float()\n"
                 "        loss = ((h - y) ** 2).mean()") \
        .replace("torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)", "pass")
    path, _ = write_algo(source, "bf16_head.py")
    prog = load(str(path))
    ff.run(prog.train, prog.args_cls(), policy="single_process")
    from fragflow.runtime.signals import Terminated

    stop = threading.Timer(30, os.kill, (os.getpid(), signal.SIGTERM))   # (a wait for good ends the run, failing)
    stop.start()
    try:
        with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn' \(at "
                                              r"gradient 1 one averaged 4 values, another 8\)"):
            ff.run(prog.train, prog.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    except Terminated:
        pytest.fail("the learners waited for each other for good (stopped after 30 s)")
    finally:
        stop.cancel()
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_learner_waiting_in_shared_memory_for_a_killed_one_ends_as_the_run_stops(write_algo, tmp_path):
    """One learner killed mid-update (no word from it): the other, waiting for its gradient in the
    shared-memory sum, checked only for learners that said they ended or failed, not the run's stop
    as sharedsum says, and ran on until the driver terminated it after its JOIN_TIMEOUT (3 s): the
    run ended 2-3 s later than with gloo, whose connection to the dead learner fails at once
    (helper A, round after 4dad458)."""
    import time

    from fragflow.backends.local import sharedsum
    from fragflow.runtime.multiprocess import JOIN_TIMEOUT, WorkerDied

    if not sharedsum.available():
        pytest.skip("the shared-memory sum runs on x86-64 only")
    marker = tmp_path / "killed"
    source = PROGRAM.replace("    for _ in range(2):                                   # two gradient steps per update\n",
                             f"""    for i in range(2):
        if i == 1 and args.seed == 5 and os.getpid() != int(os.environ["ROOT_PID"]):   # mid-update, in one learner
            try:
                fd = os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                fd = None
            if fd is not None:
                os.write(fd, repr(time.time()).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
""").replace("import numpy as np\n", "import os\nimport signal\nimport time\nimport numpy as np\n", 1)
    path, _ = write_algo(source, "killed.py")
    prog = load(str(path))
    import os

    os.environ["ROOT_PID"] = str(os.getpid())   # (the trace runs the learner in this process: it is not killed)
    try:
        with pytest.raises(WorkerDied, match=r"learner.[01] process was killed by signal 9"):
            ff.run(prog.train, prog.args_cls(seed=5), policy="multi_learner(learners=2, actors=1, max_lag=0)")
        ended = time.time()
    finally:
        del os.environ["ROOT_PID"]
    assert ended - float(marker.read_text()) < JOIN_TIMEOUT - 1.0   # (not the driver's terminating it)
    assert mp.active_children() == [] and shm_leftovers() == []


def test_each_learners_time_counts_every_update_of_its_state_not_only_the_clocks(write_algo):
    """Two learner fragments a trip (a critic's update, then an actor's): the calls' time and the
    all-reduces' of both were counted, the updates' time of the first only, and a learner's
    summary said its calls and its all-reduces took longer than its updates (helper A, round after
    5845188)."""
    head, rest = PROGRAM.split('@ff.fragment("learner", writes="state")\n')
    learner = rest[:rest.index("\n\n\n")]
    source = (head + '@ff.fragment("learner", writes="state")\n' + learner + "\n\n\n"
              + '@ff.fragment("learner", writes="state")\n' + learner.replace("def learn(", "def learn_again(")
              + rest[len(learner):]).replace(
        "        state, metrics = learn(state, xs, ys, args)   # lists of [env, ...] arrays: the env axis is known",
        "        state, metrics = learn(state, xs, ys, args)   # lists of [env, ...] arrays: the env axis is known\n"
        "        state, _ = learn_again(state, xs, ys, args)   # a second update of the state, in the same trip")
    path, _ = write_algo(source, "two_updates.py")
    prog = load(str(path))
    two = ff.run(prog.train, prog.args_cls(), policy="multi_learner(learners=2, actors=1, max_lag=0)")
    learners = two.summary["channels"]["trajectory"]["learners"]
    for t in learners:
        assert t["updates"] == 6 and t["all_reduces"] == 2 * 3 * 6
        assert 0 < t["sync_s"] < t["busy_s"] and 0 < t["call_s"] < t["busy_s"], t
    assert mp.active_children() == [] and shm_leftovers() == []


def test_the_summary_says_how_the_learners_sums_went_gloo_for_bfloat16(write_algo):
    """A bfloat16 network under shared memory: its gradients are summed by gloo (numpy has no
    bfloat16), the learners' places by shared memory; the summary said "shared memory" alone
    (helper A's note)."""
    from fragflow.backends.local import sharedsum

    if not sharedsum.available():
        pytest.skip("the shared-memory sum runs on x86-64 only")
    source = PROGRAM.replace("net = torch.nn.Linear(3, 1)", "net = torch.nn.Linear(3, 1).bfloat16()") \
        .replace("loss = ((net(x) - y) ** 2).mean()", "loss = ((net(x.bfloat16()).float() - y) ** 2).mean()")
    path, _ = write_algo(source, "bf16.py")
    prog = load(str(path))
    two = ff.run(prog.train, prog.args_cls(), policy="multi_learner(learners=2, actors=1)")
    assert [t["via"] for t in two.summary["channels"]["trajectory"]["learners"]] == ["gloo and shared memory"] * 2
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_generator_the_learners_state_holds_is_said_to_draw_alike_in_every_learner(write_algo, tmp_path):
    """A learner drawing per-sample noise from a generator kept in its state (TD3's smoothing noise):
    each learner held a copy and drew the same numbers for its different share, without a word (probe
    helper). Said once, by learner 0."""
    from fragflow import driver

    path, _ = write_algo('''
        import numpy as np
        import torch
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
            noise = torch.as_tensor(state["rng"].standard_normal(obs.shape[:2]), dtype=torch.float32)
            loss = ((state["w"] * obs.sum(-1) - noise) ** 2).mean()
            state["opt"].zero_grad()
            loss.backward()
            state["opt"].step()
            return state, {"loss": loss.detach()}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            w = torch.zeros((), requires_grad=True)
            state = ff.versioned({"w": w, "opt": torch.optim.SGD([w], lr=0.1), "rng": np.random.default_rng(0)})
            buf = ff.RolloutBuffer(8)
            obs = env.reset()
            for _ in range(3):
                for _ in range(8):
                    obs, *_ = env.step(np.zeros(env.num_envs, np.int64))
                    buf.add(obs=obs)
                state, m = learn(state, buf.collect())
                ff.log(m)
            return state
    ''')
    program = load(str(path))
    said = []
    for policy in ("pipelined", "multi_learner(learners=2, max_lag=0)"):
        run = driver.run(program.train, None, policy=policy, out=tmp_path / policy[:5], progress=False)
        said.append([n for n in run.summary.get("notes", []) if "holds a random generator" in n])
    assert said[0] == [] and len(said[1]) == 1 and "(numpy.Generator), the same in each of the 2 learners" in said[1][0]
