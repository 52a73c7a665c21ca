"""A module's state beyond its parameters and saved buffers travels with its versions: the buffers
state_dict leaves out (persistent=False) and what get_extra_state returns."""

from __future__ import annotations

import csv

import pytest
import torch

import fragflow as ff
from fragflow.program import load

EXTRA_STATE = '''
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 12

class Scaled(nn.Module):
    """A layer whose output scale is kept by get_extra_state (a number and a tensor), not in a buffer."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale, self.count, self.mean = 1.0, 0, torch.zeros(2)

    def forward(self, x):
        return self.lin(x) * self.scale + self.mean

    def get_extra_state(self):   # (its keys in another order every other update: a dict is by its keys)
        if self.count % 2:
            return {"mean": self.mean, "count": self.count, "scale": self.scale}
        return {"scale": self.scale, "count": self.count, "mean": self.mean}

    def set_extra_state(self, state):
        self.scale, self.count, self.mean = state["scale"], state["count"], state["mean"].clone()

@ff.fragment("actor")
def act(net, obs):
    with torch.no_grad():
        return net(torch.as_tensor(obs)).numpy()

@ff.fragment("learner", writes="state")
def learn(state, obs, outs):
    net, opt = state["net"], state["opt"]
    target = torch.as_tensor(outs) * 0.5
    loss = (net(torch.as_tensor(obs)) - target).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    net.scale, net.count = net.scale * 0.9 + 0.05, net.count + 1   # the extra state moves every update
    net.mean = net.mean * 0.5 + target.mean(0)
    return state

def train(args: Args):
    torch.manual_seed(0)
    net = Scaled()
    state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1)})
    obs = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    for _ in range(args.updates):
        outs = act(state["net"], obs)
        state = learn(state, obs, outs)
        obs = np.roll(obs, 1, axis=0)
    return state
'''


def test_a_modules_extra_state_travels_with_its_versions_as_eagerly(write_algo, tmp_path):
    """A module whose get_extra_state keeps numbers and tensors (not buffers) was refused at
    ff.versioned under every policy with an internal AttributeError (its dict has no detach). Its
    extra state is a pytree of the module's version: read by the actor at the version it acts with,
    put back with set_extra_state, saved with a checkpoint."""
    path, _ = write_algo(EXTRA_STATE, "extra.py")
    program = load(str(path))

    def final(state):
        net = state["net"]
        return [p.detach().clone() for p in net.parameters()], net.scale, net.count, net.mean.clone()

    eager = final(program.train(program.args_cls()))
    assert eager[2] == 12 and eager[1] != 1.0
    for policy in ("single_process", "pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"):
        got = final(ff.run(program.train, program.args_cls(), policy=policy).value)
        assert all(torch.equal(a, b) for a, b in zip(got[0], eager[0])), policy
        assert got[1:3] == eager[1:3] and torch.equal(got[3], eager[3]), policy
    ff.run(program.train, program.args_cls(), policy="pipelined(max_lag=0)", out=tmp_path / "a", checkpoint_every=4)
    resumed = ff.run(program.train, program.args_cls(), policy="pipelined(max_lag=0)", out=tmp_path / "b",
                     resume=tmp_path / "a" / "checkpoints" / "8")
    got = final(resumed.value)
    assert got[1:3] == eager[1:3] and torch.equal(got[3], eager[3])
    assert all(torch.equal(a, b) for a, b in zip(got[0], eager[0]))


def test_an_extra_state_that_is_no_pytree_of_arrays_is_refused_at_the_users_line_with_the_fix(write_algo):
    text = EXTRA_STATE.replace('return {"scale": self.scale, "count": self.count, "mean": self.mean}',
                               'return f"{self.scale}"').replace(
        "state = ff.versioned(", "state = ff.versioned(  # @made\n        ")
    path, marks = write_algo(text, "extrastr.py")
    program = load(str(path))
    with pytest.raises(ff.errors.NotArrayPytreeError, match=r"leaf \['net'\]\['_extra_state'\] is a str\n  at \S*extrastr.py:"
                                                           rf"{marks['made']}\n  fix: a module's get_extra_state travels"):
        ff.run(program.train, program.args_cls(), policy="single_process")


