from __future__ import annotations

import re
import sys
import textwrap

import numpy as np
import pytest

import fragflow as ff
from fragflow.compiler.ir import EdgeKind, NodeKind
from fragflow.compiler.printer import format_graph
from fragflow.driver import compile
from fragflow.errors import (
    LearnerOutputOnActingSideError,
    NoFragmentError,
    NotArrayPytreeError,
    PlacementError,
    ShapeChangedError,
    TraceError,
    VersionedStateError,
)
from fragflow.program import load
from tests.conftest import ROOT, relpath
from tests.fakes import tiny
from tests.test_multiprocess import same_tree

HEADER = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(params, obs):
    return np.argmax(obs @ params["w"], axis=-1)

@ff.fragment("learner")
def learn(state, batch):
    return {"w": state["w"] + batch["obs"].mean()}, {"m": batch["obs"].mean()}
"""


def trace_file(path):
    program = load(str(path))
    return ff.trace(program.train, *(() if program.args_cls is None else (program.args_cls(),)))


def test_golden_text_of_tiny_algorithm():
    graph = ff.trace(tiny.train, tiny.Args())
    assert format_graph(graph) == (ROOT / "tests/golden/tiny.txt").read_text()


def test_ppo_graph_has_roles_rates_state_and_trajectory_edge():
    from fragflow.algorithms import ppo

    graph = ff.trace(ppo.train, ppo.Args(num_envs=2, num_steps=16, total_timesteps=2048))
    roles = {n.name: n.role for n in graph.fragments()}
    assert roles == {"env.reset": "env", "act": "actor", "env.step": "env", "buffer.add": "buffer",
                     "buffer.collect": "buffer", "learn": "learner", "log": "logger"}
    assert graph.node("act").rate == 16 and graph.node("learn").rate == 1 and graph.node("env.reset").rate == 0
    assert graph.node("act").backend == "numpy"   # (act computes in numpy; its parameters are tensors)
    assert graph.node("act").defined_at.file == "algorithms/ppo.py"
    state = [n for n in graph.nodes if n.kind is NodeKind.STATE]
    assert [s.versions for s in state] == [3]
    reads = [(e.dst, e.src_port) for e in graph.edges_of(EdgeKind.STATE_READ)]
    assert ("act", "['params']") in reads and ("learn", "") in reads
    [traj] = [e for e in graph.edges if e.src == "buffer.collect" and e.dst == "learn"]
    obs = {leaf.dst_path: leaf for leaf in traj.leaves}["batch['obs']"]
    assert obs.spec.shape == (16, 2, 4) and obs.axis == 1 and obs.axis_name == "env"
    assert [e.src for e in graph.edges_of(EdgeKind.STATE_WRITE)] == ["learn"]


def test_trace_leaves_global_random_state_untouched():
    import random

    import torch

    before = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ff.trace(tiny.train, tiny.Args())
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert before != expected


def test_loop_without_fragment(write_algo):
    path, marks = write_algo("""
        import numpy as np

        def train():  # @def
            return np.zeros(3)
    """)
    with pytest.raises(NoFragmentError, match=rf"without calling a fragment\n  at {relpath(path)}:{marks['def']}\n  fix: mark"):
        trace_file(path)


def test_fragment_given_a_non_array(write_algo):
    path, marks = write_algo(HEADER + """
def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    obs = env.reset()
    act({"w": np.zeros((4, 2))}, {"not an array"})  # @call
""")
    with pytest.raises(NotArrayPytreeError, match=rf"argument 'obs' whose leaf obs is a builtins.set\n  at {relpath(path)}:{marks['call']}"):
        trace_file(path)


@pytest.mark.parametrize("out, leaf", [('{"action": obs, "note": object()}', r"\['note'\]"),
                                       ('obs, {"note": object()}', r"\[1\]\['note'\]")])
def test_fragment_returning_a_non_array(write_algo, out, leaf):
    path, marks = write_algo("""
        import fragflow as ff
        import numpy as np

        @ff.fragment("actor")  # @def
        def act(obs):
            return OUT

        def train():
            act(np.zeros(2))
    """.replace("OUT", out))
    with pytest.raises(NotArrayPytreeError, match=rf"returned a value whose leaf {leaf} is a builtins.object\n  at {relpath(path)}:{marks['def']}\n  fix: fragments return pytrees"):
        trace_file(path)


def test_fragment_whose_output_shape_changes(write_algo):
    path, marks = write_algo("""
        import fragflow as ff
        import numpy as np

        @ff.fragment("actor")  # @def
        def act(n):
            return np.zeros(n)

        def train():
            for n in range(1, 4):
                act(n)
    """)
    with pytest.raises(ShapeChangedError, match=rf"'act' changed its output between calls:\n    before: out: f64\[1\]\n    now:    out: f64\[2\]\n  at {relpath(path)}:{marks['def']}"):
        trace_file(path)


def test_a_fragment_output_that_is_sometimes_none_is_refused_naming_the_none(write_algo):
    """An output that was None in one call and an array in another was described by its leaves alone
    ("before: [0]: i64[2] / now: [0]: i64[2], [1]: f64[2]"): the None was never named. The message
    says which output was None in which call and an array in which, at the calls' lines, and how to
    return one every call."""
    path, marks = write_algo("""
        import fragflow as ff
        import numpy as np

        @ff.fragment("actor")  # @def
        def act(obs):
            a = np.argmax(obs, axis=-1)
            return a, (None if obs[0, 0] > 0 else a * 1.0)

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            for step in range(4):
                obs = np.full((2, 4), 1.0 if step == 0 else -1.0)
                a, extra = act(obs)  # @call
    """)
    where = f"{relpath(path)}:{marks['call']}"
    with pytest.raises(ShapeChangedError, match=(
            rf"'act' changed its output between calls:\n    before: \[0\]: i64\[2\], \[1\]: None\n"
            rf"    now:    \[0\]: i64\[2\], \[1\]: f64\[2\]\n"
            rf"    output \[1\] was None in one call \(at {where}\) and an f64\[2\] array in another \(at {where}\)"
            rf"[^\n]*\n  at {where}\n  fix: return an array of the same shape every call")) as info:
        trace_file(path)
    assert "np.zeros" in str(info.value) and "flag" in str(info.value)


def test_learner_output_used_as_plain_data_by_actor(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def scaled(params, obs, scale):
    return np.argmax(obs @ params["w"] * scale, axis=-1)

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act({"w": np.zeros((4, 2))}, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        scaled({"w": np.ones((4, 2))}, obs, metrics["m"])  # @misuse
""")
    program = load(str(path))
    trace_file(path)   # single_process runs such a loop as written
    with pytest.raises(LearnerOutputOnActingSideError,
                       match=rf"output \[1\]\['m'\] of learner 'learn' is used as plain data by actor fragment 'scaled' "
                             rf"\(argument 'scale'\), but policy 'pipelined' runs the learner in another process\n"
                             rf"  at {relpath(path)}:{marks['misuse']}\n  fix: the acting side only sees"):
        compile(program.train, policy="pipelined")


def test_versioned_state_read_in_the_loop_is_noted_where_first_read(write_algo):
    """The trace runs the read as eagerly (single_process runs it); placement refuses it elsewhere
    (tests/test_runtime_checks.py). A read before any learner wrote the state is not noted: every
    process holds the value the loop made."""
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state):
    return {"w": state["w"] + 1}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    obs = env.reset()
    if state["w"].any():   # (before any learner call: not a read of what a learner writes)
        pass
    for _ in range(2):
        obs, *_ = env.step(act(state["w"], obs))
        state, _ = learn(state)
        if state["w"].any():  # @misuse
            pass
        if state["w"].all():
            pass
""")
    graph = trace_file(path)
    assert graph.state_read is not None
    what, where = graph.state_read
    assert what == "read as attribute '.any'" and (relpath(path), where.line) == (relpath(path), marks["misuse"])


@pytest.mark.parametrize("how", ["global", "closure"])
def test_versioned_state_reached_through_a_global_or_a_closure_runs_as_eagerly_in_one_process_only(write_algo, how):
    """A fragment should receive versioned state as an argument: that is how a placement hands it
    the version it may act with. One that reaches it through a global or a closure runs under
    single_process exactly as eagerly (the variable holds the state's value while it runs), and
    every placement over several processes refuses it at its definition."""
    reach = {"global": """
STATE = None

@ff.fragment("actor")  # @def
def act_on(obs):
    return np.argmax(obs @ STATE["w"], axis=-1)

def train():
    global STATE
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    STATE = state
""", "closure": """
def train():
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})

    @ff.fragment("actor")  # @def
    def act_on(obs):
        return np.argmax(obs @ [state["w"]][0], axis=-1)
