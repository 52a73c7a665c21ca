from __future__ import annotations

import csv
import textwrap

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


ONCE = """
    from dataclasses import dataclass

    import numpy as np
    import torch

    import fragflow as ff

    CALLS = {"act": 0, "loop": 0}


    @dataclass(frozen=True)
    class Args:
        seed: int = 2
        num_envs: int = 2
        warmup: int = 60
        steps: int = 160


    @ff.fragment("actor")
    def act(model, obs, key):
        CALLS["act"] += 1
        with torch.no_grad():
            logits = model(torch.as_tensor(obs, dtype=torch.float32))
        return (logits.numpy() + ff.random.gumbel(key, (2,))).argmax(-1)


    @ff.fragment("learner", writes="state")
    def learn(state, batch):
        model, opt = state["model"], state["opt"]
        q = model(torch.as_tensor(batch["obs"], dtype=torch.float32))
        loss = (q.gather(1, torch.as_tensor(batch["action"])[:, None]) - torch.as_tensor(batch["reward"])[:, None]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return state, {"loss": loss.detach()}


    def train(args):
        env = ff.envs.make("CartPole-v1", num_envs=args.num_envs, seed=args.seed)
        torch.manual_seed(args.seed)
        model = torch.nn.Linear(4, 2)
        state = ff.versioned({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01)})
        rb = ff.ReplayBuffer(1000, seed=args.seed)
        key = ff.random.keys(args.seed, env.ids)
        obs = env.reset()
        for step in range(args.steps):
            CALLS["loop"] += 1
            key, sub = ff.random.split(key)
            action = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, info = env.step(action)
            rb.add(obs=obs, action=action, reward=reward.astype(np.float32))
            obs = next_obs
            if step >= args.warmup and step % 5 == 0:
                state, metrics = learn(state, rb.sample(16))
                ff.log(metrics)
                ff.log({"loop": CALLS["loop"], "random": float(np.random.rand())})
        return state, dict(CALLS)
"""


def test_single_process_runs_the_loop_once_from_where_the_trace_stops(write_algo, tmp_path):
    """Under single_process the trace is the run's beginning: the loop's warm-up and first updates are
    not run again, so what the loop and its fragments do to module data happens once, as eagerly, and
    the run's rows, episodes and state are those of the trace-then-run path (a compiled program)."""
    from fragflow.driver import compile
    from fragflow.program import load

    path, _ = write_algo(ONCE)
    program = load(str(path))
    args = program.args_cls()
    np.random.seed(0)
    eager_state, eager_calls = program.train(args)
    assert eager_calls == {"act": 160, "loop": 160}
    program.module.CALLS.update(act=0, loop=0)
    np.random.seed(0)
    run = ff.run(program.train, args, policy="single_process", out=tmp_path / "once")
    state, calls = run.value
    assert calls == eager_calls                          # each once: the trace's warm-up was the run's
    assert_same_tree(state, eager_state)
    assert run.summary["env_steps"] == 320 and run.summary["updates"] == 20 and run.summary["trace_seconds"] > 0

    program.module.CALLS.update(act=0, loop=0)
    np.random.seed(0)
    compiled = compile(program.train, args, policy="single_process")
    again = ff.run(program.train, args, compiled=compiled, out=tmp_path / "again")
    assert_same_tree(again.value[0], eager_state)
    # compiled apart, the trace does not begin the run: the module's data is put back as it was before it,
    # and the run counts its own calls, as eagerly
    assert again.value[1] == eager_calls
    assert again.episodes == run.episodes

    def rows(run_dir):
        with open(run_dir / "metrics.csv", newline="") as f:
            return [{k: v for k, v in r.items() if k not in ("wall_seconds", "steps_per_second", "loop")}
                    for r in csv.DictReader(f)]

    assert rows(tmp_path / "once") == rows(tmp_path / "again") and len(rows(tmp_path / "once")) == 20
    with open(tmp_path / "once" / "metrics.csv", newline="") as f:
        logged = [(int(float(r["updates"])), int(float(r["loop"]))) for r in csv.DictReader(f)]
    assert [loop for _, loop in logged] == [step + 1 for step in range(60, 160) if step % 5 == 0]


