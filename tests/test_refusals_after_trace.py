"""Programs that change after the trace, or in ways only another process notices: each is refused
at the user's line with a fix where single_process fails or differs (helper round 41's programs)."""

from __future__ import annotations

import csv

import pytest

import fragflow as ff
from fragflow.driver import compile
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


FLOAT_RANGE = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, np.float64(2.0)

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, k = learn(state, buf.collect())
        for _ in range(k):   # @range
            ff.log({"x": 1.0})
    return state
"""


@pytest.mark.parametrize("policy", ["single_process", "pipelined"])
def test_a_float_learner_output_given_to_range_fails_as_eagerly_under_every_policy(write_algo, policy):
    """range() of a numpy float a learner returned is Python's TypeError eagerly; where the trace
    handed the loop a probe of it, the error named the probe's class ('ProbeFloat64' object cannot be
    interpreted as an integer): probes carry their base's name into Python's messages."""
    path, marks = write_algo(FLOAT_RANGE, "float_range.py")
    program = load(str(path))
    with pytest.raises(TypeError, match=r"^'numpy\.float64' object cannot be interpreted as an integer$"):
        program.train()
    with pytest.raises(TypeError, match=r"^'numpy\.float64' object cannot be interpreted as an integer$"):
        ff.run(program.train, policy=policy)


UNPACKED = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    how: str = "star"

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    new = {"w": state["w"] + 1e-3 * batch["obs"].mean()}
    return new, {"loss": float(np.abs(new["w"]).sum()), "obs": float(batch["obs"].mean())}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for n in range(6):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        if args.how == "star":
            ff.log({**metrics, "n": n, "keys": len(metrics)})
        elif args.how == "union":
            ff.log(metrics | {"n": n, "keys": len(metrics)})
        elif args.how == "get":
            ff.log({"loss": metrics.get("loss"), "obs": metrics.copy()["obs"], "n": n, "keys": len(metrics)})
        elif args.how == "items":
            for k, v in metrics.items():
                ff.log({f"m/{k}": v})
        elif n == 4:   # (after the trace, which stops after two updates)
            ff.log({"first": metrics[0]})   # @index
    return state
"""


@pytest.mark.parametrize("how", ["star", "union", "get", "items"])
def test_a_learner_output_dict_unpacked_or_walked_in_the_loop_logs_as_single_process_does(
        write_algo, tmp_path, how):
    """The loop unpacks a learner's metrics into a dict of its own (``{**metrics, "n": n}``) or walks
    their items: refused where the learner runs apart (its keys were in the other process); the keys
    are those traced, each value an output of its own, and the rows equal single_process's."""
    path, _ = write_algo(UNPACKED, "unpacked.py")
    program = load(str(path))
    rows = {}
    for policy in ("single_process", "pipelined"):
        out = tmp_path / policy
        ff.run(program.train, program.args_cls(how=how), policy=policy, out=str(out))
        with open(out / "metrics.csv") as f:
            table = list(csv.DictReader(f))
        rows[policy] = [{k: v for k, v in r.items() if k.startswith(("m/", "loss", "obs", "n", "keys", "env_steps"))}
                        for r in table]
    assert rows["pipelined"] == rows["single_process"]
    assert len(rows["pipelined"]) == 6 and all(k in rows["pipelined"][0] for k in
                                               (("m/loss", "m/obs") if how == "items" else ("loss", "obs", "n", "keys")))


def test_a_learner_output_dict_indexed_by_a_key_it_lacks_fails_as_eagerly_with_the_reason(write_algo):
    """``metrics[0]`` on a dict is Python's KeyError eagerly; where the learner ran apart and the loop
    indexed it so only after the trace, the loop's reference took the position as a key and logged the
    first value as 'first'."""
    path, marks = write_algo(UNPACKED, "unpacked.py")
    program = load(str(path))
    with pytest.raises(KeyError):
        ff.run(program.train, program.args_cls(how="index"), policy="single_process")
    with pytest.raises(KeyError, match=r"output \[1\] of fragment 'learn' has no key 0: as traced it is a dict with "
                                       r"keys \['loss', 'obs'\]") as info:
        ff.run(program.train, program.args_cls(how="index"), policy="pipelined")
    assert isinstance(info.value, FragflowError) and info.value.where is not None
    assert info.value.where.line == marks["index"]