"""}[how]
    path, marks = write_algo(HEADER + """
@ff.fragment("learner")
def turn(state, batch):
    return {"w": state["w"] + np.outer(batch["obs"].mean(axis=(0, 1)), [1.0, -1.0]).astype(np.float32)}, {}
""" + reach + textwrap.indent(f"""
env = ff.envs.make("CartPole-v1", num_envs=2, seed=3)
buf = ff.RolloutBuffer(4)
actions = []
obs = env.reset()
for _ in range(6):
    for _ in range(4):
        action = act_on(obs)
        actions.append(action)
        obs, *_ = env.step(action)
        buf.add(obs=obs)
    state, _ = turn(state, buf.collect())
    {"STATE = state" if how == "global" else ""}
return np.concatenate(actions)
""", "    "))
    program = load(str(path))
    eager = program.train()
    assert eager.any() and not eager.all()   # the actor acts with each new version, not the first
    np.testing.assert_array_equal(ff.run(program.train, policy="single_process").value, eager)
    kind = "global 'STATE'" if how == "global" else "closure variable 'state'"
    for policy in ("pipelined", "actor_learner(actors=2)", "central_inference"):
        with pytest.raises(PlacementError, match=rf"actor fragment 'act_on' reads the versioned state 'state' through "
                                                 rf"the {kind} instead of receiving it as an argument, but policy "
                                                 rf"'{policy.split('(')[0]}' runs the program in several processes.*\n"
                                                 rf"  at {relpath(path)}:{marks['def']}\n  fix: add a parameter"):
            compile(program.train, policy=policy)


# a loop over two CartPoles that acts with `act` on the whole state and learns with `learn`
ROLLOUTS = """
def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({{"w": np.zeros((4, 2), np.float32)}})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range({updates}):
        for _ in range(2):
            obs, *_ = env.step({act}(state, obs))
            buf.add(obs=obs)
        state, metrics = {learn}(state, buf.collect())
"""


def test_a_learner_returning_its_metrics_where_the_new_state_goes_is_refused_at_its_definition(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("learner")  # @def
def learn_swapped(state, batch):
    return {"m": batch["obs"].mean()}, {"w": state["w"] + 1}
""" + ROLLOUTS.format(updates=2, act="act", learn="learn_swapped"))
    with pytest.raises(VersionedStateError, match=rf"learner 'learn_swapped' returned, as the next version of 'state', a "
                                                  rf"value that is not shaped like the state it was given \(missing: "
                                                  rf"\['w'\]; not in the state: \['m'\]\)\n  at {relpath(path)}:"
                                                  rf"{marks['def']}\n  fix: return the new state first"):
        trace_file(path)