UNSAVED_BUFFER = '''
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 6

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(4), persistent=False)   # kept out of checkpoints

    def forward(self, x):
        return self.fc(x * self.scale)

@ff.fragment("actor")
def act(net, obs, key):
    with torch.no_grad():
        logits = net(torch.as_tensor(obs)).numpy()
    return np.argmax(logits + ff.random.gumbel(key, (2,)), -1), logits

@ff.fragment("learner", writes="state")
def learn(state, batch):
    net = state["net"]
    obs = torch.as_tensor(batch["obs"]).reshape(-1, 4)
    with torch.no_grad():
        net.scale.mul_(0.5).add_(0.5 / (obs.abs().mean(0) + 1e-3))
    loss = (net(obs) - torch.as_tensor(batch["logits"]).reshape(-1, 2)).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {"loss": loss.detach()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    net = Net()
    state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.01)})
    buf = ff.RolloutBuffer(8)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(8):
            key, sub = ff.random.split(key)
            action, logits = act(state["net"], obs, sub)
            next_obs, reward, terminated, truncated, info = env.step(action)
            buf.add(obs=obs, logits=logits)
            obs = next_obs
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    return state
'''


def test_a_buffer_kept_out_of_state_dict_reaches_the_actor_with_each_version(write_algo, tmp_path):
    """A buffer registered with persistent=False (an observation scale the learner updates and the
    actor uses) was left out of what a version carries: the actor kept its first values, and
    pipelined(max_lag=0) learned differently from single_process from the second update on, unsaid."""
    path, _ = write_algo(UNSAVED_BUFFER, "unsaved.py")
    program = load(str(path))

    def final(policy):
        result = ff.run(program.train, program.args_cls(), policy=policy, out=tmp_path / policy)
        net = result.value["net"]
        with open(tmp_path / policy / "metrics.csv") as f:
            losses = [row["loss"] for row in csv.DictReader(f)]
        return [t.detach().clone() for t in (*net.parameters(), net.scale)], losses

    want = final("single_process")
    assert not torch.equal(want[0][-1], torch.ones(4)) and len(want[1]) == 6
    for policy in ("pipelined(max_lag=0)", "central_inference(env_workers=1)"):
        got = final(policy)
        assert got[1] == want[1], policy
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])), policy


def test_a_constant_non_finite_buffer_kept_out_of_state_dict_is_not_taken_for_a_diverged_learner(write_algo):
    """A causal mask of -inf registered with persistent=False stopped every run with NonFiniteError
    once such buffers travelled with the state."""
    text = UNSAVED_BUFFER.replace(
        '        self.register_buffer("scale", torch.ones(4), persistent=False)   # kept out of checkpoints',
        '        self.register_buffer("scale", torch.ones(4), persistent=False)   # kept out of checkpoints\n'
        '        self.register_buffer("mask", torch.full((2, 2), float("-inf")).triu(1), persistent=False)')
    assert "mask" in text
    path, _ = write_algo(text, "mask.py")
    program = load(str(path))
    for policy in ("single_process", "pipelined(max_lag=0)"):
        assert ff.run(program.train, program.args_cls(), policy=policy).summary["updates"] == 6


def test_a_checkpoint_saves_the_buffers_state_dict_leaves_out():
    """A resumed run started such a buffer (a statistic the learner updates) from its first value:
    checkpoints saved modules through state_dict, which leaves it out."""
    from fragflow.runtime.encoding import decode, encode

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2), persistent=False)
            self.register_buffer("cache", None, persistent=False)   # made at the first update

    saved = Net()
    saved.scale.mul_(3.0)
    saved.cache = torch.arange(3.0)
    meta, tensors = encode({"net": saved}, "states")
    fresh = Net()
    scale = fresh.scale
    out = decode(meta, tensors, {"net": fresh})
    assert out["net"] is fresh and fresh.scale is scale   # (in place: the same tensor)
    assert torch.equal(fresh.scale, torch.full((2,), 3.0)) and torch.equal(fresh.cache, torch.arange(3.0))
    assert torch.equal(fresh.fc.weight, saved.fc.weight)