TUPLE_OUT = """
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import fragflow as ff

Metrics = namedtuple("Metrics", ["r", "double", "triple"])

@dataclass(frozen=True)
class Args:
    how: str = "neg"

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    r = float(batch["obs"].mean())
    return {"w": state["w"] + 1e-3 * r}, Metrics(r, 2 * r, 3 * r)

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for n in range(6):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        if args.how == "neg":
            ff.log({"last": metrics[-1], "x": metrics[-2], "y": metrics[0]})
        elif args.how == "fields":
            ff.log({"a": metrics.double, "b": metrics.triple, "y": metrics._asdict()["r"]})
        else:
            a, b = metrics[1:]
            ff.log({"a": a, "b": b})
    return state
"""


@pytest.mark.parametrize("how", ["neg", "slice", "fields"])
def test_a_tuple_learner_output_indexed_from_its_end_or_sliced_logs_as_single_process_does(write_algo, tmp_path, how):
    """``metrics[-1]`` and ``metrics[1:]`` of a tuple a learner returned: where it ran apart the loop's
    reference kept -1 (a slice) as the path, which named no reported entry: the columns were missing,
    silently. A namedtuple's fields by name (``metrics.double``, ``metrics._asdict()``) were refused."""
    path, _ = write_algo(TUPLE_OUT, "tuple_out.py")
    program = load(str(path))
    tables = {}
    for policy in ("single_process", "pipelined(max_lag=0)"):
        out = tmp_path / policy
        ff.run(program.train, program.args_cls(how=how), policy=policy, out=str(out))
        with open(out / "metrics.csv") as f:
            tables[policy] = [{k: v for k, v in r.items() if k in ("last", "x", "y", "a", "b")} for r in csv.DictReader(f)]
    assert tables["pipelined(max_lag=0)"] == tables["single_process"]
    assert len(tables["single_process"]) == 6 and all(v != "" for r in tables["single_process"] for v in r.values())
    assert set(tables["single_process"][0]) == {"neg": {"last", "x", "y"}, "slice": {"a", "b"}, "fields": {"a", "b", "y"}}[how]