def test_an_actor_changing_the_state_it_reads_in_place_is_refused_where_it_runs_apart_from_the_learner(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")  # @def
def act_and_nudge(params, obs):
    params["w"] += 0.001   # in place: only this process would see it
    return np.argmax(obs @ params["w"], axis=-1)
""" + ROLLOUTS.format(updates=3, act="act_and_nudge", learn="learn"))
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # one process: the change is seen, as eagerly
    with pytest.raises(PlacementError, match=rf"actor fragment 'act_and_nudge' changes the versioned state 'state' "
                                             rf"\(argument 'params'\) in place, but policy 'pipelined' runs it apart "
                                             rf"from the learner.*\n  at {relpath(path)}:{marks['def']}\n  fix: leave"):
        compile(program.train, policy="pipelined")


def test_an_actor_changing_a_torch_state_in_place_to_the_same_values_is_refused_where_it_runs_apart(write_algo):
    """The values do not change (a product on zeros), the tensor's version counter does."""
    path, marks = write_algo("""
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")  # @def
def act_scaled(params, obs):
    with torch.no_grad():
        params["w"].mul_(1.01)   # in place, on zeros: only this process would see it
        return (torch.as_tensor(obs) @ params["w"]).argmax(-1).numpy()

@ff.fragment("learner")
def learn(state, batch):
    return {"w": state["w"] + float(batch["obs"].mean())}, {"m": batch["obs"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({"w": torch.zeros((4, 2))})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act_scaled(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(PlacementError, match=rf"actor fragment 'act_scaled' changes the versioned state 'state' "
                                             rf"\(argument 'params'\) in place, but policy 'pipelined' runs it apart "
                                             rf"from the learner.*\n  at {relpath(path)}:{marks['def']}"):
        compile(program.train, policy="pipelined")


MODES = """
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")  # @def
def act(q, obs):
    {act_mode}
    with torch.no_grad():
        return q(torch.as_tensor(obs)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    {set_mode}
    loss = state["q"](torch.as_tensor(batch["obs"])).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    {end_mode}
    return state, {{"loss": loss.detach()}}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    torch.manual_seed(0)
    q = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    state = ff.versioned({{"q": q, "opt": torch.optim.SGD(q.parameters(), lr=0.1)}})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act(state["q"], obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
"""


def test_an_actor_setting_the_modes_of_the_state_s_modules_is_refused_apart_unless_the_learner_sets_them(write_algo):
    """An actor's q.eval() turns off the learner's dropout eagerly; apart, the learner's copy kept
    training mode and the run silently left single_process's. A learner that sets the mode itself
    learns alike wherever it runs."""
    # eagerly the one module: the learner then learns without dropout
    path, marks = write_algo(MODES.format(act_mode="q.eval()", set_mode="pass", end_mode="pass"))
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(PlacementError, match=rf"actor fragment 'act' changes the versioned state 'state' \(argument "
                                             rf"'q': the training mode of its modules.*\n  at {relpath(path)}:"
                                             rf"{marks['def']}\n  fix: set the mode in the learner too"):
        compile(program.train, policy="pipelined")
    path, _ = write_algo(MODES.format(act_mode="q.eval()", set_mode='state["q"].train()', end_mode="pass"))
    compile(load(str(path)).train, policy="pipelined")   # the learner sets its mode: placed


def test_the_mode_of_modules_it_changes_nothing_in_is_not_refused_apart(write_algo):
    """A plain MLP's .eval() in the actor (no dropout, no norm): its mode changes nothing it
    computes, so the actor runs apart from a learner that never sets it."""
    source = MODES.format(act_mode="q.eval()", set_mode="pass", end_mode="pass") \
        .replace("torch.nn.Dropout(0.5)", "torch.nn.Tanh()")
    assert "Dropout" not in source
    path, _ = write_algo(source)
    compile(load(str(path)).train, policy="pipelined")
    # a module of the user's own whose forward reads self.training is one whose mode matters
    source = source.replace("torch.nn.Tanh()", "Noisy()").replace("import torch\n", """import torch


class Noisy(torch.nn.Module):
    def forward(self, x):
        return x + torch.randn_like(x) if self.training else x
""", 1)
    assert "class Noisy" in source
    path, _ = write_algo(source)
    with pytest.raises(PlacementError, match="the training mode of its modules"):
        compile(load(str(path)).train, policy="pipelined")


def test_an_actor_acting_in_the_mode_a_learner_leaves_the_state_s_modules_in_is_refused_apart(write_algo):
    """The other way: a learner that ends with q.eval() has the actor act without dropout eagerly;
    apart, the actor's copy kept training mode (a version carries tensors, not modes)."""
    path, marks = write_algo(MODES.format(act_mode="pass", set_mode='state["q"].train()', end_mode='state["q"].eval()'))
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(PlacementError, match=rf"actor fragment 'act' acts with versioned state 'state' \(argument 'q'\), "
                                             rf"whose modules' mode learner 'learn' changes.*\n  at {relpath(path)}:"
                                             rf"{marks['def']}\n  fix: set the mode in 'act' itself"):
        compile(program.train, policy="pipelined")
    path, _ = write_algo(MODES.format(act_mode="q.eval()", set_mode='state["q"].train()', end_mode='state["q"].eval()'))
    compile(load(str(path)).train, policy="pipelined")   # the actor sets its mode: placed


def test_an_actor_reaching_a_module_of_the_state_through_a_global_is_refused_where_it_runs_apart(write_algo):
    path, marks = write_algo("""
import numpy as np
import torch
import fragflow as ff

MODEL = None

@ff.fragment("actor")  # @def
def act_global(obs):
    with torch.no_grad():
        return MODEL(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return state, {"m": float(batch["obs"].mean())}

def train():
    global MODEL
    model = torch.nn.Linear(4, 2)
    MODEL = model
    state = ff.versioned({"model": model})
    env = ff.envs.make("CartPole-v1", num_envs=2)
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act_global(obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # one process: the global is the learner's module
    with pytest.raises(PlacementError, match=rf"actor fragment 'act_global' reaches an object of the versioned state "
                                             rf"'state' through the global 'MODEL' instead of receiving the state as "
                                             rf"an argument, but policy 'pipelined' runs it apart from the learner.*"
                                             rf"\n  at {relpath(path)}:{marks['def']}\n  fix: add a parameter"):
        compile(program.train, policy="pipelined")


@pytest.mark.parametrize("holder", ["OPT", "SCHED[0]"])
def test_a_learner_reaching_the_states_optimizer_through_a_global_is_refused_over_several_processes(write_algo, holder):
    path, marks = write_algo("""
import numpy as np
import torch
import fragflow as ff

OPT = None
SCHED = []

@ff.fragment("actor")
def act(model, obs):
    with torch.no_grad():
        return model(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")  # @def
def learn(state, batch):
    loss = state["model"](torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    HOLDER.zero_grad() if HOLDER is OPT else HOLDER.optimizer.zero_grad()
    loss.backward()
    HOLDER.step()
    return state, {"loss": loss.detach()}

def train():
    global OPT
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    OPT = opt
    SCHED[:] = [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]
    state = ff.versioned({"model": model, "opt": opt})
    env = ff.envs.make("CartPole-v1", num_envs=2)
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act(state["model"], obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
""".replace("HOLDER", holder))
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # one process: the global is the state's optimizer
    name = holder.split("[")[0]
    with pytest.raises(PlacementError, match=rf"learner fragment 'learn' reaches an object of the versioned state "
                                             rf"'state' through the global '{name}' .*runs it in the learner's process"
                                             rf".*\n  at {relpath(path)}:{marks['def']}\n  fix: reach it through"):
        compile(program.train, policy="pipelined")


@pytest.mark.parametrize("change", ["opt.param_groups[0]['lr'] = 0.1 * (1 - update / 6)",   # CleanRL's annealing
                                    "sched.step()"])
def test_a_loop_changing_the_states_optimizer_is_refused_where_the_learner_runs_apart(write_algo, change):
    path, marks = write_algo("""
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")
def act(model, obs):
    with torch.no_grad():
        return model(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    loss = state["model"](torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {"lr": state["opt"].param_groups[0]["lr"]}

def train():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)   # a change every 10 steps: after the trace
    state = ff.versioned({"model": model, "opt": opt})
    env = ff.envs.make("CartPole-v1", num_envs=2)
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for update in range(6):
        BEFORE
        for _ in range(2):
            obs, *_ = env.step(act(state["model"], obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())  # @learn
        AFTER
""".replace("BEFORE" if "lr" in change else "AFTER", change).replace("BEFORE", "pass").replace("AFTER", "pass"))
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # one process: the learner's optimizer is the loop's
    with pytest.raises(PlacementError, match=r"the training loop changes the optimizer of versioned state 'state' "
                                             r"between calls of learner 'learn' .*runs 'learn' in another process"
                                             rf".*\n  at {relpath(path)}:{marks['learn']}\n  fix: keep the scheduler in the versioned state"):
        compile(program.train, policy="pipelined")


def test_learner_given_plain_state(write_algo):
    path, marks = write_algo(HEADER + """
def train():
    learn({"w": np.zeros(2)}, {"obs": np.zeros(2)})  # @call
""")
    with pytest.raises(VersionedStateError, match=rf"learner 'learn' writes 'state', but that argument is not versioned state\n  at {relpath(path)}:{marks['call']}\n  fix: create it with state = ff.versioned"):
        trace_file(path)


def test_unknown_role_and_bad_writes_fail_at_decoration(write_algo):
    with pytest.raises(TraceError, match="unknown fragment role 'critic'"):
        ff.fragment("critic")

    def act(x):
        return x

    with pytest.raises(TraceError, match=r"@ff.fragment on 'act' has no role(.|\n)*fix: give it its role: @ff.fragment"):
        ff.fragment(act)   # a bare @ff.fragment
    with pytest.raises(TraceError, match="declares writes='nope' but has no such parameter"):
        ff.fragment("learner", writes="nope")(lambda state: state)
    # (name=3 failed as a TypeError joining names once the run had begun, at no line, exit 1;
    # writes=["state"] as "unhashable type: 'list'")
    line = sys._getframe().f_lineno + 3
    with pytest.raises(TraceError, match=r"@ff.fragment got name=3, where it takes the fragment's name, a string\n"
                                         rf"  at tests/test_trace.py:{line}\n  fix: write @ff.fragment\(\"actor\""):
        ff.fragment("actor", name=3)
    with pytest.raises(TraceError, match=r"@ff.fragment got writes=\['state', 'target'\], where it takes the name of "
                                         r"the one parameter holding the versioned state the learner writes"):
        ff.fragment("learner", writes=["state", "target"])
    # a function marked twice: the same mark is the one fragment; two roles are refused at the first decorator
    # (it ran as a learner writing the actor's first argument, refused at the loop's call as "not versioned state")
    once = ff.fragment("actor")(act)
    assert ff.fragment("actor")(once) is once
    with pytest.raises(TraceError, match=r"fragment 'act' is marked twice \(@ff.fragment\(\"learner\"\) over "
                                         r"@ff.fragment\(\"actor\"\)\): a function has one role\n  at tests/test_trace.py:"
                                         r"\d+\n  fix: keep one decorator"):
        ff.fragment("learner")(once)
    # (name=["s"] failed as "unhashable type: 'list'" once traced; eagerly it was ignored)
    with pytest.raises(TraceError, match=r"ff.versioned got name=\['s'\], where it takes the state's name, a string"):
        ff.versioned({"w": np.zeros(2)}, name=["s"])


def test_a_partial_or_a_callable_object_as_a_fragment_is_refused_at_its_line_with_the_fix():
    """ff.fragment("actor")(functools.partial(_act, scale=2.0)) failed as "AttributeError: 'functools.partial'
    object has no attribute '__name__'" from fragflow's own code, exit code 1 (helper bad, B1)."""
    import functools

    def _act(state, obs, scale):
        return obs * scale

    class Policy:
        def __call__(self, obs):
            return obs

    line = sys._getframe().f_lineno + 3
    with pytest.raises(TraceError, match=r"@ff.fragment got functools.partial\(_act, scale=2.0\), not a function "
                                         rf"defined with def or lambda\n  at tests/test_trace.py:{line}\n  fix: "):
        ff.fragment("actor")(functools.partial(_act, scale=2.0))
    with pytest.raises(TraceError, match=r"@ff.fragment got a Policy object, not a function(.|\n)*fix: "):
        ff.fragment("learner", writes=None)(Policy())


@pytest.mark.parametrize("make, message", [
    (lambda: ff.RolloutBuffer(8.0), r"RolloutBuffer got num_steps=8.0, where it takes a whole number"),
    (lambda: ff.RolloutBuffer("8"), r"RolloutBuffer got num_steps='8', where it takes a whole number"),
    (lambda: ff.ReplayBuffer(1e3), r"ReplayBuffer got capacity=1000.0, where it takes a whole number"),
    (lambda: ff.ReplayBuffer(1e3, prioritized=True), r"ReplayBuffer got capacity=1000.0"),
])
def test_a_buffer_size_that_is_not_an_int_is_refused_at_its_line(make, message):
    """A float failed at the buffer's first add (RolloutBuffer, ReplayBuffer: TypeError) or at once
    (prioritized: AttributeError 'bit_length'), a string as "'<' not supported", none at a line of fragflow's."""
    with pytest.raises(TraceError, match=message + r"(.|\n)*fix: pass an int: ") as info:
        make()
    where = info.value.where   # the lambda's line, where the buffer is made
    assert where is not None and where.file == "tests/test_trace.py"
    owner = message.split()[0]
    assert f"lambda: ff.{owner}(" in (ROOT / where.file).read_text().splitlines()[where.line - 1]


def test_buffer_misuse(write_algo):
    path, marks = write_algo("""
        import numpy as np
        import fragflow as ff

        def train():
            buf = ff.RolloutBuffer(2)
            buf.add(x=np.zeros(2))
            buf.collect()  # @early
    """)
    with pytest.raises(TraceError, match=rf"buffer.collect called after 1 adds, expected num_steps=2\n  at {relpath(path)}:{marks['early']}"):
        trace_file(path)


def test_ir_knows_the_loops_around_each_call_and_their_trip_counts():
    from fragflow.algorithms import ppo

    args = ppo.Args(total_timesteps=8192, num_envs=4, num_steps=16)
    graph = ff.trace(ppo.train, args)          # tracing stops after two updates ...
    outer, inner = graph.loops_of("act")
    assert outer.trips == args.num_updates == 128 and inner.trips == 16   # ... the bounds are the run's
    assert [loop.header for loop in graph.loops_of("learn")] == ["for update in range(args.num_updates)"]
    assert graph.loops_of("env.reset") == []
    # rates come from the loops where they say: act runs num_steps times per learn, every trip
    assert graph.derived_rate("act") == 16 and graph.derived_rate("learn") == 1
    assert graph.derived_rate("env.reset") is None            # outside the loops: as traced (once)
    # learner outputs reach the loop as probes (compiler/probes.py); the IR names their own types
    logged = {leaf.spec.dtype for e in graph.edges if e.dst == "log" for leaf in e.leaves}
    assert logged == {"float"}


def test_rates_from_the_loops_are_not_claimed_under_an_if_or_an_early_exit():
    from fragflow.algorithms import dqn

    graph = ff.trace(dqn.train, dqn.Args(total_timesteps=1600, learning_starts=400, target_network_frequency=60,
                                         buffer_size=1000, batch_size=32))
    # learn runs every train_frequency steps after the warm-up: an if around it, so the rate is the traced one
    assert graph.derived_rate("act") is None and graph.derived_rate("sync_target") is None
    assert graph.rate_of("act") == graph.node("act").rate == 10


def test_the_trace_reports_how_far_it_has_run_the_loop(write_algo, monkeypatch):
    """A warm-up before the first update (DQN's 10k steps) is run through while tracing: the trace
    says how far it is (the CLI's spinner shows it)."""
    import itertools
    import time

    path, _ = write_algo(HEADER + """
def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for step in range(20):
        obs, *_ = env.step(act(state, obs))
        buf.add(obs=obs)
        if step % 2 == 1:
            batch = buf.collect()
            if step >= 9:   # a warm-up of 10 steps, then an update every 2
                state, metrics = learn(state, batch)
""")
    clock = itertools.count(step=1.0)
    monkeypatch.setattr(time, "monotonic", lambda: float(next(clock)))   # a second passes at every look
    heard: list[tuple[int, int]] = []
    compile(load(str(path)).train, policy="single_process", on_trace=lambda steps, updates: heard.append((steps, updates)))
    assert heard[:3] == [(0, 0), (2, 0), (4, 0)]        # reset, then 2 env steps per call of env.step
    assert heard[-1] == (24, 1)       # the 12th step; it stops at the second update, right after it
    assert heard == sorted(heard)


def test_ff_log_inside_a_fragment_is_refused_at_its_line(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def act_and_log(params, obs):
    ff.log({"q": float(obs.mean())})  # @misuse
    return np.argmax(obs @ params["w"], axis=-1)
""" + ROLLOUTS.format(updates=2, act="act_and_log", learn="learn"))
    with pytest.raises(TraceError, match=rf"ff.log was called inside fragment 'act_and_log': .*\n  at "
                                         rf"{relpath(path)}:{marks['misuse']}\n  fix: return the values"):
        trace_file(path)


@pytest.mark.parametrize("call, message, fix", [
    ('ff.log(loss=metrics["m"])', "ff.log takes one dict of scalars, but was given 0 positional arguments and "
                                     "keyword arguments loss", "log a dict: ff.log({'loss': loss})"),
    ("ff.log(metrics, step=1)", "ff.log takes no step: each row is logged at the run's own counters", "leave step out"),
    ('ff.log("loss", metrics["m"])', "ff.log takes one dict of scalars, but was given 2 positional arguments",
     "log a dict: ff.log({'loss': loss})"),
])
def test_ff_log_called_as_other_loggers_are_is_refused_at_its_line(write_algo, call, message, fix):
    """Each failed as "TypeError: _log() got an unexpected keyword argument" (or "takes 1 positional
    argument"), naming fragflow's function, not what ff.log takes."""
    path, marks = write_algo(HEADER + ROLLOUTS.format(updates=2, act="act", learn="learn")
                             + f"        {call}  # @log\n")
    with pytest.raises(TraceError, match=rf"{re.escape(message)}.*\n  at {relpath(path)}:{marks['log']}\n  fix: "
                                         rf"{re.escape(fix)}"):
        trace_file(path)
    ff.log(scalars={"loss": 0.5})   # (its parameter by name still goes)


def test_a_learner_changing_a_leafs_dtype_is_refused_at_its_definition(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("learner")  # @def
def learn_cast(state, batch):
    return {"w": (state["w"] + batch["obs"].mean()).astype(np.float64)}, {"m": batch["obs"].mean()}
""" + ROLLOUTS.format(updates=2, act="act", learn="learn_cast"))
    with pytest.raises(VersionedStateError, match=rf"learner 'learn_cast' returned, as the next version of 'state', "
                                                  rf"\['w'\] as f64\[4,2\] numpy, but the state it was given holds "
                                                  rf"f32\[4,2\] numpy\n  at {relpath(path)}:{marks['def']}\n  fix: keep"):
        trace_file(path)


def test_a_learner_changing_a_leafs_dtype_at_a_later_call_is_refused_at_that_call(write_algo):
    """The state made f64 and written f64, then f32 at the second call: the run refused the third
    call's f64, saying the state was traced as f32 (helper round 45)."""
    path, marks = write_algo(HEADER + """
@ff.fragment("learner")
def learn_cast(state, batch):
    n = state["w"].astype(np.float64).sum()
    return {"w": (state["w"] + batch["obs"].mean()).astype(np.float64 if n == 0 else np.float32)}, {}
""" + ROLLOUTS.format(updates=3, act="act", learn="learn_cast").replace(
        'state = ff.versioned({"w": np.zeros((4, 2), np.float32)})', 'state = ff.versioned({"w": np.zeros((4, 2))})'))
    with pytest.raises(VersionedStateError, match=r"learner 'learn_cast' returned, as the next version of 'state' at its "
                                                  r"call 2, \['w'\] as f32\[4,2\] numpy, but the state holds f64\[4,2\] "
                                                  r"numpy.*\n  at .*\n  fix: keep every leaf's shape, dtype and array "
                                                  r"library \(cast back: x.astype\(np.float64\)\)"):
        trace_file(path)


def test_a_sliced_view_of_state_runs_in_one_process_and_is_refused_at_its_line_by_the_others(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def act_rows(w, obs):
    return np.argmax(obs[:, :2] @ w, axis=-1)

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({"w": np.ones((4, 2), np.float32)})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(2):
        for _ in range(2):
            obs, *_ = env.step(act_rows(state["w"][:2], obs))  # @misuse
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
    return state
""")
    program = load(str(path))
    assert same_tree(ff.run(program.train, policy="single_process").value, program.train())   # as eagerly
    with pytest.raises(PlacementError, match=rf"fragment 'act_rows' reads the view state\['w'\]\[slice\(None, 2, None\)\] "
                                             rf".*\n  at {relpath(path)}:{marks['misuse']}\n  fix: pass state"):
        compile(program.train, policy="pipelined")


def test_environments_made_inside_a_fragment_are_refused_at_the_line(write_algo):
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def act_fresh(params, obs):
    probe = ff.envs.make("CartPole-v1", num_envs=1)  # @misuse
    return np.argmax(obs @ params["w"], axis=-1)
""" + ROLLOUTS.format(updates=2, act="act_fresh", learn="learn"))
    with pytest.raises(TraceError, match=rf"ff.envs.make was called inside fragment 'act_fresh': .*\n  at "
                                         rf"{relpath(path)}:{marks['misuse']}\n  fix: make the environments once"):
        trace_file(path)


def test_a_buffer_leaf_sized_for_every_environment_where_a_process_steps_half_is_refused_at_the_add(write_algo):
    path, marks = write_algo(HEADER + """
def train():
    env = ff.envs.make("CartPole-v1", num_envs=4)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    buf = ff.RolloutBuffer(2)
    done = np.zeros(4, bool)              # sized by the configuration, not by this process's share
    obs = env.reset()
    for _ in range(2):
        for _ in range(2):
            obs, reward, terminated, truncated, info = env.step(act(state, obs))
            buf.add(obs=obs, done=done)  # @add
            done = terminated | truncated
        state, metrics = learn(state, buf.collect())
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # 4 rows everywhere
    with pytest.raises(TraceError, match=rf"buffer.add got leaves with different numbers of rows: 'obs' 2, 'done' 4: "
                                         r"argument step\['done'\] has a row for every environment of the run, made in "
                                         rf"the loop .*where this process steps 2 of them\n  at {relpath(path)}:{marks['add']}"
                                         r"\n  fix: size per-environment arrays with env.num_envs") as info:
        ff.run(program.train, policy="actor_learner(actors=2)")
    assert "(in loop replica" not in str(info.value)   # (its advice is the message's own: not said twice)


def test_versioned_views_passed_through_star_args_run_in_one_process_and_are_refused_elsewhere(write_algo):
    """Eagerly a fragment may take state through *ws (it was refused under single_process too); a
    placement over several processes, which sends versions by parameter, refuses it at the call."""
    path, marks = write_algo(HEADER + """
@ff.fragment("actor")
def act_many(obs, *ws):
    return np.argmax(obs @ (ws[0] + ws[1]), axis=-1)

@ff.fragment("learner", writes="state")
def learn_w(state, obs):
    return {"w": state["w"] + obs.mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    obs = env.reset()
    for _ in range(6):
        obs, *_ = env.step(act_many(obs, state["w"], np.ones((4, 2), np.float32)))  # @misuse
        state = learn_w(state, obs)
    return state
""")
    program = load(str(path))
    eager = program.train()
    assert np.array_equal(ff.run(program.train, policy="single_process").value["w"], eager["w"])
    with pytest.raises(VersionedStateError, match=rf"versioned state Versioned\('state', v0\)\['w'\] reached fragment "
                                                  rf"'act_many' through its \*ws, but policy 'pipelined' sends versions "
                                                  rf"to other processes by parameter\n  at {relpath(path)}:{marks['misuse']}"
                                                  rf"\n  fix: give 'act_many' a named parameter"):
        compile(program.train, policy="pipelined")


def test_actor_and_learner_methods_of_one_object_are_refused_where_a_policy_would_split_them(write_algo):
    path, marks = write_algo(HEADER + """
class Agent:
    @ff.fragment("actor")
    def act(self, params, obs):
        return np.argmax(obs @ params["w"], axis=-1)

    @ff.fragment("learner", writes="state")  # @def
    def learn(self, state, batch):
        return {"w": state["w"] + batch["obs"].mean()}, {"m": batch["obs"].mean()}

def train():
    agent = Agent()
    env = ff.envs.make("CartPole-v1", num_envs=2)
    state = ff.versioned({"w": np.zeros((4, 2), np.float32)})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(2):
        for _ in range(2):
            obs, *_ = env.step(agent.act(state, obs))
            buf.add(obs=obs)
        state, metrics = agent.learn(state, buf.collect())
    return state
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(PlacementError, match=rf"actor fragment 'Agent.act' and learner fragment 'Agent.learn' are methods "
                                             rf"of one object \('agent'\).*\n  at {relpath(path)}:{marks['def']}\n  fix: "
                                             rf"make 'Agent.learn' a function of its own"):
        compile(program.train, policy="pipelined")


WARM_UP = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(params, obs):
    return np.argmax(obs @ params["w"], axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + batch["obs"].mean()}, {"m": batch["obs"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    rb = ff.ReplayBuffer(1000, seed=0)
    obs = env.reset()
    for step in range(400):
        if step % 37 == 36:
            obs = np.zeros((2, 4), np.float32)   # now and then the loop's own observation  # @loop
        action = act(state, obs)
        next_obs, reward, terminated, truncated, info = env.step(action)
        if step % 53 == 52:
            reward = np.ones(2)      # ... and its own reward
        rb.add(obs=obs, next_obs=info["final_obs"], action=action, reward=reward, done=terminated)
        obs = next_obs
        if step >= 300:              # a long warm-up before the first update
            state, metrics = learn(state, rb.sample(8))
            ff.log(metrics)
"""


SIZED_LATER = """
import numpy as np
import fragflow as ff

class MyEnv:
    def __init__(self, n):
        self.ids = ff.envs.ids(n)

    @ff.fragment("env")
    def reset(self):
        return np.zeros((len(self.ids), 4), np.float32), np.zeros((3,), np.float32)

@ff.fragment("actor")
def use(extra):
    return extra * 2

def train():
    env = MyEnv(2)
    for i in range(5):
        obs, extra = env.reset()
    ff.envs.ids(3)          # another number of environments asked for: outputs of 3 rows are env rows now
    obs, extra = env.reset()
    y = use(extra)
"""


@pytest.mark.parametrize("program", [WARM_UP, SIZED_LATER], ids=["warm_up", "sized_later"])
def test_a_long_warm_up_is_traced_to_the_same_graph_as_when_every_call_is_recorded(write_algo, monkeypatch, program):
    # calls like the previous one are counted without being recorded again: the graph must not change,
    # the edges the loop's own arrays make now and then included
    path, marks = write_algo(program)
    graph = trace_file(path)
    from fragflow.compiler import tracer

    monkeypatch.setattr(tracer.Tracer, "_repeated", lambda self, *a: tracer._NOT_REPEATED)
    assert graph == trace_file(path)
    if program is SIZED_LATER:
        assert graph.node("use").output_axes == (("", "env", 0),)
        return
    loop_obs = [e for e in graph.edges_of(EdgeKind.DATA) if e.src == "loop" and e.dst == "act"]
    assert len(loop_obs) == 1 and loop_obs[0].where.line == marks["loop"] + 1
    assert any(e.src == "loop" and e.dst == "replay.add" for e in graph.edges)


def test_a_fragment_whose_output_changes_after_many_calls_is_refused_as_at_its_second(write_algo):
    path, marks = write_algo("""
        import fragflow as ff
        import numpy as np

        @ff.fragment("actor")  # @def
        def act(obs):
            return obs[:, :2] if obs.shape[0] > 1 else obs

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=1, seed=0)
            obs = env.reset()
            for step in range(100):
                x = act(np.zeros((1 if step < 40 else 2, 4)))
    """)
    with pytest.raises(ShapeChangedError, match=rf"'act' changed its output between calls:\n    before: out: f64\[1,4\]\n    now:    out: f64\[2,2\]\n  at {relpath(path)}:{marks['def']}"):
        trace_file(path)


def test_a_bad_argument_after_many_calls_is_refused_at_its_line(write_algo):
    path, marks = write_algo("""
        import fragflow as ff
        import numpy as np

        @ff.fragment("actor")
        def act(x):
            return np.zeros(2, np.int64)

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            obs = env.reset()
            for step in range(20):
                x = obs if step < 10 else {"a": obs, "b": object()}
                action = act(x)  # @call
                obs, reward, terminated, truncated, info = env.step(action)
    """)
    with pytest.raises(NotArrayPytreeError, match=rf"leaf x\['b'\] is a builtins.object\n  at {relpath(path)}:{marks['call']}"):
        trace_file(path)


def test_data_one_fragment_changes_and_another_reads_is_refused_where_they_run_apart(write_algo):
    path, marks = write_algo("""
import numpy as np
import fragflow as ff

VISITS = np.zeros(2)

@ff.fragment("actor")  # @def
def act(w, obs):
    a = np.argmax(obs @ w, axis=-1)
    np.add.at(VISITS, a, 1)
    return a

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 / np.sqrt(1 + VISITS)}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act(state["w"], obs))
            buf.add(obs=obs)
        state, _ = learn(state, buf.collect())
    return state
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")   # one process: the learner sees the actor's counts
    with pytest.raises(PlacementError, match=rf"actor fragment 'act' changes the global 'VISITS' in place and learner "
                                             rf"fragment 'learn' reads it, but policy 'pipelined' runs them in different "
                                             rf"processes.*\n  at {relpath(path)}:{marks['def']}\n  fix: return what"):
        compile(program.train, policy="pipelined")


REBOUND_GLOBAL = """
import numpy as np
import fragflow as ff

SHIFT = np.zeros(4)
COUNT = 0

@ff.fragment("actor")
def act(w, obs):
    return ((obs - SHIFT) @ w > 0).astype(np.int64)

@ff.fragment("learner", writes="state")  # @def
def learn(state, batch):
    global SHIFT, COUNT
    if SHIFTS:
        SHIFT = SHIFT + 1.0   # rebound: the actor reads it
    COUNT = COUNT + 1         # rebound: only the learner, or the loop, reads it
    return {"w": state["w"] + COUNT}, {"a": batch["action"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(4)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            action = act(state["w"], obs)
            obs, *_ = env.step(action)
            buf.add(action=action)
        state, m = learn(state, buf.collect())
        ff.log(m)  # @log
    return state
"""


@pytest.mark.parametrize("shifts", [True, False])
def test_a_global_a_learner_rebinds_and_an_actor_or_the_loop_reads_is_refused_where_they_run_apart(write_algo, shifts):
    path, marks = write_algo(REBOUND_GLOBAL.replace("SHIFTS", str(shifts)))
    program = load(str(path))
    if shifts:   # the actor reads it: eagerly it acts with each new value, apart it would keep the first
        with pytest.raises(PlacementError, match=rf"learner fragment 'learn' rebinds the global 'SHIFT' \(`global SHIFT` "
                                                 rf"and an assignment\) and actor fragment 'act' reads it, but policy "
                                                 rf"'pipelined' runs them in different processes.*\n  at "
                                                 rf"{relpath(path)}:{marks['def']}\n  fix: return what"):
            compile(program.train, policy="pipelined")
        return
    # a counter only the learner reads runs apart, as eagerly (its process counts from the module's
    # value); the loop reading it is refused
    def run(policy=None):
        program.train.__globals__["COUNT"] = 0
        return (program.train() if policy is None else ff.run(program.train, policy=policy, progress=False).value)["w"]

    eager = run()
    np.testing.assert_array_equal(eager, np.full(4, 11.0))   # 1 + (1 + 2 + 3 + 4)
    np.testing.assert_array_equal(run("single_process"), eager)
    np.testing.assert_array_equal(run("pipelined(max_lag=0)"), eager)
    path, _ = write_algo(REBOUND_GLOBAL.replace("SHIFTS", "False").replace("ff.log(m)  # @log", "ff.log({**m, 'n': COUNT})"), "algo_reads.py")
    program = load(str(path))
    with pytest.raises(PlacementError, match=r"learner fragment 'learn' rebinds the global 'COUNT' \(`global COUNT` and "
                                             r"an assignment\) and the training loop reads it, but policy 'pipelined'"):
        compile(program.train, policy="pipelined")


UNWRITTEN_STATE = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w > 0).astype(np.int64)

@ff.fragment("learner", writes="state")  # @def
def learn(state, target, batch):
    target["w"] += 1.0   # in place, and not the state it writes
    return {"n": state["n"] + 1, "w": state["w"]}, {"a": batch["action"].mean()}

def train(actor_reads_target=True):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"n": np.zeros(()), "w": -np.ones(4)})
    target = ff.versioned({"w": -np.ones(4)}, name="target")
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            action = act(target["w"] if actor_reads_target else state["w"], obs)
            obs, *_ = env.step(action)
            buf.add(action=action)
        state, m = learn(state, target, buf.collect())
        ff.log(m)
    return target
"""


def test_state_a_learner_changes_in_place_without_writing_it_is_refused_where_an_actor_reads_it_apart(write_algo):
    path, marks = write_algo(UNWRITTEN_STATE)
    program = load(str(path))
    eager = program.train()["w"]
    np.testing.assert_array_equal(ff.run(program.train, policy="single_process", progress=False).value["w"], eager)
    # served beside the learner, the actor reads the learner's own object, as eagerly
    np.testing.assert_array_equal(ff.run(program.train, policy="central_inference(env_workers=2)",
                                         progress=False).value["w"], eager)
    for policy in ("pipelined", "actor_learner(actors=2)"):
        with pytest.raises(PlacementError, match=rf"learner 'learn' changes the versioned state 'target' in place \(argument "
                                                 rf"'target'\), which it does not write, and actor fragment 'act' reads "
                                                 rf"that state.*\n  at {relpath(path)}:{marks['def']}\n  fix: make the "
                                                 rf"change in a learner that writes 'target'"):
            compile(program.train, policy=policy)
    # no fragment apart reads it: the learner's process keeps it, as eagerly
    np.testing.assert_array_equal(ff.run(program.train, False, policy="pipelined", progress=False).value["w"], eager)


CHANGED_ARGUMENT = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn_pi(state, batch):
    obs = batch["obs"]
    obs -= obs.mean(axis=(0, 1))   # in place: the loop's batch too, eagerly
    return {"w": state["w"] + 1e-3 * obs.sum(axis=(0, 1))[:, None]}, {}

@ff.fragment("learner", writes="state")
def learn_aux(state, obs):
    return {"w": state["w"] - 1e-3 * obs.mean()}, {"aux": float(np.abs(obs).sum())}

def train(aux=True):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(3)
    obs = env.reset()
    for _ in range(4):
        for _ in range(3):
            a = act(state["w"], obs)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        batch = buf.collect()
        state, _ = learn_pi(state, batch)  # @pi
        if aux:
            state, m = learn_aux(state, batch["obs"])  # @aux
            ff.log(m)
    return state
"""


def test_an_argument_changed_in_place_and_read_again_is_refused_where_the_change_is_made_apart(write_algo):
    path, marks = write_algo(CHANGED_ARGUMENT)
    program = load(str(path))
    eager = program.train()
    one = ff.run(program.train, policy="single_process")   # one process: learn_aux sees the normalised obs
    assert np.array_equal(one.value["w"], eager["w"])
    with pytest.raises(PlacementError, match=rf"learner fragment 'learn_pi' changes its argument batch\['obs'\] in "
                                             rf"place, and 'learn_aux' \({relpath(path)}:{marks['aux']}\) is given "
                                             rf"that same array afterwards, but policy 'pipelined' runs 'learn_pi' in "
                                             rf"another process.*\n  at {relpath(path)}:{marks['pi']}\n  fix: work on a copy"):
        compile(program.train, policy="pipelined")
    # read by nothing afterwards (the buffer's next rollout is new data): runs wherever
    ff.run(program.train, False, policy="pipelined")


CHANGED_AGAIN = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs, key):
    return np.argmax(obs @ w + ff.random.gumbel(key, (2,)), axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, obs, reward):
    if state["n"] >= state["from_call"]:
        obs -= obs.mean(axis=(0, 1))   # in place
    g = np.einsum("tei,te->i", obs, reward)
    return {"w": state["w"] + 0.01 * g[:, None], "n": state["n"] + 1, "from_call": state["from_call"]}, {}

def train(mode):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2)), "n": np.zeros(()), "from_call": np.array(2.0 if mode == "third" else 0.0)})
    key = ff.random.keys(0, env.ids)
    obs_buf = np.zeros((8, 2, 4), np.float32)   # allocated once, as CleanRL does
    rew_buf = np.zeros((8, 2), np.float32)
    obs = env.reset()
    for _ in range(3):
        for t in range(8):
            key, sub = ff.random.split(key)
            action = act(state["w"], obs, sub)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            if mode != "refilled" or t > 0:
                obs_buf[t] = obs   # (refilled: wholly rewritten before the learner reads it again)
            rew_buf[t] = reward - 0.5 * action
            obs = next_obs
        if mode == "refilled":
            obs_buf[0] = obs
            state, _ = learn(state, obs_buf, rew_buf)
        elif mode == "views":   # two epochs over minibatches, each a view of the rollout
            for _ in range(2):
                state, _ = learn(state, obs_buf[:4], rew_buf[:4])  # @views
                state, _ = learn(state, obs_buf[4:], rew_buf[4:])
        else:
            for _ in range(2):
                state, _ = learn(state, obs_buf, rew_buf)  # @again
    return state
"""


@pytest.mark.parametrize("mode", ["views", "third", "refilled"])
def test_memory_changed_in_place_is_followed_through_views_later_calls_and_refills(write_algo, mode):
    """The same memory given again is refused where the changer runs apart: through another view of
    it, and where the change begins at the learner's third call; storage the loop rewrites wholly
    before it is read again is not (it runs, as single_process)."""
    path, marks = write_algo(CHANGED_AGAIN)
    program = load(str(path))
    one = ff.run(program.train, mode, policy="single_process")
    if mode == "refilled":
        apart = ff.run(program.train, mode, policy="pipelined(max_lag=0)")
        assert np.array_equal(apart.value["w"], one.value["w"])
        return
    line = marks["views"] if mode == "views" else marks["again"]
    with pytest.raises(PlacementError, match=rf"learner fragment 'learn' changes its argument obs in place, and its "
                                             rf"next call \({relpath(path)}:{line}\) is given that same array"):
        compile(program.train, mode, policy="pipelined(max_lag=0)")


def test_a_sampled_batch_changed_and_read_again_in_the_learners_process_runs(write_algo):
    """Made (sampled), changed and read again in one process (the buffer beside the learner): as
    eagerly, so it runs and equals single_process; with the buffer in the loop it is refused."""
    path, _ = write_algo("""
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs, key):
    return np.argmax(obs @ w + ff.random.gumbel(key, (2,)), axis=-1)

@ff.fragment("learner", writes="state")
def learn_q(state, batch):
    r = batch["reward"]
    r *= 0.1   # reward scaling, in place, on the sampled batch
    a = batch["action"]
    err = r - (batch["obs"] @ state["w"])[np.arange(len(a)), a]
    return {"w": state["w"] + 1e-3 * batch["obs"].T @ (err[:, None] * np.eye(2)[a]), "b": state["b"]}, {}

@ff.fragment("learner", writes="state")
def learn_b(state, batch):
    return {"w": state["w"], "b": state["b"] + batch["reward"].mean()}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=1, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2)), "b": np.zeros(1)})
    rb = ff.ReplayBuffer(1000, seed=0)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    for step in range(300):
        key, sub = ff.random.split(key)
        action = act(state["w"], obs, sub)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rb.add(obs=obs, action=action, reward=reward)
        obs = next_obs
        if step >= 50 and step % 10 == 0:
            batch = rb.sample(16)
            state, _ = learn_q(state, batch)
            state, _ = learn_b(state, batch)
    return state
""")
    program = load(str(path))
    one = ff.run(program.train, policy="single_process")
    beside = ff.run(program.train, policy="learner_replay(max_lag=0)")
    assert np.array_equal(beside.value["b"], one.value["b"]) and np.array_equal(beside.value["w"], one.value["w"])
    with pytest.raises(PlacementError, match=r"learner fragment 'learn_q' changes its argument batch\['reward'\] in place"):
        compile(program.train, policy="pipelined(max_lag=0)")


def test_a_loop_passing_on_a_state_a_learner_has_written_since_is_refused_where_the_learner_runs_apart(write_algo):
    path, marks = write_algo("""
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {"m": float(batch["obs"].mean())}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            obs, *_ = env.step(act(state["w"], obs))  # @act
            buf.add(obs=obs)
        batch = buf.collect()
        state, _ = learn(state, batch)
        _, metrics = learn(state, batch)   # a dry run for its metrics: the new state is dropped
        ff.log(metrics)
    return state
""")
    program = load(str(path))
    eager = program.train()
    one = ff.run(program.train, policy="single_process").value   # as eagerly: the state advances once per update
    assert np.array_equal(one["w"], eager["w"])
    with pytest.raises(PlacementError, match=r"passes version 1 of versioned state 'state' to 'act' after a learner "
                                             r"wrote version 2 .*policy 'pipelined'"
                                             rf".*\n  at {relpath(path)}:{marks['act']}\n  fix: assign every"):
        compile(program.train, policy="pipelined")


def test_a_number_probe_computes_as_its_plain_value_with_arrays():
    """A learner's float output reaches the loop as a probe while tracing; under single_process the
    trace is the run's beginning, so arithmetic with it must be the plain number's: NumPy took a float
    subclass for a float64 (a float32 array times it became float64, and the run drifted from eager)."""
    from fragflow.compiler.probes import probe, recording

    a = np.ones(3, np.float32)
    p = probe(0.1, "learn", "[1]")
    for got, want in [(p * a, 0.1 * a), (a * p, a * 0.1), (a - p, a - 0.1), (p / a, 0.1 / a), (a < p, a < 0.1),
                      (np.maximum(a, p), np.maximum(a, 0.1)), (probe(3, "learn", "[2]") * a, 3 * a)]:
        assert got.dtype == want.dtype and np.array_equal(got, want)
    reads = []
    with recording(reads):
        _ = a * p
    assert [r.what for r in reads] == ["used in arithmetic"]   # still a read where the loop does it


def test_an_array_probe_prints_as_its_plain_value_and_its_element_is_a_dict_key():
    """The trace is single_process's first updates: what the loop prints of a learner output, or an
    element used as a dict key, must be as eagerly ("ProbeArray(...)" was printed; an element of a
    probed array was an unhashable 0-d array where eagerly it is a numpy scalar)."""
    from fragflow.compiler.probes import probe, recording

    plain = np.array([1.5, 2.0], np.float32)
    p = probe(plain.copy(), "learn", "[1]['vals']")
    assert repr(p) == repr(plain) and str(p) == str(plain)
    reads = []
    with recording(reads):
        e = p[0]
        seen = {e: 1}
    assert repr(e) == repr(plain[0]) and seen == {plain[0]: 1}
    assert [r.what for r in reads] == ["used as a dict key"]
    with pytest.raises(TypeError, match="unhashable"):
        hash(p)



QUICK_CASES = {
    "dqn": ("dqn", "dict(total_timesteps=2000, learning_starts=400, batch_size=32, target_network_frequency=100)"),
    "sac": ("sac", "dict(total_timesteps=600, learning_starts=300, batch_size=32)"),
    "ppo": ("ppo", "dict(total_timesteps=2048, num_steps=64)"),
}


def graph_shape(graph):
    """A graph's nodes and edges with every recorded spec, axis and rate."""
    nodes = sorted((n.name, n.kind.name, n.rate, n.inputs, n.outputs, n.output_axes, n.splittable)
                   for n in graph.nodes)
    edges = sorted((e.src, e.dst, e.kind.name, e.src_port, e.dst_port, e.rate, e.leaves) for e in graph.edges)
    return nodes, edges, graph.env_steps_traced


@pytest.mark.parametrize("case", sorted(QUICK_CASES))
def test_a_warm_up_run_unrecorded_places_the_graph_of_its_recorded_calls(case, monkeypatch):
    """Under single_process the trips of a repeating warm-up run unrecorded: the graph the run
    places (graph.txt) has the nodes, specs, axes and rates of a full trace's, and its edges but
    one crossed only during those trips (SAC's final_obs at the warm-up's episode end, rate 0)."""
    import importlib

    module = importlib.import_module(f"fragflow.algorithms.{QUICK_CASES[case][0]}")
    args = module.Args(**eval(QUICK_CASES[case][1]))
    placed = []
    ff.run(module.train, args, policy="single_process", on_compiled=lambda c: placed.append(c.placed.graph))
    monkeypatch.setenv("FRAGFLOW_TRACE_EVERY_CALL", "1")
    full = []
    ff.run(module.train, args, policy="single_process", on_compiled=lambda c: full.append(c.placed.graph))
    (quick_nodes, quick_edges, quick_steps), (nodes, edges, steps) = graph_shape(placed[0]), graph_shape(full[0])
    assert quick_nodes == nodes and quick_steps == steps
    assert set(quick_edges) <= set(edges)
    assert all(e[5] == 0 and e[:2] == ("env.step", "replay.add") for e in set(edges) - set(quick_edges)), \
        set(edges) - set(quick_edges)


@pytest.mark.parametrize(("policy", "column", "logged"), [
    ("single_process", "updates", '"updates": float(u)'),
    ("pipelined(max_lag=0)", "updates", '"updates": float(u)'),
    # the channel's counters: under pipelined the logged value overwrote them; refused under single_process
    # too, which has no channel, so that the program runs (or is refused) alike under every policy
    ("single_process", "trajectory/drops", '"trajectory": {"drops": float(u)}'),
    ("pipelined(max_lag=0)", "trajectory/drops", '"trajectory": {"drops": float(u)}'),
])
def test_logging_under_the_name_of_a_runtime_column_is_refused_at_the_line(write_algo, policy, column, logged):
    """ff.log({"updates": 7.0}) overwrote the column in every row (and, under pipelined, the rows'
    bookkeeping: env steps came out 128, 128, 192, ...; helper round 25 B01)."""
    path, marks = write_algo("""
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].sum((0, 1))[:, None]}, {"loss": float(batch["obs"].sum())}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for u in range(3):
        for _ in range(4):
            a = act(state["w"], obs)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        state, m = learn(state, buf.collect())
        ff.log({"loss": m["loss"], "extra": {"x": 1.0}, LOGGED})  # @log
    return state
""".replace("LOGGED", logged))
    program = load(str(path))
    with pytest.raises(TraceError, match=rf"ff.log got '{column}', the name of a column the run writes itself.*\n  "
                                         rf"at {relpath(path)}:{marks['log']}\n  fix: log it under a name of its own"):
        ff.run(program.train, policy=policy)


def test_a_learner_that_writes_nothing_is_refused_by_a_placement_with_a_fix_that_fits(write_algo):
    path, _ = write_algo("""
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes=None)
def learn(w, batch):
    return {"loss": float(batch["obs"].sum())}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    w = np.zeros((4, 2))
    buf = ff.RolloutBuffer(2)
    obs = env.reset()
    for _ in range(3):
        for _ in range(2):
            a = act(w, obs)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        ff.log(learn(w, buf.collect()))
""")
    program = load(str(path))
    # (the fix said "mark the update function @ff.fragment('learner')": it already was one)
    with pytest.raises(PlacementError, match=r"found: learn \(none writes: declared with writes=None, or given no "
                                             r"versioned state\)(.|\n)*fix: give a learner the state it updates"):
        compile(program.train, policy="pipelined")


def test_a_container_argument_whose_entries_a_learner_replaces_is_refused_where_read_again_apart(write_algo):
    """batch["reward"] = batch["reward"] * 0.5 in the learner, two epochs on one batch: eagerly the
    second epoch sees the scaled rewards; apart, it did not, silently (helper round 26 D06)."""
    path, marks = write_algo("""
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    batch["reward"] = batch["reward"] * 0.5   # a new entry, no array changed
    return {"w": state["w"] + 1e-3 * batch["reward"].sum() * batch["obs"].mean((0, 1))[:, None]}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(3):
        for _ in range(4):
            a = act(state["w"], obs)
            obs, r, *_ = env.step(a)
            buf.add(obs=obs, reward=r)
        batch = buf.collect()
        for _ in range(2):
            state, _ = learn(state, batch)  # @learn
    return state
""")
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(PlacementError, match=rf"learner fragment 'learn' changes its argument batch in place, and its "
                                             rf"next call \({relpath(path)}:{marks['learn']}\) is given that same"):
        compile(program.train, policy="pipelined(max_lag=0)")


def test_a_learner_setting_the_mode_of_a_target_network_says_nothing_of_the_network_an_actor_acts_with(write_algo):
    """Modes are of modules, not of the whole state: a learner's target.eval() (a target network
    with dropout, in the state beside q) was taken for a change of q's mode, and an actor acting
    with q (whose mode nobody changes) was refused apart; and it was taken for the learner setting
    q's mode itself, so an actor's q.eval() (eagerly: the learner then learns q without dropout)
    was placed apart."""
    def source(act_mode: str) -> str:
        text = MODES.format(act_mode=act_mode, set_mode='state["target"].eval()', end_mode="pass") \
            .replace('state = ff.versioned({"q": q,', 'state = ff.versioned({"target": copy.deepcopy(q), "q": q,') \
            .replace("import torch\n", "import copy\nimport torch\n", 1)
        assert '"target"' in text and "import copy" in text
        return text

    path, _ = write_algo(source("pass"))
    compile(load(str(path)).train, policy="pipelined")   # q's mode is the same eagerly and apart
    path, _ = write_algo(source("q.eval()"))
    with pytest.raises(PlacementError, match="the training mode of its modules"):
        compile(load(str(path)).train, policy="pipelined")


def test_a_dropout_of_zero_and_a_norm_without_running_statistics_do_not_depend_on_the_mode(write_algo):
    """Dropout(0.0) (a Transformer made with dropout=0.0) drops nothing, and a norm without running
    statistics (InstanceNorm's default, BatchNorm(track_running_stats=False)) uses the batch's in
    both modes: an actor's .eval() on them changes nothing it computes, and was refused apart."""
    for module in ("torch.nn.Dropout(0.0)", "torch.nn.BatchNorm1d(8, track_running_stats=False)"):
        source = MODES.format(act_mode="q.eval()", set_mode="pass", end_mode="pass") \
            .replace("torch.nn.Dropout(0.5)", module).replace('torch.as_tensor(batch["obs"])', 'torch.as_tensor(batch["obs"]).reshape(-1, 4)')
        assert module in source
        path, _ = write_algo(source)
        compile(load(str(path)).train, policy="pipelined")


def test_a_torch_warning_the_loop_gets_while_traced_names_the_loops_line(write_algo):
    """torch's warnings name the Python frame that called the operation: while traced, the loop's
    torch operations pass through the trace's function mode, and a warning there named
    fragflow/compiler/watchers.py, not the user's line (probe helper)."""
    import warnings

    path, marks = write_algo('''
        import numpy as np
        import torch
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, obs):
            return {"w": state["w"] * 0.5 + obs.mean()}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": torch.zeros(2)})
            obs = env.reset()
            for _ in range(3):
                obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
                t = torch.tensor(torch.as_tensor(obs))   # @warns
                state = learn(state, t)
            return state
    ''')
    program = load(str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile(program.train, None, policy="pipelined")
    copying = [w for w in caught if "copy construct from a tensor" in str(w.message)]
    assert copying and all((w.filename, w.lineno) == (str(path), marks["warns"]) for w in copying), \
        [(w.filename, w.lineno) for w in copying]


def test_a_loop_that_learns_without_stepping_after_its_first_env_calls_stops_tracing(write_algo, tmp_path):
    """An env made and reset before the loop (or a dataset collected first), then only learner calls:
    the trace waited for an env step after an update to cut its window, never came, and traced the
    whole program (3,000 updates traced, at tracing's cost; a policy of several processes then ran it all
    again). From 200 updates with no step, each learner call's end cuts the window, as with no env."""
    import csv

    path, _ = write_algo('''
        import numpy as np
        import fragflow as ff

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            w = state["w"] + 0.01 * batch.mean(0)
            return {"w": w}, {"loss": float(np.abs(w).sum())}

        def train(updates=1000):
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            obs = env.reset()
            data = []
            for _ in range(5):   # a dataset collected first
                obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
                data.append(obs)
            data = np.concatenate(data)
            state = ff.versioned({"w": np.zeros(4, np.float32)})
            for u in range(updates):   # then learning from it alone
                state, m = learn(state, data[u % 7:u % 7 + 4])
                ff.log(m)
            return state
    ''')
    program = load(str(path))
    compiled = compile(program.train, None, policy="single_process")
    assert compiled.placed.graph.updates_traced <= 202
    eager = program.train(1000)["w"]
    for policy in ("single_process", "pipelined"):
        result = ff.run(program.train, policy=policy, out=tmp_path / policy)
        np.testing.assert_array_equal(np.asarray(result.value["w"]), eager)
        rows = list(csv.DictReader((tmp_path / policy / "metrics.csv").open()))
        assert len(rows) == 1000 and rows[-1]["env_steps"] == "10"