def test_set_extra_state_gets_its_values_in_the_modules_own_order_and_type():
    """Flattened in sorted key order, an extra state came back to the acting side's set_extra_state as a
    plain dict in that order: one that unpacks an OrderedDict's values swapped them."""
    from collections import OrderedDict

    from fragflow.compiler.pytree import flatten, unflatten_into

    class Counted(torch.nn.Module):
        def __init__(self, steps: int, scale: float) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.steps, self.scale = steps, scale

        def get_extra_state(self):
            return OrderedDict(steps=self.steps, scale=self.scale)

        def set_extra_state(self, state):
            assert type(state) is OrderedDict
            self.steps, self.scale = state.values()

    learner, actor = Counted(7, 0.5), Counted(0, 1.0)
    unflatten_into(actor, flatten(learner)[0])
    assert (actor.steps, actor.scale) == (7, 0.5)


PLAIN_ATTRIBUTE = '''
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    read: bool = True

class QNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.epsilon = 1.0          # exploration rate kept on the module
        self.last_loss = 0.0        # (a note of the learner's own, which no actor reads)

@ff.fragment("actor")
def act(q, obs, key):
    u = ff.random.uniform(key, (2,))
    with torch.no_grad():
        greedy = q.fc(torch.as_tensor(obs)).argmax(-1).numpy()
    return np.where(u[:, 0] < q.epsilon, (u[:, 1] * 2).astype(np.int64), greedy)

@ff.fragment("actor")
def act_plain(q, obs, key):
    with torch.no_grad():
        return q.fc(torch.as_tensor(obs)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")   # @learn
def learn(state, batch, read):
    if read:
        state["q"].epsilon = max(0.05, state["q"].epsilon * 0.5)   # the learner anneals it
    state["q"].last_loss = float(batch["obs"].mean())
    return state, {"obs": batch["obs"].mean()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    state = ff.versioned({"q": QNet()})
    buf = ff.RolloutBuffer(2)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    for _ in range(4):
        for _ in range(2):
            key, sub = ff.random.split(key)
            a = act(state["q"], obs, sub) if args.read else act_plain(state["q"], obs, sub)
            obs, r, term, trunc, info = env.step(a)
            buf.add(obs=obs)
        state, m = learn(state, buf.collect(), args.read)
        ff.log(m)
    return state
'''


def test_a_plain_attribute_a_learner_changes_and_an_actor_apart_reads_is_refused(write_algo):
    """`self.epsilon = 1.0` on a module in the state, annealed by the learner and read by the actor: a
    version carries parameters and buffers, so an actor apart acted with 1.0 throughout, without a
    word (probe helper: single_process 1, 0.5, 0.25, 0.125; pipelined(max_lag=0) 1, 1, 1, 1). Refused
    where the actor runs apart, naming the attribute and the fix; run where the actor shares the
    learner's process; an attribute no actor's code reads (the learner's own note) is not refused."""
    from fragflow.errors import PlacementError
    from tests.test_multiprocess import same_tree, shm_leftovers

    path, marks = write_algo(PLAIN_ATTRIBUTE)
    program = load(str(path))
    expected = ff.run(program.train, program.args_cls(), policy="single_process")
    for policy in ("pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)", "async_relaxed"):
        with pytest.raises(PlacementError) as err:
            ff.run(program.train, program.args_cls(), policy=policy)
        assert "learner 'learn' changes state['q'].epsilon (a float attribute of QNet)" in str(err.value)
        assert "actor fragment 'act'" in str(err.value) and "register_buffer" in err.value.fix
        assert str(err.value.where).endswith(f"algo.py:{marks['learn']}")
    served = ff.run(program.train, program.args_cls(), policy="central_inference")
    assert same_tree(served.value, expected.value)
    ff.run(program.train, program.args_cls(read=False), policy="pipelined(max_lag=0)")   # (last_loss: no actor reads it)
    assert shm_leftovers() == []


