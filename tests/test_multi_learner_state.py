"""multi_learner: every learner holds the same state after each update, or the run is refused.

Learner 0 alone publishes, reports and checkpoints; a value each learner computes from its own share
of the batch (a running statistic, a counter of its share's events, a BatchNorm's running moments)
made the learners hold different states, silently, and the run's result was learner 0's share's."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import fragflow as ff
from fragflow.errors import ConfigError
from fragflow.program import load
from tests.conftest import relpath
from tests.test_multi_learner import PROGRAM
from tests.test_multiprocess import shm_leftovers

ML = "multi_learner(learners=2, actors=1, max_lag=0)"
LEARN = '@ff.fragment("learner", writes="state")'
ADAM = '{"net": net, "opt": torch.optim.Adam(net.parameters(), lr=0.05)}'
STEPS = "    for _ in range(2):                                   # two gradient steps per update"


def _close(one, two):
    for p, q in zip(one.value["net"].state_dict().values(), two.value["net"].state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_counter_of_each_learners_own_share_is_refused_naming_it(write_algo, via, monkeypatch):
    """A count the learner keeps in its state of its share's events (`if x[0, 0] > 0: n += 1`): the
    learners counted 2 and 3, and the run reported learner 0's."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace(ADAM, ADAM[:-1] + ', "n": 0}').replace(LEARN, LEARN + "  # @learn") \
        .replace('    return state, {"loss": loss.detach()}',
                 '    if float(x[0, 0]) > 0:   # this share\'s first input\n'
                 '        state["n"] += 1\n    return state, {"loss": loss.detach()}')
    path, marks = write_algo(source, "counter.py")
    prog = load(str(path))
    assert ff.run(prog.train, prog.args_cls(), policy="single_process").value["n"] == 2
    with pytest.raises(ConfigError, match=r"after an update of 'learn' its learners hold different values of "
                                          r"state\['n'\] \(a value each learner computes from its own share(.|\n)*"
                                          rf"at {relpath(path)}:{marks['learn']}\n  fix: compute it from what every "
                                          r"learner holds alike(.|\n)*torch.distributed.all_reduce"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_batch_norms_running_statistics_over_each_share_are_refused_with_a_norm_that_keeps_none(write_algo):
    """BatchNorm in the learner's network: each learner's running moments were of its own share."""
    source = PROGRAM.replace("net = torch.nn.Linear(3, 1)\n    state",
                             "net = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))\n    state")
    assert source != PROGRAM
    path, _ = write_algo(source, "batchnorm.py")
    prog = load(str(path))
    with pytest.raises(ConfigError, match=r"different values of state\['net'\]\['0.running_mean'\], "
                                          r"state\['net'\]\['0.running_var'\] \(a BatchNorm's running statistics(.|\n)*"
                                          r"fix: use a norm without running statistics"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    assert mp.active_children() == [] and shm_leftovers() == []
    # the fix the message gives runs (the share's own moments normalise its forward pass, as PPO's minibatches)
    path, _ = write_algo(source.replace("BatchNorm1d(3)", "BatchNorm1d(3, track_running_stats=False)"), "bn_free.py")
    prog = load(str(path))
    assert ff.run(prog.train, prog.args_cls(), policy=ML).summary["updates"] == 6


def test_a_running_mean_the_learners_all_reduce_is_one_learners(write_algo):
    """The fix the refusal gives for a statistic of the share: a running mean of the targets over the
    learners' sums (torch.distributed's group, which multi_learner's learners share) is the whole
    batch's, and the run one learner's; kept over each share it is refused."""
    own = PROGRAM.replace(ADAM, ADAM[:-1] + ', "mu": torch.zeros(1)}') \
        .replace(STEPS, '    state["mu"] = 0.9 * state["mu"] + 0.1 * y.mean()\n    y = y - state["mu"]\n' + STEPS)
    shared = own.replace('    state["mu"] = 0.9 * state["mu"] + 0.1 * y.mean()', '''    m = y.mean()
    if ff.learners() > 1:
        torch.distributed.all_reduce(m)
        m = m / ff.learners()
    state["mu"] = 0.9 * state["mu"] + 0.1 * m''')
    assert own != PROGRAM and shared != own
    path, _ = write_algo(own, "own_mean.py")
    prog = load(str(path))
    with pytest.raises(ConfigError, match=r"different values of state\['mu'\]"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    path, _ = write_algo(shared, "shared_mean.py")
    prog = load(str(path))
    one, two = ff.run(prog.train, prog.args_cls(), policy="single_process"), ff.run(prog.train, prog.args_cls(), policy=ML)
    torch.testing.assert_close(one.value["mu"], two.value["mu"])
    _close(one, two)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_an_update_every_learner_skips_alike_runs_as_one_learner(write_algo, via, monkeypatch):
    """A learner that takes no gradient step on some updates, on a count in its state (every learner
    alike): it was refused as one that 'computed none', though the learners stayed identical."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace(ADAM, ADAM[:-1] + ', "k": 0}').replace(STEPS, '''    state["k"] += 1
    if state["k"] % 3 == 0:   # no step on every third update
        return state, {"loss": torch.zeros(())}
''' + STEPS)
    path, _ = write_algo(source, "skips.py")
    prog = load(str(path))
    one, two = ff.run(prog.train, prog.args_cls(), policy="single_process"), ff.run(prog.train, prog.args_cls(), policy=ML)
    assert two.value["k"] == 6 and two.summary["updates"] == 6
    _close(one, two)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_an_update_one_learner_skips_on_its_own_share_is_refused_through_gloo_too(write_algo, via, monkeypatch):
    """A step skipped on a value of each learner's own share, at the first update: the learner that
    skipped ended its update with an all-reduce of another size than the other's first gradient, and
    gloo aborted that learner's process ('killed by signal 6 without reporting an error')."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace(STEPS, '''    if float(x[0, 0]) > 0.5:   # this share's first input: no step
        return state, {"loss": torch.zeros(())}
''' + STEPS).replace(LEARN, LEARN + "  # @learn")
    path, marks = write_algo(source, "skips_own.py")
    prog = load(str(path))
    with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn' \(one had "
                                          r"averaged 0 gradients when another ended the update\)(.|\n)*"
                                          rf"at {relpath(path)}:{marks['learn']}\n"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_second_learner_one_learner_skips_on_its_own_share_is_refused_through_gloo_too(write_algo, via, monkeypatch):
    """Two learner fragments whose gradients differ in size (the clock's net, a wider head), the
    head's step skipped on a value of each learner's own share after the first update: the learner
    that skipped ended the head's update with an all-reduce of the size of the first gradient of its
    last update with one (the clock's, just before), the other learner all-reduced the head's first
    gradient, and gloo aborted the learners' processes (a worker killed by signal 6) rather than the
    run being refused."""
    source = PROGRAM.replace('''def train(args: Args):''', '''@ff.fragment("learner", writes="head")  # @head
def learn_head(head, xs, update):
    x = torch.as_tensor(np.stack(xs)).reshape(-1, 3)
    if update >= 2 and float(x[0, 0]) > 0.0:   # this share's first input: no step
        return head
    loss = head["net"](x).pow(2).mean()
    head["opt"].zero_grad()
    loss.backward()
    head["opt"].step()
    return head


def train(args: Args):''').replace('''        state, metrics = learn(state, xs, ys, args)''', '''        state, metrics = learn(state, xs, ys, args)
        head = learn_head(head, xs, update)''').replace('''    key = ff.random.keys(args.seed, ff.envs.ids(args.num_envs))''', '''    wide = torch.nn.Linear(3, 8)
    head = ff.versioned({"net": wide, "opt": torch.optim.SGD(wide.parameters(), lr=0.01)}, name="head")
    key = ff.random.keys(args.seed, ff.envs.ids(args.num_envs))''')
    assert source.count("learn_head") == 2 and "wide" in source
    path, marks = write_algo(source, "skips_head.py")
    prog = load(str(path))
    ff.run(prog.train, prog.args_cls(), policy="single_process")
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn_head' "
                                          r"\(one had averaged 0 gradients when another ended the update\)(.|\n)*"
                                          rf"at {relpath(path)}:{marks['head']}\n"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_second_step_of_other_parameters_one_learner_skips_is_refused_through_gloo_too(write_algo, via, monkeypatch):
    """One update of two backward passes into different parameters (a critic's, then a wider actor
    head's, as SAC's), the second skipped on a value of each learner's own share after the first
    update: the learner that skipped ended the update with an all-reduce of its last gradient's size
    (the critic's), the other all-reduced the head's gradient, and gloo aborted the learners'
    processes (a worker killed by signal 6) rather than the run being refused."""
    source = PROGRAM.replace(ADAM, '''{"net": net, "opt": torch.optim.Adam(net.parameters(), lr=0.05),
                          "head": torch.nn.Linear(3, 8), "n": 0}''').replace(STEPS, '''    state["n"] += 1
    for _ in range(1):
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if state["n"] >= 3 and float(x[0, 0]) > 0.0:   # this share's first input: no step of the head
        return state, {"loss": loss.detach()}
    head_loss = state["head"](x).pow(2).mean()
    state["head"].zero_grad()
    head_loss.backward()
    with torch.no_grad():
        for p in state["head"].parameters():
            p -= 0.01 * p.grad
''' + STEPS).replace(LEARN, LEARN + "  # @learn")
    assert "head_loss" in source and "# @learn" in source
    path, marks = write_algo(source, "skips_second.py")
    prog = load(str(path))
    ff.run(prog.train, prog.args_cls(), policy="single_process")
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    with pytest.raises(ConfigError, match=r"the learners made different gradients in one update of 'learn' "
                                          r"\(one had averaged 1 gradient when another ended the update\)(.|\n)*"
                                          rf"at {relpath(path)}:{marks['learn']}\n"):
        ff.run(prog.train, prog.args_cls(), policy=ML)
    assert mp.active_children() == [] and shm_leftovers() == []


def test_an_optimizer_setting_that_is_an_object_is_not_compared_by_its_address(write_algo):
    """A setting of an optimizer's group that is an object (a schedule kept beside the rate): its
    repr (an address, here its process) differs between the learners' processes, and the learners
    were refused as holding different states."""
    source = PROGRAM.replace(ADAM, ADAM.replace("torch.optim.Adam(net.parameters(), lr=0.05)",
                                                "scheduled(torch.optim.Adam(net.parameters(), lr=0.05))")) \
        .replace("def train(args: Args):", """class Schedule:
    def __call__(self, update):
        return 0.05

    def __repr__(self):   # (an object's repr: here its process, as an address would differ between processes)
        import os
        return f"<Schedule in {os.getpid()}>"


def scheduled(opt):
    opt.param_groups[0]["schedule"] = Schedule()   # kept beside the rate
    return opt


def train(args: Args):""")
    assert source != PROGRAM
    path, _ = write_algo(source, "setting_object.py")
    prog = load(str(path))
    assert ff.run(prog.train, prog.args_cls(), policy=ML).summary["updates"] == 6
    assert mp.active_children() == [] and shm_leftovers() == []


def test_mappos_return_moments_are_the_whole_batchs_under_multi_learner():
    """MAPPO's ValueNorm kept its running moments of each learner's share: the learners normalised
    their critics' targets apart and the actors acted with learner 0's moments. Averaged over the
    learners, after one update they are single_process's (the update itself differs: each learner
    normalises its own share's advantages)."""
    from fragflow.algorithms import mappo

    args = mappo.Args(total_timesteps=100, num_envs=4, num_steps=25, update_epochs=1, hidden=16)
    one = ff.run(mappo.train, args, policy="single_process").value["model"]
    two = ff.run(mappo.train, args, policy=ML).value["model"]
    assert float(one.ret_debias) > 0
    for name in ("ret_mean", "ret_mean_sq", "ret_debias"):
        torch.testing.assert_close(getattr(one, name), getattr(two, name), rtol=1e-5, atol=0)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("via", ["shared memory", "gloo"])
def test_a_module_the_learner_makes_anew_each_update_is_averaged_as_the_first(write_algo, via, monkeypatch):
    """A learner that returns a new module each update (`copy.deepcopy(net)`, an optimizer made at
    each call) had its gradients averaged only at the first update: the learners watched the
    parameters of the state they were first given, so from the second update each learned from its
    own share and the run was refused as 'a value each learner computes from its own share'. The
    parameters of each state a learner writes are now watched (and those it no longer holds let go)."""
    if via == "gloo":
        monkeypatch.setenv("FRAGFLOW_ALLREDUCE", "gloo")
    source = PROGRAM.replace('    return state, {"loss": loss.detach()}',
                             '    return {**state, "net": copy.deepcopy(net)}, {"loss": loss.detach()}') \
        .replace("import numpy as np", "import copy\nimport numpy as np")
    assert source.count("copy.deepcopy") == 1
    path, _ = write_algo(source, "deepcopied.py")
    prog = load(str(path))
    one = ff.run(prog.train, prog.args_cls(own_optimizer=True), policy="single_process")
    two = ff.run(prog.train, prog.args_cls(own_optimizer=True), policy=ML)
    assert two.summary["updates"] == 6
    _close(one, two)
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_parameter_frozen_when_its_state_is_written_stays_averaged_when_unfrozen(write_algo):
    """A learner that makes its module anew each update and freezes a parameter of another module
    as it returns its second update (unfreezing it at its next call): the parameters no state held
    were let go at each write, and a frozen one counted as not held, so from the third update its
    gradient was each learner's own (review of this session's change). (A parameter frozen whenever
    its state is written is never watched: its hook needs it to require gradients.)"""
    replaced = [
        ('    net = state["net"]\n', '    net = state["net"]\n    head = state["head"]\n    head.bias.requires_grad_(True)\n'),
        ("torch.optim.SGD(net.parameters(), lr=0.05)", "torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.05)"),
        ("loss = ((net(x) - y) ** 2).mean()", "loss = ((head(net(x)) - y) ** 2).mean()"),
        ('    return state, {"loss": loss.detach()}',
         '    head.bias.requires_grad_(state["n"] != 1)\n'
         '    return {**state, "net": copy.deepcopy(net), "n": state["n"] + 1}, {"loss": loss.detach()}'),
        ('{"net": net} if args.own_optimizer else',
         '{"net": net, "head": torch.nn.Linear(1, 1), "n": 0} if args.own_optimizer else'),
        ("import numpy as np", "import copy\nimport numpy as np"),
    ]
    source = PROGRAM
    for old, new in replaced:
        assert old in source, old
        source = source.replace(old, new)
    path, _ = write_algo(source, "frozen_head.py")
    prog = load(str(path))
    one = ff.run(prog.train, prog.args_cls(own_optimizer=True), policy="single_process")
    two = ff.run(prog.train, prog.args_cls(own_optimizer=True), policy=ML)
    assert two.summary["updates"] == 6
    _close(one, two)
    torch.testing.assert_close(one.value["head"].bias, two.value["head"].bias, rtol=1e-5, atol=1e-6)
    assert mp.active_children() == [] and shm_leftovers() == []