LATE_KEY = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    how: str = "missing"

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch, n):
    r = float(batch["obs"].mean())
    m = {"r": r, "none": None}
    if n < 40:
        m["late"] = 2 * r
    return {"w": state["w"] + 1e-3 * r}, m

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for n in range(50):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect(), n)
        if args.how == "missing":
            ff.log({"late": metrics["late"], "r": metrics["r"]})
        else:
            ff.log({"none": metrics["none"], "r": metrics["r"]})
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined", "async_relaxed"])
def test_a_logged_key_a_later_learner_call_lacks_is_said_not_lost_silently(write_algo, tmp_path, policy):
    """The loop logs ``metrics["late"]``, a key the learner returned while traced and stops returning
    at its 41st call: eagerly a KeyError at the ff.log line; where the learner runs apart the rows
    missed it without a word. A None it returns (``metrics["none"]``) writes nothing, as eagerly,
    and is not said."""
    path, _ = write_algo(LATE_KEY, "late_key.py")
    program = load(str(path))
    with pytest.raises(KeyError):
        ff.run(program.train, program.args_cls(), policy="single_process", out=str(tmp_path / "sp"))
    notes = {}
    for how in ("missing", "none"):
        out = tmp_path / how
        result = ff.run(program.train, program.args_cls(how=how), policy=policy, out=str(out))
        notes[how] = [n for n in result.summary.get("notes", []) if "did not return" in n]
        with open(out / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 50 and all(r["r"] != "" for r in rows)
        if how == "missing" and policy == "pipelined":   # (each update's row has its own call's values)
            assert [r["late"] != "" for r in rows] == [True] * 40 + [False] * 10
        elif how == "missing":   # (calls gathered on arrival from two actors: which row misses it varies)
            assert rows[0]["late"] != "" and rows[-1]["late"] == ""
        else:
            assert "none" not in rows[0]
    assert len(notes["missing"]) == 1 and "'late'" in notes["missing"][0] and "'learn'" in notes["missing"][0]
    assert notes["none"] == []


@pytest.mark.parametrize("use, what", [(lambda m: f"{m:.4f}", "formatted with a spec"), (lambda m: -m, "used in arithmetic"),
                                       (lambda m: 1.0 - m, "used in arithmetic"), (lambda m: m % 2, "used in arithmetic")])
def test_a_learner_output_read_after_the_trace_is_named_as_the_learners_output_not_versioned_state(use, what):
    """``print(f"{m['loss']:.4f}")`` at an update the trace did not reach, where the learner runs
    apart: the refusal said "versioned state was formatted", of a learner's metric (helper round 44)."""
    from fragflow.api.versioned import Pending

    with pytest.raises(FragflowError, match=rf"output \[1\]\['loss'\] of fragment 'learn' was {what}"):
        use(Pending("learn", 1, ("loss",)))


LATE_CHANGE = """
from dataclasses import dataclass

import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    loop_changes: bool = False
    freeze: bool = False

@ff.fragment("actor")
def act(q, obs, n, freeze):   # @act
    if n >= 3 and freeze:   # freezes the layer (eagerly the learner stops learning it)
        q.weight.requires_grad_(False)
    elif n >= 3:   # once its exploration ends: after the calls the trace checks in full
        with torch.no_grad():
            q.weight.mul_(0.999)
    with torch.no_grad():
        return q(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    loss = state["q"](torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {"loss": loss.detach()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    q = torch.nn.Linear(4, 2)
    state = ff.versioned({"q": q, "opt": torch.optim.SGD(q.parameters(), lr=0.1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    n = 0
    for _ in range(4):
        for _ in range(4):
            obs, *_ = env.step(act(state["q"], obs, n if not args.loop_changes else 0, args.freeze))
            buf.add(obs=obs)
            n += 1
        if args.loop_changes:
            with torch.no_grad():
                q.weight.mul_(0.999)   # @loop
        state, metrics = learn(state, buf.collect())
    return state
"""


def test_an_actor_changing_the_state_it_reads_after_its_first_calls_is_named_not_the_loop(write_algo):
    """An actor that changes a parameter in place once its exploration ends (after the calls the
    trace checks in full): the refusal said the training loop changed it, at the learner's line
    (helper round 44); it names the actor. The loop's own change is still the loop's."""
    path, marks = write_algo(LATE_CHANGE, "late_change.py")
    program = load(str(path))
    assert ff.run(program.train, program.args_cls(), policy="single_process").summary["updates"] == 4
    with pytest.raises(PlacementError, match=r"actor fragment 'act' changes the versioned state 'state' "
                                             r"\(state\['q'\]\['weight'\], in a call after its first\) in place") as info:
        ff.run(program.train, program.args_cls(), policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["act"] - 1   # (the decorator's line)
    # a layer it freezes then (requires_grad_(False)): the learner's copy, apart, learned on, unsaid
    assert not ff.run(program.train, program.args_cls(freeze=True), policy="single_process").value["q"].weight.requires_grad
    with pytest.raises(PlacementError, match=r"actor fragment 'act' changes the versioned state 'state' \(the "
                                             r"requires_grad of its tensors, in a call after its first\) in place"):
        ff.run(program.train, program.args_cls(freeze=True), policy="pipelined")
    with pytest.raises(FragflowError, match=r"the training loop changes versioned state 'state' in place") as info:
        ff.run(program.train, program.args_cls(loop_changes=True), policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["loop"]


DTYPES = """
from dataclasses import dataclass

import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    warmup: int = 3

@ff.fragment("actor")
def act(q, obs, key, explore):   # @act
    if explore:   # random actions in the warm-up, int32; greedy ones after it, int64 (as eagerly, a buffer casts)
        return (ff.random.uniform(key, ()) * 2).astype(np.int32)
    with torch.no_grad():
        return q(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
    chosen = state["q"](obs).gather(1, torch.as_tensor(batch["action"], dtype=torch.int64)[:, None])
    loss = chosen.pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {"loss": loss.detach()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    q = torch.nn.Linear(4, 2)
    state = ff.versioned({"q": q, "opt": torch.optim.SGD(q.parameters(), lr=0.1)})
    rb = ff.ReplayBuffer(64, seed=0)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    for step in range(12):
        key, sub = ff.random.split(key)
        action = act(state["q"], obs, sub, step < args.warmup)
        next_obs, reward, terminated, truncated, info = env.step(action)
        rb.add(obs=obs, action=action, reward=reward)
        obs = next_obs
        if step >= args.warmup:
            state, metrics = learn(state, rb.sample(8))
            ff.log(metrics)
    return state
"""


def test_an_actor_whose_output_dtype_changes_runs_under_single_process_as_eagerly(write_algo):
    """int32 random actions in a warm-up, int64 greedy ones after it: eagerly the replay buffer casts
    them, and the program runs; single_process refused it at the trace (helper round 44). A policy of
    several processes, whose channels carry the first call's dtypes, refuses it at placement."""
    from fragflow.errors import ShapeChangedError

    path, marks = write_algo(DTYPES, "dtypes.py")
    program = load(str(path))
    eager = program.train(program.args_cls())
    ran = ff.run(program.train, program.args_cls(), policy="single_process")
    assert ran.summary["updates"] == 9
    assert torch_equal(ran.value["q"].weight, eager["q"].weight)
    with pytest.raises(ShapeChangedError, match=r"fragment 'act' changed the dtypes of its output between calls:\n"
                                                r"    before: out: i32\[2\]\n    now:    out: i64\[2\]") as info:
        ff.run(program.train, program.args_cls(), policy="pipelined")
    assert info.value.where is not None and info.value.where.line == marks["act"] - 1   # (the decorator's line)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


KIND_CHANGING = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    how: str = "list"
    updates: int = 12

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, obs, n, how):
    new = {"w": state["w"] + 1e-3 * obs.mean()}
    if how == "nested":   # per-epoch values, fewer after an early stop: what is inside an output may change
        return new, {"loss": float(n), "kls": [float(n)] * (1 + n % 3), "pair": (1.0, 2.0) if n % 2 else [1.0, 2.0]}
    if n % 7 == 6:   # (the 7th call: after the trace)
        if how == "list":
            return new, [float(n), -1.0]
        if how == "float":
            return new, float(n)
        return new, {"loss": float(n), "extra": 1.0}   # a metric now and then: allowed
    return new, {"loss": float(n)}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    obs = env.reset()
    for n in range(args.updates):
        obs, *_ = env.step(act(state, obs))
        state, metrics = learn(state, obs, n, args.how)   # @learn
        if isinstance(metrics, dict):
            ff.log(metrics)
        else:
            ff.log({"loss": metrics[0] if isinstance(metrics, list) else metrics})
    return state
"""


@pytest.mark.parametrize("how, now", [("list", "a list of 2"), ("float", "a value")])
@pytest.mark.parametrize("policy", ["pipelined", "central_inference(env_workers=1)"])
def test_a_learner_whose_metrics_change_kind_after_the_trace_is_refused_where_the_loop_holds_the_traced_kind(
        write_algo, tmp_path, how, now, policy):
    """A dict of metrics on most calls, a list (or a number) on some: the loop, in another process,
    held the traced dict, so its ``isinstance(metrics, dict)`` took the other branch from eagerly's
    and the values went to columns named 0, 1 or value, with no word (probe helper). Refused at the
    call that changed it; a dict gaining a key now and then still runs."""
    path, marks = write_algo(KIND_CHANGING, "kinds.py")
    program = load(str(path))
    ff.run(program.train, program.args_cls(how=how), policy="single_process")   # (eagerly's: runs)
    with pytest.raises(SpecChangedError, match=rf"fragment 'learn' returned another kind of output at its call 7 "
                                               rf"than its traced calls \(outputs\[1\]: a dict, now {now}\)") as info:
        ff.run(program.train, program.args_cls(how=how), policy=policy)
    assert info.value.where is not None and info.value.where.line == marks["learn"]
    for kind in ("keys", "nested"):   # (a dict whose keys come and go, or whose list of values changes length)
        one = ff.run(program.train, program.args_cls(how=kind), policy="single_process", out=tmp_path / f"one_{kind}")
        other = ff.run(program.train, program.args_cls(how=kind), policy=policy, out=tmp_path / f"other_{kind}")
        assert one.summary["status"] == other.summary["status"] == "completed"


SAVED = """
import pickle
import numpy as np
import torch
import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, obs):
    w = state["w"] * 0.5 + obs.mean()
    return {{"w": w}}, {{"loss": {loss}}}

def train(path):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({{"w": np.zeros(2)}})
    obs = env.reset()
    for u in range(6):
        obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
        state, m = learn(state, obs)
        if u >= {first}:
            {use}   # @use
    return state
"""


@pytest.mark.parametrize("loss", ["float(w.sum())", "w.copy()", "torch.as_tensor(w.sum())"])
@pytest.mark.parametrize("use", ["torch.save(m, path)", "pickle.dumps(m)", "pickle.dumps([m['loss']])"])
def test_a_learner_output_the_loop_pickles_is_refused_at_its_line_where_the_learner_runs_apart(
        write_algo, tmp_path, loss, use):
    """torch.save(m) of a learner's metrics in the loop ran under single_process; under pipelined
    the trace's own pickling went unseen, and the run failed in the worker with pickle's "args[0]
    from __newobj__ args has the wrong class", the file overwritten with a torn one (probe helper).
    Refused at the trace, at its line; first pickled after the trace, at the call."""
    from fragflow.errors import LearnerOutputOnActingSideError, VersionedStateError

    path, marks = write_algo(SAVED.format(loss=loss, use=use, first=0))
    program = load(str(path))
    ff.run(program.train, str(tmp_path / "m.pt"), policy="single_process")
    with pytest.raises(LearnerOutputOnActingSideError, match=r"output \[1\]\['loss'\] of learner 'learn' is pickled "
                                                             r"\(torch.save, pickle.dump\) in the training loop") as err:
        compile(program.train, str(tmp_path / "m.pt"), policy="pipelined")
    assert err.value.where is not None and err.value.where.line == marks["use"]
    path, marks = write_algo(SAVED.format(loss=loss, use=use, first=4), "late.py")
    program = load(str(path))
    with pytest.raises(VersionedStateError, match=r"of fragment 'learn' was pickled \(torch.save, pickle.dump\) in "
                                                  r"the loop, but that fragment runs in another process") as err:
        ff.run(program.train, str(tmp_path / "late.pt"), policy="pipelined")
    assert err.value.where is not None and err.value.where.line == marks["use"]


def test_a_list_of_learner_outputs_stacked_by_torch_in_the_loop_is_refused_at_its_line(write_algo):
    """torch.stack(losses[-3:]) of learner outputs kept in a list: the trace looked for a probe among
    the operation's arguments, not in a list among them, and the run failed in the worker with
    torch's "expected Tensor as element 0 in argument 0, but got Pending" (probe helper)."""
    from fragflow.errors import LearnerOutputOnActingSideError

    path, marks = write_algo(SAVED.format(loss="torch.as_tensor(w.sum())", first=0,
                                          use="print(torch.stack([m['loss'], m['loss']]).mean())"))
    program = load(str(path))
    ff.run(program.train, "", policy="single_process")
    with pytest.raises(LearnerOutputOnActingSideError, match=r"output \[1\]\['loss'\] of learner 'learn' is used in a "
                                                             r"torch operation \(stack\) in the training loop") as err:
        compile(program.train, "", policy="pipelined")
    assert err.value.where is not None and err.value.where.line == marks["use"]


@pytest.mark.parametrize("loss", ["float(w.sum())", "w.copy()", "torch.as_tensor(w.sum())", "np.float32(w.sum())"])
@pytest.mark.parametrize("use", ["print(m['loss'])", "print(f\"loss {m['loss']}\")", "print(str(m['loss']))"])
def test_a_learner_output_the_loop_prints_is_said_to_print_a_placeholder_where_the_learner_runs_apart(
        write_algo, tmp_path, loss, use):
    """print(f"loss {m['loss']}") printed numbers while traced and `Pending(learn[1]['loss'])` from then
    on where the learner runs apart, without a word (probe helper). Printing is no read (the run goes
    on), but the run says so, at the print's line, once: in its notes and on stderr."""
    from fragflow import driver

    path, marks = write_algo(SAVED.format(loss=loss, use=use, first=0))
    program = load(str(path))
    one = driver.run(program.train, "", policy="single_process", progress=False)
    assert not [n for n in one.summary.get("notes", []) if "placeholder" in n]
    run = driver.run(program.train, "", policy="pipelined", out=tmp_path / "run", progress=False)
    assert [n for n in run.summary.get("notes", []) if "placeholder" in n] == [
        f"{relpath_text(path)}:{marks['use']}: the loop prints output [1]['loss'] of learner 'learn', which runs in "
        "another process under policy 'pipelined': it prints a placeholder (Pending(learn[1]['loss'])), not the "
        "value (log it with ff.log: metrics.csv and the progress line show it; or run with --policy single_process)"]


def relpath_text(p: object) -> str:
    from fragflow.source import display_path

    return display_path(str(p))


def test_versioned_state_the_loop_prints_is_said_to_print_a_placeholder_where_its_learner_runs_apart(write_algo, tmp_path):
    """print(state["n"]) after a learner wrote it printed `Versioned('state', v4)['n']` where the learner
    runs apart, without a word (probe helper); said once, at the print's line."""
    from fragflow import driver

    path, marks = write_algo('''
        import numpy as np
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, obs):
            return {"w": state["w"] * 0.5 + obs.mean(), "n": state["n"] + 1}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros(2), "n": 0})
            obs = env.reset()
            for u in range(6):
                obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
                state = learn(state, obs)
                print("n is", state["n"])   # @print
            return state
    ''')
    program = load(str(path))
    one = driver.run(program.train, None, policy="single_process", progress=False)
    assert not [n for n in one.summary.get("notes", []) if "placeholder" in n]
    run = driver.run(program.train, None, policy="pipelined", out=tmp_path / "run", progress=False)
    assert [n for n in run.summary.get("notes", []) if "placeholder" in n] == [
        f"{relpath_text(path)}:{marks['print']}: the loop prints versioned state 'state', which learner 'learn' writes "
        "in another process under policy 'pipelined': once written it prints a placeholder (Versioned('state', "
        "v1)...), not the value (return what you want to see from the learner and log it with ff.log; or run with "
        "--policy single_process)"]


def test_an_evaluation_env_made_without_evaluation_true_that_cannot_be_split_is_told_the_flag(write_algo):
    """A second env of one environment, stepped to evaluate after each update but made without
    evaluation=True, could not be split across two actors; the fix said to --set num_envs, which sets
    the training env's count, already even (probe helper). It names evaluation=True too."""
    path, _ = write_algo('''
        import numpy as np
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, obs):
            return {"w": state["w"] * 0.5 + obs.mean()}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            ev = ff.envs.make("CartPole-v1", num_envs=1, seed=100)
            state = ff.versioned({"w": np.zeros(2)})
            obs, eobs = env.reset(), ev.reset()
            for u in range(4):
                obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
                state = learn(state, obs)
                eobs, *_ = ev.step(np.zeros(1, dtype=np.int64))
            return state
    ''')
    program = load(str(path))
    with pytest.raises(ff.errors.ConfigError, match=r"splits the loop's 1 environments across 2 processes(.|\n)*fix: .*"
                                                    r"; if this env evaluates, apart from the training envs, make it "
                                                    r"with ff.envs.make\(\.\.\., evaluation=True\)"):
        compile(program.train, None, policy="actor_learner(actors=2, max_lag=0)")


OWN_RING_RNG = '''
import numpy as np
import fragflow as ff

class Ring:
    def __init__(self, n, seed):
        self.obs, self.i, self.n = np.zeros((n, 4), np.float32), 0, n
        self.rng = np.random.default_rng(seed)

    @ff.fragment("buffer")
    def add(self, obs):
        self.obs[np.arange(self.i, self.i + len(obs)) % self.n] = obs
        self.i += len(obs)

    @ff.fragment("buffer")
    def sample(self, size):
        return {"obs": self.obs[self.rng.integers(0, min(self.i, self.n), size)]}

class Noise:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, n):
        return self.rng.normal(size=n)

@ff.fragment("actor")
def act(w, obs, eps):
    return ((obs @ w).argmax(-1) + (eps > 9.0)).clip(0, 1).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 0.01 * batch["obs"].mean(0)[:, None] * np.array([[1.0, -1.0]])}, {"m": batch["obs"].mean()}

def train(noisy=False):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    ring, noise = Ring(64, seed=0), Noise(1)
    obs = env.reset()
    for step in range(40):
        ring.add(obs)
        obs, *_ = env.step(act(state["w"], obs, noise(env.num_envs) if noisy else np.zeros(env.num_envs)))
        if step >= 8 and step % 4 == 0:
            state, m = learn(state, ring.sample(16))
            ff.log(m)
    return state
'''


@pytest.mark.parametrize("noisy", [False, True])
def test_a_generator_of_the_users_object_is_named_only_where_the_loops_copy_draws(write_algo, tmp_path, noisy):
    """A replay buffer of the user's own holding `self.rng`, under learner_replay (the buffer beside
    the learner, drawing there): the run warned that the loop processes' copies repeat their numbers,
    though no loop drew from it (probe helper). An object's generator is named once the loop's copy
    draws (an exploration-noise object called in the loop still is)."""
    from fragflow import driver

    path, _ = write_algo(OWN_RING_RNG, "ring.py")
    program = load(str(path))
    run = driver.run(program.train, noisy, policy="learner_replay(actors=2, max_lag=0)", out=tmp_path / "run",
                     progress=False)
    named = [n for n in run.summary.get("notes", []) if "holds or reads the random generator" in n]
    assert [("`noise.rng`" in n, "`ring.rng`" in n) for n in named] == ([(True, False)] if noisy else [])