LOOP_SETS_MODE = '''
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 3

@ff.fragment("actor")
def act(net, obs):
    with torch.no_grad():
        return net(torch.as_tensor(obs)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    net, opt = state["net"], state["opt"]
    net.train()
    loss = net(torch.as_tensor(batch["obs"])).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    return state, {"loss": loss.detach()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(args.updates):
        state["net"].eval()   # (act in eval mode; the learner sets train() itself)   # @eval
        for _ in range(4):
            a = act(state["net"], obs)
            buf.add(obs=obs)
            obs, r, term, trunc, info = env.step(a)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
'''


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_the_loops_own_mode_change_is_named_at_its_line_not_blamed_on_the_learner(write_algo, policy):
    """The loop sets eval mode through the state handle before acting, the learner sets train() itself:
    the refusal said the learner changes the mode the actor acts in, at the actor's definition, with a
    fix the program already followed (probe helper). It is the loop's read of the state, refused at
    its line as central_inference refused it."""
    from fragflow.errors import VersionedStateError

    path, marks = write_algo(LOOP_SETS_MODE)
    program = load(str(path))
    ff.run(program.train, program.args_cls(), policy="single_process")
    with pytest.raises(VersionedStateError) as err:
        ff.run(program.train, program.args_cls(), policy=policy)
    assert "read as attribute '.eval' in the training loop" in str(err.value)
    assert str(err.value.where).endswith(f"algo.py:{marks['eval']}")


ATTRIBUTE_READS = '''
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff

@dataclass(frozen=True)
class Args:
    variant: str = "helper"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 2)
        self.epsilon = 1.0
        self.n_updates = 0
    def bump(self):               # (only the learner calls it)
        self.n_updates = self.n_updates + 1
    def forward(self, x):
        return self.head(self.drop(torch.relu(self.fc(x))))

def read_eps(m):
    return m.epsilon

@ff.fragment("actor")
def act(net, obs, variant: str):
    eps = read_eps(net) if variant == "helper" else getattr(net, "epsilon") if variant == "getattr" else 0.0
    with torch.no_grad():
        greedy = net(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()
    return np.where(eps > 0.5, 0, greedy).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch, variant: str):   # @learn
    net = state["net"]
    if variant in ("helper", "getattr"):
        net.epsilon = net.epsilon * 0.5
    elif variant == "dropout":
        net.drop.p = max(0.0, net.drop.p - 0.1)   # a schedule of torch's own module's attribute
    net.bump()
    return state, {"obs": batch["obs"].mean()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    state = ff.versioned({"net": Net()})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(3):
        for _ in range(4):
            a = act(state["net"], obs, args.variant)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        state, m = learn(state, buf.collect(), args.variant)
        ff.log(m)
    return state
'''


@pytest.mark.parametrize(("variant", "names"), [
    ("helper", "state['net'].epsilon (a float attribute of Net)"),        # read through a helper function
    ("getattr", "state['net'].epsilon (a float attribute of Net)"),       # getattr(net, "epsilon")
    ("dropout", "state['net'].drop.p (a float attribute of Dropout)"),    # torch's own forward reads it
    ("counter", None),                                                     # only the learner's method reads it
])
def test_what_the_actor_reads_of_a_modules_plain_attributes_is_followed(write_algo, variant, names):
    """The plain-attribute refusal followed only the actor's own text and the module class's methods,
    all of them (probe helper): a counter a method only the learner calls updates was refused; an
    epsilon read through a helper function or getattr, and a Dropout's p annealed by the learner,
    ran with the first value apart. It follows what runs: the actor's code, the module-level
    functions it calls, string names, the modules' forward and the methods that code names."""
    from fragflow.errors import PlacementError

    path, marks = write_algo(ATTRIBUTE_READS)
    program = load(str(path))
    args = program.args_cls(variant=variant)
    ff.run(program.train, args, policy="single_process")
    if names is None:
        ff.run(program.train, args, policy="pipelined(max_lag=0)")
        return
    with pytest.raises(PlacementError) as err:
        ff.run(program.train, args, policy="pipelined(max_lag=0)")
    assert f"learner 'learn' changes {names}" in str(err.value)
    assert str(err.value.where).endswith(f"algo.py:{marks['learn'] - 1}")
