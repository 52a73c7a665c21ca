"""Programs that change after the trace, or in ways only another process notices: each is refused
at the user's line with a fix where single_process fails or differs (helper round 41's programs)."""

from __future__ import annotations

import csv

import pytest

import fragflow as ff
from fragflow.errors import FragflowError, PlacementError, SpecChangedError
from fragflow.program import load

CHANGING = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    how: str = "none"
    updates: int = 6

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch, how, n):
    new = {"w": state["w"] + 1e-3 * batch["obs"].mean()}
    metrics = {"r": float(batch["obs"].mean())}
    if n == 4:   # (after the trace, which stops after two updates)
        if how == "one_out":
            return new
        if how == "extra_out":
            return new, metrics, 1.0
        if how == "str_metric":
            return new, {"r": "hello"}
    return new, metrics

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for n in range(args.updates):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect(), args.how, n)   # @learn
        ff.log(metrics)
    return state
"""


@pytest.mark.parametrize("how, got", [("one_out", "one value \\(not a tuple\\)"), ("extra_out", "a tuple of 3")])
def test_a_learner_returning_another_number_of_outputs_after_the_trace_is_refused_at_its_call(
        write_algo, how, got):
    """The loop, in another process, holds the traced outputs' count: one output fewer failed with an
    internal KeyError (no line, no fix), one more was dropped silently (single_process fails at the
    unpacking). Refused where the learner returns them, at the loop's line."""
    path, marks = write_algo(CHANGING, "changing.py")
    program = load(str(path))
    with pytest.raises(SpecChangedError, match=rf"fragment 'learn' returned {got} at its call 5, where the traced "
                                               r"calls returned a tuple of 2") as info:
        ff.run(program.train, program.args_cls(how=how), policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["learn"]
    assert "same number of outputs" in str(info.value)


def test_a_string_metric_a_learner_returns_after_the_trace_is_refused_as_single_process_refuses_it(write_algo, tmp_path):
    """A string the loop logs was refused at its ff.log line under single_process, and left out of
    metrics.csv silently where the learner runs apart."""
    path, marks = write_algo(CHANGING, "changing.py")
    program = load(str(path))
    with pytest.raises(FragflowError, match="of type str, not a number"):
        ff.run(program.train, program.args_cls(how="str_metric"), policy="single_process")
    with pytest.raises(FragflowError, match=r"output \[1\]\['r'\] of fragment 'learn', which the loop logs, is of "
                                            "type str, not a number") as info:
        ff.run(program.train, program.args_cls(how="str_metric"), policy="pipelined", out=tmp_path / "run")
    assert info.value.where is not None and info.value.where.line == marks["learn"]
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [r["r"] != "" for r in rows] == [True] * 4   # (the calls before it)


FREEZING = """
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")
def act(q, obs):   # @act
    q.weight.requires_grad_(False)   # freezes the layer (eagerly the learner stops learning it)
    with torch.no_grad():
        return q(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    loss = state["q"](torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {"loss": loss.detach()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    q = torch.nn.Linear(4, 2)
    state = ff.versioned({"q": q, "opt": torch.optim.SGD(q.parameters(), lr=0.1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            obs, *_ = env.step(act(state["q"], obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
    return state
"""


def test_an_actor_freezing_a_layer_of_the_versioned_state_is_refused_where_it_acts_apart(write_algo):
    """requires_grad_(False) in an actor: eagerly the learner stops learning that layer; apart, the
    learner's copy learned on and the run differed from single_process's, unsaid."""
    path, marks = write_algo(FREEZING, "freezing.py")
    program = load(str(path))
    frozen = ff.run(program.train, policy="single_process").value
    assert not frozen["q"].weight.requires_grad
    with pytest.raises(PlacementError, match=r"actor fragment 'act' changes the versioned state 'state' \(argument "
                                             r"'q': the requires_grad of its tensors\) in place") as info:
        ff.run(program.train, policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["act"] - 1   # (the decorator's line)


RANGE_OF_OUTPUT = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {"k": 2.0}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        for _ in range(int(metrics["k"])):   # @range
            ff.log({"x": 1.0})
    return state
"""


def test_a_learner_output_read_in_a_range_bound_is_refused_at_the_loops_line(write_algo):
    """The loop's trip counts are found by evaluating a range() bound again: a learner's output read
    there was refused at '<string>:1', not the user's line."""
    path, marks = write_algo(RANGE_OF_OUTPUT, "ranged.py")
    program = load(str(path))
    with pytest.raises(PlacementError, match="is converted to an int in the training loop") as info:
        ff.run(program.train, policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["range"]
    assert str(info.value.where.file).endswith("ranged.py")