def test_a_failure_after_the_trace_hands_over_is_the_runs(write_algo, tmp_path):
    """An error the loop raises once the run has taken it over from the trace fails the run (its
    summary written, status failed); so does one raised while tracing, which is the run's beginning
    under single_process, as a Ctrl-C there does (it wrote nothing, as a compile error: round 34)."""
    import json

    from fragflow.program import load

    path, _ = write_algo(ONCE.replace('''                ff.log({"loop": CALLS["loop"], "random": float(np.random.rand())})''',
                                      '''                ff.log({"loop": CALLS["loop"], "random": float(np.random.rand())})
                if step == args.fail_at:
                    raise RuntimeError("loop failed")''').replace("steps: int = 160", "steps: int = 160\n        fail_at: int = -1"))
    program = load(str(path))
    with pytest.raises(RuntimeError, match="loop failed"):
        ff.run(program.train, program.args_cls(fail_at=120), policy="single_process", out=tmp_path / "late")
    summary = json.loads((tmp_path / "late" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["env_steps"] == 242 and summary["updates"] == 13
    with pytest.raises(RuntimeError, match="loop failed"):
        ff.run(program.train, program.args_cls(fail_at=60), policy="single_process", out=tmp_path / "early")
    summary = json.loads((tmp_path / "early" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["trace_in_run"] and 0 < summary["env_steps"] < 242


EAGER_CASES = {
    # a learner's outputs are the values it returned, of their own types (the trace's probes were
    # subclasses: type(x) is float was False during the trace's updates)
    "output_types": """
        for u in range(4):
            obs, *_ = env.step(act(state["w"], obs))
            state, m = learn(state, obs, 1.0, False)
            seen.append((type(m["s"]).__name__, type(m["s"]) is float))
    """,
    # a learner called on a version the loop kept, its result dropped: the loop's state is unaffected
    "old_handle": """
        first = state
        for u in range(5):
            obs, *_ = env.step(act(np.zeros(1), obs))
            state, _ = learn(state, obs, 1.0, True)
            _, _ = learn(first, obs, 100.0, True)
            seen.append(float(state["w"][0]))
    """,
    # range()'s bound draws a number: evaluated once, as eagerly (the loop watcher evaluated it again)
    "range_bound": """
        rng = np.random.default_rng(0)
        for u in range(4):
            for _ in range(int(rng.integers(3, 8))):
                obs, *_ = env.step(act(state["w"], obs))
            state, _ = learn(state, obs, 1.0, False)
            seen.append(float(rng.random()))
    """,
    # an element of the state kept by the loop is that element then, and the state can be printed or called
    "kept_element": """
        kept = []
        for u in range(4):
            obs, *_ = env.step(act(state["w"], obs))
            state, _ = learn(state, obs, 1.0, False)
            kept.append(state["w"][0])
            seen.append(str(state["w"]))
            seen.append(float(state["f"](torch.ones(1))))
        seen.extend(float(k) for k in kept)
    """,
    # the program's own torch thread count stays its own
    "threads": """
        torch.set_num_threads(3)
        for u in range(4):
            obs, *_ = env.step(act(state["w"], obs))
            state, _ = learn(state, obs, 1.0, False)
            seen.append(torch.get_num_threads())
    """,
}

EAGER_PROGRAM = """
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ np.resize(w, 4) > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, obs, x, fresh):
    if fresh:   # a new value
        return {"w": state["w"] + x, "f": state["f"]}, {"s": float(obs.sum())}
    state["w"] = state["w"] + x   # in place, as torch code updates its state dict
    return state, {"s": float(obs.sum())}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=1, seed=0)
    torch.manual_seed(0)
    state = ff.versioned({"w": np.zeros(1), "f": torch.nn.Linear(1, 1)})
    obs = env.reset()
    seen = []
BODY
    return seen
"""


@pytest.mark.parametrize("case", sorted(EAGER_CASES))
def test_single_process_is_eager_where_the_trace_and_the_run_meet(write_algo, case):
    """Each case is something the trace's first updates did otherwise than eagerly, which the trace, now
    single_process's first updates, must not (helper round 21)."""
    import textwrap

    import torch

    from fragflow.program import load

    body = textwrap.indent(textwrap.dedent(EAGER_CASES[case]).strip("\n"), "    ")
    path, _ = write_algo(EAGER_PROGRAM.replace("BODY", body), f"{case}.py")
    program = load(str(path))
    threads = torch.get_num_threads()
    try:
        eager = program.train()
        torch.set_num_threads(threads)
        run = ff.run(program.train, policy="single_process")
        assert run.value == eager and run.summary["trace_in_run"] and run.summary["trace_seconds"] > 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spelled", ["torch.set_num_threads", "set_num_threads"])
def test_a_program_that_sets_one_thread_keeps_it_with_a_big_learner(write_algo, spelled):
    """A big learner (state of 50k floats or more) runs with the cores the placement gives it; a
    program that sets its own thread count keeps it: set to 1, as the trace sets them, it was taken
    for the trace's and switched to 2 once the trace handed over (diverging from eager; helper
    round 25). So does one that imported the function by name (it was not seen: stop 25's notes)."""
    from fragflow.program import load

    path, _ = write_algo("""
import numpy as np
import torch
from torch import set_num_threads
import fragflow as ff

SEEN = []

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w[:4, :2].numpy()).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, obs):
    SEEN.append(torch.get_num_threads())
    return {"w": state["w"] + 1e-3 * float(obs.sum())}, {}

def train():
    SPELLED(1)
    env = ff.envs.make("CartPole-v1", num_envs=1, seed=0)
    state = ff.versioned({"w": torch.zeros(300, 200)})   # 60k floats: a big learner
    obs = env.reset()
    SEEN.clear()
    for _ in range(400):
        obs, *_ = env.step(act(state["w"], obs))
        state, _ = learn(state, obs)
    return list(SEEN)
""".replace("SPELLED", spelled))
    program = load(str(path))
    threads = torch.get_num_threads()
    try:
        seen = ff.run(program.train, policy="single_process").value
        assert len(seen) == 400 and set(seen) == {1}
        assert program.train.__globals__["set_num_threads"] is torch.set_num_threads   # put back
    finally:
        torch.set_num_threads(threads)


QUICK = """
    from collections import deque
    from dataclasses import dataclass

    import numpy as np
    import torch

    import fragflow as ff


    @dataclass(frozen=True)
    class Args:
        seed: int = 3
        warmup: int = 300
        steps: int = 400


    @ff.fragment("actor")
    def act(model, obs, key):
        with torch.no_grad():
            logits = model(torch.as_tensor(obs, dtype=torch.float32))
        return (logits.numpy() + ff.random.gumbel(key, (2,))).argmax(-1)


    @ff.fragment("learner", writes="state")
    def learn(state, batch, older):
        model, opt = state["model"], state["opt"]
        q = model(torch.as_tensor(batch["obs"], dtype=torch.float32) + torch.as_tensor(older).mean())
        loss = (q.gather(1, torch.as_tensor(batch["action"])[:, None]) - torch.as_tensor(batch["reward"])[:, None]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return state, {"loss": loss.item()}


    def train(args):
        env = ff.envs.make("CartPole-v1", num_envs=2, seed=args.seed)
        torch.manual_seed(args.seed)
        model = torch.nn.Linear(4, 2)
        state = ff.versioned({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01)})
        rb = ff.ReplayBuffer(1000, seed=args.seed)
        key = ff.random.keys(args.seed, env.ids)
        obs = env.reset()
        recent = deque(maxlen=3)   # observations of the last three steps, the oldest passed to the learner
        losses = []
        for step in range(args.steps):
            key, sub = ff.random.split(key)
            action = act(state["model"], obs, sub)
            next_obs, reward, terminated, truncated, info = env.step(action)
            rb.add(obs=obs, action=action, reward=reward.astype(np.float32))
            recent.append(next_obs)
            obs = next_obs
            if step % 100 == 0:
                ff.log({"step": step})
            if step >= args.warmup and step % 4 == 0:
                state, metrics = learn(state, rb.sample(16), recent[0])
                ff.log(metrics)
                losses.append(metrics["loss"])
        return state, losses
"""


def test_a_repeating_warm_up_runs_unrecorded_and_the_graph_is_the_same(write_algo, tmp_path, monkeypatch):
    """Under single_process a warm-up's trips, once they repeat, run without being recorded (a
    DQN's 10k-step warm-up at near eager cost): the run is the eager loop's, and the graph it places
    is the one a full trace records, edges and rates, a value the loop kept from three steps back
    included."""
    from fragflow.compiler import tracer as tracer_module
    from fragflow.driver import compile
    from fragflow.program import load

    path, _ = write_algo(QUICK)
    program = load(str(path))
    args = program.args_cls()
    eager_state, eager_losses = program.train(args)
    recorded = {"calls": 0}
    repeated = tracer_module.Tracer._repeated

    def counting(self, *a):
        recorded["calls"] += 1
        return repeated(self, *a)

    monkeypatch.setattr(tracer_module.Tracer, "_repeated", counting)
    placed = []
    run = ff.run(program.train, args, policy="single_process", on_compiled=lambda c: placed.append(c.placed.graph))
    quick_calls, recorded["calls"] = recorded["calls"], 0
    state, losses = run.value
    assert_same_tree(state, eager_state)
    assert losses == eager_losses and run.summary["env_steps"] == 800 and run.summary["trace_in_run"]
    full = compile(program.train, args, policy="single_process").placed.graph
    assert recorded["calls"] > 800 and quick_calls < 100   # 3 calls a step through the warm-up, or a few

    def shape(graph):
        edges = sorted((e.src, e.dst, e.kind.name, e.src_port, e.dst_port, e.rate) for e in graph.edges)
        return edges, sorted((n.name, n.rate) for n in graph.fragments())

    assert shape(placed[0]) == shape(full)
    assert any(e.dst == "learn" and e.src == "env.step" and e.dst_port == "older" for e in full.edges), \
        sorted((e.src, e.dst, e.dst_port) for e in full.edges)


def test_an_output_that_changes_in_an_unrecorded_warm_up_is_refused(write_algo):
    """A fragment whose output changes shape is refused at its definition, however long the warm-up
    it changes in has run unrecorded."""
    from fragflow.errors import ShapeChangedError
    from fragflow.program import load

    path, marks = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")   # @act
        def act(obs, i):
            return np.zeros((obs.shape[0],), np.int64) if i < 150 else np.zeros((obs.shape[0], 2), np.int64)

        @ff.fragment("learner", writes="s")
        def learn(s, x):
            return s

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            s = ff.versioned({"w": np.zeros(2)})
            obs = env.reset()
            for i in range(300):
                a = act(obs, i)
                obs, r, te, tr, info = env.step(a[:, 0] if a.ndim == 2 else a)
            return learn(s, obs)
    """)
    program = load(str(path))
    with pytest.raises(ShapeChangedError, match="'act' changed its output") as info:
        ff.run(program.train, policy="single_process")
    assert info.value.where is not None and info.value.where.line in (marks["act"], marks["act"] + 1)


WARM_UP_CASES = {
    # a loop not started at the handover (a final evaluation): the trace's line tracer stayed on
    # for the whole run (every call ~2x slower) and evaluated that loop's range() bound again
    "a_loop_after_training": """
        obs, *_ = env.step(act_star(obs, state["w"]))   # (every fragment of the module called: the trace stops)
        for step in range(60):
            obs, *_ = env.step(act(obs, state["w"]))
            if step % 10 == 0:
                state, m = learn(state)
        seen.append(sys.gettrace() is None)
        draws = np.random.default_rng(0)

        class Evaluation:
            @property
            def n(self):
                return int(draws.integers(10, 99))

        for k in range(Evaluation().n):
            seen.append(k)
    """,
    # the training actor on a one-environment evaluation env every k steps of the warm-up: the
    # every-16th output check took its one-row output for a changed shape (helper round 23)
    "actor_on_an_evaluation_env": """
        ev = ff.envs.make("CartPole-v1", num_envs=1, seed=50, evaluation=True)
        eobs = ev.reset()
        for step in range(400):
            obs, *_ = env.step(act(obs, state["w"]))
            if step % 5 == 0:
                eobs, *_ = ev.step(act(eobs, state["w"]))
            if step >= 300 and step % 10 == 0:
                state, m = learn(state)
                seen.append(float(m["s"]))
    """,
    # the state's view through *params: the unrecorded trips gave the fragment the view itself
    "state_through_star_args": """
        for step in range(100):
            obs, *_ = env.step(act_star(obs, state["w"]))
            if step >= 50 and step % 10 == 0:
                state, m = learn(state)
                seen.append(float(m["s"]))
    """,
}

WARM_UP_PROGRAM = """
import sys
import numpy as np
import torch
import fragflow as ff

@ff.fragment("actor")
def act(obs, w):
    return (torch.as_tensor(obs, dtype=torch.float32) @ w).argmax(-1).numpy()

@ff.fragment("actor")
def act_star(obs, *params):
    return (torch.as_tensor(obs, dtype=torch.float32) @ params[0]).argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state):
    return {"w": state["w"] * 0.9}, {"s": state["w"].sum()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=1)
    torch.manual_seed(1)
    state = ff.versioned({"w": torch.randn(4, 2)})
    obs = env.reset()
    seen = []
BODY
    return seen, state
"""


@pytest.mark.parametrize("case", sorted(WARM_UP_CASES))
def test_a_warm_up_run_unrecorded_is_eager(write_algo, case):
    import textwrap

    from fragflow.program import load

    body = textwrap.indent(textwrap.dedent(WARM_UP_CASES[case]).strip("\n"), "    ")
    path, _ = write_algo(WARM_UP_PROGRAM.replace("BODY", body), f"{case}.py")
    program = load(str(path))
    eager_seen, eager_state = program.train()
    run = ff.run(program.train, policy="single_process")
    assert run.value[0] == eager_seen and torch.equal(run.value[1]["w"], eager_state["w"])


def test_the_first_run_in_a_process_leaves_pythons_random_stream_to_the_program(tmp_path):
    """Importing the runtime (rich) drew from Python's random: a program seeded before ff.run drew
    other numbers than eagerly (helper round 23)."""
    import subprocess
    import sys

    script = tmp_path / "first.py"
    script.write_text(textwrap.dedent("""
        import random
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(obs):
            return np.zeros(obs.shape[0], np.int64)

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=1, seed=0)
            obs = env.reset()
            for _ in range(3):
                obs, *_ = env.step(act(obs))
            return random.random()

        random.seed(0)
        eager = train()
        random.seed(0)
        print(ff.run(train, policy="single_process").value == eager)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("True"), out.stdout + out.stderr


def test_a_target_reached_in_the_warm_up_stops_the_loop_there(write_algo):
    """--stop-on-target under single_process, the target reached while the warm-up ran traced: the
    loop ran on through the trace (its warm-up and two updates) and only the replay stopped the
    run's record at the solved step (helper round 23)."""
    from fragflow.program import load

    path, _ = write_algo("""
        import numpy as np
        import torch
        import fragflow as ff

        DONE = {"steps": 0, "updates": 0}

        @ff.fragment("actor")
        def act(obs):
            return (np.asarray(obs)[:, 2] > 0).astype(np.int64)   # episodes of ~45 steps

        @ff.fragment("learner", writes="state")
        def learn(state):
            DONE["updates"] += 1
            return {"w": state["w"] + 1}, {"n": state["w"].sum()}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=1)
            state = ff.versioned({"w": torch.zeros(3)})
            obs = env.reset()
            for step in range(1500):
                obs, *_ = env.step(act(obs))
                DONE["steps"] += 2
                if step > 1000 and step % 10 == 0:      # a 1000-step warm-up
                    state, m = learn(state)
            return state
    """)
    program = load(str(path))
    run = ff.run(program.train, policy="single_process", target_return=5.0, stop_on_target=True)
    done = program.module.DONE
    assert run.summary["status"] == "stopped_at_target" and run.summary["solved_at_steps"] == run.summary["env_steps"]
    assert done["updates"] == 0 and done["steps"] == run.summary["env_steps"] - 2 < 2000, (done, run.summary)


def test_a_warm_up_holds_no_memory_per_step(write_algo):
    """The trace as a run's beginning kept every warm-up step: a journal entry each and each
    ff.random key the loop split (~1.5-2 KB a step, ~2 GB for a 1M-step warm-up; helper round 23)."""
    import tracemalloc

    from fragflow.program import load

    path, _ = write_algo("""
        import tracemalloc
        import numpy as np
        import torch
        import fragflow as ff

        AT_FIRST_UPDATE = []

        @ff.fragment("actor")
        def act(obs, key):
            return (ff.random.uniform(key, (1,))[:, 0] < 0.5).astype(np.int64)

        @ff.fragment("learner", writes="state")
        def learn(state):
            if not AT_FIRST_UPDATE:
                AT_FIRST_UPDATE.append(tracemalloc.get_traced_memory()[0])
            return {"w": state["w"] + 1}, {"n": state["w"].sum()}

        def train(warmup):
            env = ff.envs.make("CartPole-v1", num_envs=1, seed=1)
            state = ff.versioned({"w": torch.zeros(3)})
            key = ff.random.keys(1, env.ids)
            obs = env.reset()
            for step in range(warmup + 30):
                key, sub = ff.random.split(key)
                obs, *_ = env.step(act(obs, sub))
                if step >= warmup and step % 10 == 0:
                    state, m = learn(state)
            return state
    """)
    program = load(str(path))
    ff.run(program.train, 100, policy="single_process")   # (imports done)
    held = {}
    for warmup in (2_000, 8_000):
        program.module.AT_FIRST_UPDATE.clear()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        try:
            ff.run(program.train, warmup, policy="single_process")
        finally:
            tracemalloc.stop()
        held[warmup] = program.module.AT_FIRST_UPDATE[0] - base
    assert (held[8_000] - held[2_000]) / 6_000 < 200, held   # bytes per warm-up step
