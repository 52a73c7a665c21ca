from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fragflow as ff
from fragflow.algorithms import ppo
from fragflow.backends import WorkerDied
from fragflow.compiler.pytree import leaf_paths, to_numpy
from fragflow.errors import ConfigError, VersionedStateError
from fragflow.program import load
from fragflow.runtime.exits import WorkerFailed
from tests.conftest import ROOT, relpath

ARGS = ppo.Args(total_timesteps=4096, num_envs=4, num_steps=64, seed=3)
# bit-identical results across actor counts need acting arithmetic that ignores the batch size
INVARIANT = ppo.Args(total_timesteps=4096, num_envs=4, num_steps=64, seed=3, invariant_acting=True)


def same_tree(a, b) -> bool:
    pa, pb = leaf_paths(a), leaf_paths(b)
    return [p for p, _ in pa] == [p for p, _ in pb] and all(
        np.array_equal(to_numpy(x), to_numpy(y)) for (_, x), (_, y) in zip(pa, pb))


def unclocked_rows(run_dir: Path) -> list[dict[str, str]]:
    """A run's metrics.csv rows without the clock (wall_seconds, steps_per_second) and channel columns:
    what a run under another policy at max_lag=0 must reproduce."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in ("wall_seconds", "steps_per_second") and "/" not in k}
                for r in csv.DictReader(f)]


def shm_leftovers(driver: int | None = None) -> list[str]:
    """Segments a run driven by ``driver`` (default: this test process) left behind. Segment names
    carry the driver's pid, so another fragflow run on the machine does not count."""
    prefix = f"fragflow_{os.getpid() if driver is None else driver}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.fixture(scope="module")
def reference():
    return {args: ff.run(ppo.train, args, policy="single_process") for args in (ARGS, INVARIANT)}


@pytest.mark.parametrize("policy, args", [
    ("actor_learner(actors=1, max_lag=0)", ARGS),
    ("pipelined(actors=1, max_lag=0)", ARGS),
    ("async_relaxed(actors=1, max_lag=0)", ARGS),
    ("actor_learner(actors=2, max_lag=0)", INVARIANT),
    ("pipelined(actors=2, max_lag=0)", INVARIANT),
    ("async_relaxed(actors=2, max_lag=0)", INVARIANT),
])
def test_max_lag_zero_reproduces_single_process_exactly(reference, policy, args):
    result = ff.run(ppo.train, args, policy=policy)
    expected = reference[args]
    assert same_tree(result.value, expected.value)
    assert sorted(result.episode_returns) == sorted(expected.episode_returns)
    traj = result.summary["channels"]["trajectory"]
    assert traj["drops"] == 0 and traj["lag_histogram"][0] == traj["items"]
    assert result.summary["updates"] == 16 and result.summary["env_steps"] == 4096
    assert shm_leftovers() == []


NORMALIZED = ppo.Args(env_id="Pendulum-v1", total_timesteps=1024, num_envs=4, num_steps=64, seed=2,
                      invariant_acting=True)


@pytest.mark.parametrize("policy", ["central_inference(env_workers=2, max_lag=0)", "pipelined(actors=2, max_lag=0)"])
def test_normalised_environments_split_across_processes_reproduce_single_process(policy):
    """normalize_obs / normalize_reward keep statistics per environment, as gymnasium's wrappers
    on each environment do: splitting the environments across processes changes no observation."""
    expected = ff.run(ppo.train, NORMALIZED, policy="single_process")
    result = ff.run(ppo.train, NORMALIZED, policy=policy)
    assert same_tree(result.value, expected.value)
    assert sorted(result.episode_returns) == sorted(expected.episode_returns)
    assert result.summary["updates"] == 4 and shm_leftovers() == []


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_started_by_a_fork_server_or_spawned_run_and_reproduce_single_process(reference, monkeypatch, method):
    """Once JAX is imported workers start from a fork server, whose process (not the driver) is
    their parent: they must still run, and still die with the driver."""
    monkeypatch.setenv("FRAGFLOW_START_METHOD", method)
    result = ff.run(ppo.train, ARGS, policy="pipelined(actors=1, max_lag=0)")
    assert same_tree(result.value, reference[ARGS].value)
    assert shm_leftovers() == []


def test_pipelined_is_one_version_behind_and_deterministic_whatever_the_actor_count():
    one = ff.run(ppo.train, INVARIANT, policy="pipelined(actors=1)")
    two = ff.run(ppo.train, INVARIANT, policy="pipelined(actors=2)")
    again = ff.run(ppo.train, INVARIANT, policy="pipelined(actors=2)")
    assert same_tree(one.value, two.value) and same_tree(two.value, again.value)
    assert sorted(one.episode_returns) == sorted(two.episode_returns) == sorted(again.episode_returns)
    lags = two.summary["channels"]["trajectory"]["lag_histogram"]
    assert lags[0] == 2 and lags[1] == 30 and sum(lags) == 32   # first update at version 0, then exactly one behind


def test_pipelined_is_deterministic_for_a_given_actor_count_with_fast_acting():
    runs = [ff.run(ppo.train, ARGS, policy="pipelined(actors=2)") for _ in range(2)]
    assert same_tree(runs[0].value, runs[1].value)
    # episodes arrive from two actors in an order the OS decides; the episodes themselves do not
    assert sorted(runs[0].episode_returns) == sorted(runs[1].episode_returns)


def test_async_relaxed_keeps_staleness_bounded_and_counts_drops():
    result = ff.run(ppo.train, ppo.Args(total_timesteps=8192, num_envs=4, num_steps=64, seed=1),
                    policy="async_relaxed(actors=2, max_lag=1)")
    traj = result.summary["channels"]["trajectory"]
    assert traj["items"] == 64 and sum(traj["lag_histogram"][2:]) == 0
    assert result.summary["updates"] == (64 - traj["drops"]) // 2
    assert shm_leftovers() == []


def test_profile_knob_writes_stats_for_every_worker(tmp_path, monkeypatch):
    import pstats

    monkeypatch.setenv("FRAGFLOW_PROFILE", str(tmp_path))
    ff.run(ppo.train, ppo.Args(total_timesteps=512, num_envs=4, num_steps=64), policy="pipelined(actors=2)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor0.prof", "actor1.prof", "learner0.prof"]
    names = {fn for _, _, fn in pstats.Stats(str(tmp_path / "learner0.prof")).stats}
    assert "learn" in names


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_workers_give_the_same_run_as_forked_ones(monkeypatch, method):
    """(forkserver: its workers fork from a server that imported torch and fragflow for them)"""
    args = ppo.Args(total_timesteps=1024, num_envs=4, num_steps=64, seed=5)
    forked = ff.run(ppo.train, args, policy="pipelined(actors=1)")
    monkeypatch.setenv("FRAGFLOW_START_METHOD", method)
    spawned = ff.run(ppo.train, args, policy="pipelined(actors=1)")
    assert same_tree(forked.value, spawned.value)
    assert forked.episode_returns == spawned.episode_returns
    assert mp.active_children() == [] and shm_leftovers() == []


def test_workers_from_a_fork_server_see_the_environment_as_the_run_starts(monkeypatch, write_algo):
    """A fork server holds the environment of its start: a variable the driver set after it (between
    two runs) did not reach the workers, which a forked or spawned worker would have seen."""
    path, _ = write_algo("""
        import os
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs):
            return (obs @ w).argmax(-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"w": state["w"] + 0.01 * batch["obs"].mean((0, 1))[:, None]}, {}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros((4, 2))})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for _ in range(2):
                for _ in range(4):
                    obs, *_ = env.step(act(state["w"], obs))
                    buf.add(obs=obs)
                state, _ = learn(state, buf.collect())
            return os.environ.get("FF_TEST_PROBE", "unset"), os.environ.get("FF_TEST_GONE", "unset")
    """)
    program = load(str(path))
    monkeypatch.setenv("FRAGFLOW_START_METHOD", "forkserver")
    monkeypatch.setenv("FF_TEST_GONE", "there")
    ff.run(program.train, policy="pipelined")   # (starts the fork server, if no earlier run did)
    monkeypatch.setenv("FF_TEST_PROBE", "set later")
    monkeypatch.delenv("FF_TEST_GONE")
    result = ff.run(program.train, policy="pipelined")
    assert result.value == ("set later", "unset")
    assert mp.active_children() == [] and shm_leftovers() == []


def test_actors_must_divide_the_environments():
    # (the fix told every program to `--set num_envs=...`, a key only an Args with that field has:
    # helper round 29 N04)
    with pytest.raises(ConfigError, match=r"splits the loop's 4 environments across 3 processes \(actors=3\): they do "
                                          r"not divide evenly(.|\n)*fix: choose actors dividing num_envs=4 \(and "
                                          r"envs_per_actor = num_envs / actors\), or make num_envs \(given to "
                                          r"ff.envs.make\) a multiple of actors \(`--set num_envs=...` where your Args "
                                          r"has that field\)"):
        ff.run(ppo.train, ARGS, policy="actor_learner(actors=3)")
    # (multi_learner's told to choose actors, when learners=3 was the count: helper round 33 C12)
    with pytest.raises(ConfigError, match=r"\(learners=3 x actors=1\): they do not divide evenly(.|\n)*fix: choose "
                                          r"learners x actors dividing num_envs=4 .* a multiple of learners x actors"):
        ff.run(ppo.train, ARGS, policy="multi_learner(learners=3)")


FAILING = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 100000
    fail_in: int = 1          # 1: act raises, 2: learn raises, 0: nothing raises

@ff.fragment("actor")
def act(params, obs, fail):
    if fail == 1 and params["t"][0] >= 3:
        raise ValueError("boom in act")  # @act
    return np.zeros(obs.shape[0], dtype=np.int64)

@ff.fragment("learner")
def learn(state, batch, fail):
    if fail == 2 and state["params"]["t"][0] >= 3:
        raise RuntimeError("boom in learn")  # @learn
    return {"params": {"t": state["params"]["t"] + 1}}, {"m": batch["obs"].mean()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"params": {"t": np.zeros(1)}})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(8):
            action = act(state["params"], obs, args.fail_in)
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect(), args.fail_in)
        ff.log(metrics)
    return state
"""


@pytest.mark.parametrize("where, fragment, message", [("act", "act", "boom in act"), ("learn", "learn", "boom in learn")])
def test_worker_error_stops_the_run_and_names_the_fragment(write_algo, where, fragment, message):
    path, marks = write_algo(FAILING)
    program = load(str(path))
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ff.run(program.train, program.args_cls(fail_in={"act": 1, "learn": 2}[where]), policy="pipelined(actors=2)")
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert f"failed in fragment '{fragment}'" in msg and message in msg
    assert f"algo.py\", line {marks[where]}" in msg     # the user's own frame, with its line
    assert mp.active_children() == []
    assert shm_leftovers() == []



RAISES = """
import sys
from dataclasses import dataclass
import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    where: str = "act"    # act, learn or loop
    what: str = "value"   # value (a ValueError), exit (sys.exit(3)) or interrupt (a KeyboardInterrupt of its own)
    at: int = 6           # the update it raises at (the trace has ended by then)

def boom(what):
    if what == "exit":
        sys.exit(3)
    if what == "interrupt":
        raise KeyboardInterrupt
    raise ValueError("boom")

@ff.fragment("actor")
def act(w, obs, update, where: str, what: str, at: int):
    if where == "act" and update == at:
        boom(what)
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch, where: str, what: str, at: int):
    if where == "learn" and state["n"][0] == at:
        boom(what)
    return {"w": state["w"], "n": state["n"] + 1}, {"m": batch["obs"].mean()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones((4, 2)), "n": np.zeros(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for update in range(10):
        if args.where == "loop" and update == args.at:
            boom(args.what)
        for _ in range(4):
            obs, *_ = env.step(act(state["w"], obs, update, args.where, args.what, args.at))   # @act
            buf.add(obs=obs)
        state, m = learn(state, buf.collect(), args.where, args.what, args.at)   # @learn
    return state
"""


@pytest.mark.parametrize("policy, where, who", [
    ("pipelined", "act", "actor 0 failed in fragment 'act'"),
    ("pipelined", "learn", "learner failed in fragment 'learn'"),
    # (it said "learner failed in fragment 'act'", and "actor 0 failed" for an env worker)
    ("central_inference(env_workers=1)", "act", "the inference server (the learner's process) failed in fragment 'act'"),
    ("central_inference(env_workers=1)", "loop", "env worker 0 failed:"),
])
def test_an_error_in_another_process_names_it_by_its_part_and_the_line_that_called_the_fragment(
        write_algo, policy, where, who):
    """A fragment's error carries single_process's "(while executing fragment ... called at ...)" under
    every policy (a worker's did not), and the process is named by its part in the placement (round 34 B11)."""
    from fragflow.source import display_path

    path, marks = write_algo(RAISES, "raises.py")
    program = load(str(path))
    args = program.args_cls(where=where)
    with pytest.raises(ValueError, match="boom") as one:
        ff.run(program.train, args, policy="single_process")
    with pytest.raises(WorkerFailed) as apart:
        ff.run(program.train, args, policy=policy)
    message = str(apart.value)
    assert message.startswith(who) and "ValueError: boom" in message
    if where != "loop":
        note = f"(while executing fragment '{where}' called at {display_path(str(path))}:{marks[where]})"
        assert note in one.value.__notes__ and note in message.splitlines()
    else:
        assert not any("while executing" in line for line in message.splitlines())
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("policy", ["pipelined", "async_relaxed(actors=2)"])
def test_a_failed_run_closes_its_pipes_without_waiting_for_the_garbage_collector(write_algo, policy):
    """A failed run's traceback holds the driver in a reference cycle: its processes' sentinels and
    the definition queues never written to kept 6 (pipelined) or 8 pipe ends open in the caller
    until the next collection (round 47)."""
    import gc

    path, _ = write_algo(RAISES, "raises.py")
    program = load(str(path))
    args = program.args_cls(where="learn")

    def fail() -> int:
        with pytest.raises(WorkerFailed):
            ff.run(program.train, args, policy=policy)
        return len(os.listdir("/proc/self/fd"))

    fail()   # (what a first run opens for good: imports, the local backend's context)
    gc.collect()
    gc.disable()
    try:
        before = len(os.listdir("/proc/self/fd"))
        assert fail() == before
    finally:
        gc.enable()
    assert mp.active_children() == [] and shm_leftovers() == []

RUN_SIZED_IN_THE_LOOP = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    returns = np.zeros(4)   # sized with the run's count, not env.num_envs
    for _ in range(3):
        for _ in range(4):
            obs, reward, *_ = env.step(act(state["w"], obs))
            returns += reward
            buf.add(obs=obs)
        state, _ = learn(state, buf.collect())
    return state
"""


def test_a_shape_error_in_the_loops_own_code_where_the_environments_are_split_says_why(write_algo):
    """The loop's own array sized with the run's count failed in a replica with numpy's broadcast
    error alone (tester round 34); it now says the process steps its share, and env.num_envs."""
    path, _ = write_algo(RUN_SIZED_IN_THE_LOOP, "run_sized_loop.py")
    program = load(str(path))
    assert ff.run(program.train, policy="single_process").summary["updates"] == 3
    with pytest.raises(WorkerFailed, match=r"(?s)ValueError: operands could not be broadcast.*\(in loop replica \d, one "
                                           r"of 2 processes that each step their share of the run's environments: size "
                                           r"the loop's own per-environment arrays with env.num_envs"):
        ff.run(program.train, policy="actor_learner(actors=2)")
    assert mp.active_children() == [] and shm_leftovers() == []
    # a ValueError of the program's own is not about the environments' share: no note (it had it)
    boom = RUN_SIZED_IN_THE_LOOP.replace("for _ in range(3):", "for u in range(3):").replace(
        "returns += reward", 'returns = returns if u < 2 else boom("boom")').replace("def train():", "def boom(x):\n    raise ValueError(x)\n\ndef train():")
    path, _ = write_algo(boom, "boom.py")   # (at the third update: the trace has ended)
    with pytest.raises(WorkerFailed, match=r"ValueError: boom") as err:
        ff.run(load(str(path)).train, policy="actor_learner(actors=2)")
    assert "in loop replica" not in str(err.value)


def kill_actor_later(name: str = "fragflow-actor-1", after: float = 1.0, sig: int = signal.SIGKILL) -> threading.Thread:
    """SIGKILL (or ``sig``) the actor process called ``name`` ``after`` seconds after it appears."""
    def kill() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            actors = [p for p in mp.active_children() if p.name == name]
            if actors and actors[0].pid:
                time.sleep(after)
                os.kill(actors[0].pid, sig)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill)
    killer.start()
    return killer


def test_killed_worker_stops_a_run_whose_actors_cannot_restart(write_algo):
    path, _ = write_algo(FAILING)
    program = load(str(path))
    killer = kill_actor_later()
    with pytest.raises(WorkerDied, match="actor 1 process was killed by signal 9 .*not restarted: its replicas act "
                                         "with exact versions"):
        ff.run(program.train, program.args_cls(fail_in=0), policy="pipelined(actors=2)")
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_a_killed_env_worker_is_named_as_one(write_algo):
    """Under central_inference a killed process was "actor 1", where its errors say "env worker 1"
    (round 34's open item)."""
    path, _ = write_algo(FAILING)
    program = load(str(path))
    killer = kill_actor_later()
    with pytest.raises(WorkerDied, match=r"^env worker 1 process was killed by signal 9"):
        ff.run(program.train, program.args_cls(fail_in=0), policy="central_inference(env_workers=2)")
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_a_killed_learner_that_serves_inference_is_named_as_both(write_algo):
    """Under central_inference the learner's process answers the actors: killed (or an actor's own
    os._exit there), it was named "learner" alone, and the user looked for the fault in the learner."""
    path, _ = write_algo(FAILING)
    program = load(str(path))
    killer = kill_actor_later(name="fragflow-learner-0")
    with pytest.raises(WorkerDied, match=r"^learner \(also the inference server of actor 'act'\) process was killed by "
                                         r"signal 9"):
        ff.run(program.train, program.args_cls(fail_in=0), policy="central_inference(env_workers=2)")
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "actor_learner(actors=2, overflow=deliver)",
                                    "actor_learner(actors=2, overflow=block)", "async_relaxed(actors=2)"])
def test_a_killed_actor_is_restarted_and_no_update_or_step_is_lost(tmp_path, policy):
    """(overflow=block hung after the restart: the learner waited for the ticket the dead actor had
    been admitted with; helper round 23)"""
    args = ppo.Args(total_timesteps=160 * 256, num_envs=4, num_steps=64)   # about 7 s: the kill lands mid-run
    killer = kill_actor_later(after=1.5)
    result = ff.run(ppo.train, args, policy=policy, out=tmp_path / "run")
    killer.join()
    s = result.summary
    assert s["status"] == "completed" and s["restarts"] == 1
    assert s["notes"] == ["actor 1 was killed by signal 9: restarted (1 of 3)"]
    # each rollout reaches the learner once (learned from, two per update, or dropped as stale while the
    # other actor ran ahead), each env step is counted once
    assert 2 * s["updates"] + s["channels"]["trajectory"]["drops"] == 320 and s["env_steps"] == 160 * 256
    if "deliver" in policy:   # nothing is dropped: every update is made
        assert s["updates"] == 160
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert float(rows[-1]["restarts"]) == 1.0
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_max_restarts_zero_stops_the_run_when_an_actor_dies():
    killer = kill_actor_later(after=1.0)
    with pytest.raises(WorkerDied, match="not restarted: --max-restarts is 0"):
        ff.run(ppo.train, ppo.Args(total_timesteps=200 * 256, num_envs=4, num_steps=64),
               policy="actor_learner(actors=2)", max_restarts=0)
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


def small_dev_shm(monkeypatch, free: int) -> None:
    """Make /dev/shm report ``free`` bytes free (os.statvfs of every other path is left as it is)."""
    real = os.statvfs

    def statvfs(path: Any) -> Any:
        st = real(path)
        if os.fspath(path) != "/dev/shm":
            return st
        return os.statvfs_result((st.f_bsize, 4096, 16384, free // 4096, free // 4096, *tuple(st)[5:]))

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_a_placement_whose_segments_do_not_fit_in_dev_shm_is_refused_before_any_worker_starts(monkeypatch, tmp_path):
    """A /dev/shm smaller than the placement's segments (Docker's default 64 MB; ppo_atari's need
    about 110 MB) killed the driver with SIGBUS as it zeroed a broadcast (no message, no summary.json),
    or an actor as it first wrote to its ring."""
    from fragflow.backends.local import LocalBackend
    from fragflow.errors import SharedMemoryError

    small_dev_shm(monkeypatch, 128 << 10)
    started: list[str] = []
    monkeypatch.setattr(LocalBackend, "start", lambda self, target, args, name: started.append(name))
    with pytest.raises(SharedMemoryError) as info:
        ff.run(ppo.train, ARGS, policy="actor_learner(actors=2)", out=tmp_path / "run")
    msg = str(info.value)
    assert re.search(r"need \d+\.\d MB of shared memory and /dev/shm has 0\.1 MB free", msg), msg
    assert "--shm-size=" in msg and "num_envs" in msg and "largest: broadcast of state" in msg
    assert started == [] and mp.active_children() == [] and shm_leftovers() == []
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_the_shared_memory_a_placement_is_checked_for_is_what_its_wiring_makes(monkeypatch):
    """The sizes the check adds up are those of the segments wire() makes, one for one."""
    from fragflow.backends.local import LocalBackend, segment_sizes
    from fragflow.backends.local.shm import Segment
    from fragflow.driver import compile

    made: list[int] = []
    real = Segment.create
    monkeypatch.setattr(Segment, "create", staticmethod(lambda nbytes: made.append(nbytes) or real(nbytes)))
    for policy in ("actor_learner(actors=2)", "central_inference(env_workers=2)"):
        lowered = compile(ppo.train, ARGS, policy=policy).lowered
        made.clear()
        wiring = LocalBackend().wire(lowered)
        try:
            assert len(wiring.segments) == len(made) > 2
            assert sorted(made) == sorted(n for _, n in segment_sizes(lowered))
            # each segment's pages are taken as it is made (a full /dev/shm is an error then, not a SIGBUS later)
            assert all(os.stat(f"/dev/shm/{seg.name}").st_blocks * 512 >= n for seg, n in zip(wiring.segments, made))
        finally:
            wiring.release()
    assert shm_leftovers() == []


def test_an_actor_killed_by_sigbus_is_not_restarted_and_the_error_says_why():
    """A SIGBUS is most likely /dev/shm running out: a restarted actor died the same way, and a later
    restart could fail on ENOSPC, reported as the program's error."""
    from fragflow.runtime.exits import ended, not_restarted

    assert not_restarted("actor", -signal.SIGKILL, None, 0, 3) is None
    assert not_restarted("actor", 1, None, 2, 3) is None
    assert "SIGBUS" in not_restarted("actor", -signal.SIGBUS, None, 0, 3)
    assert not_restarted("actor", -signal.SIGKILL, None, 3, 3) == "it was restarted 3 times already (--max-restarts 3)"
    assert not_restarted("actor", -signal.SIGKILL, None, 0, 0) == "--max-restarts is 0"
    assert not_restarted("learner", -signal.SIGKILL, None, 0, 3) == "only actors are restarted"
    assert not_restarted("actor", -signal.SIGKILL, "why not", 0, 3) == "why not"
    assert ended(-signal.SIGKILL) == f"was killed by signal {int(signal.SIGKILL)}"
    assert ended(3) == "exited with code 3"
    assert ended(-signal.SIGBUS).startswith(f"was killed by signal {int(signal.SIGBUS)} (SIGBUS: most likely "
                                            "shared memory (/dev/shm) ran out")

    killer = kill_actor_later(after=1.0, sig=signal.SIGBUS)
    with pytest.raises(WorkerDied, match=rf"actor 1 process was killed by signal {int(signal.SIGBUS)} \(SIGBUS: most "
                                         r"likely shared memory \(/dev/shm\) ran out.*not restarted: a process killed "
                                         r"by SIGBUS would most likely be killed again"):
        ff.run(ppo.train, ppo.Args(total_timesteps=200 * 256, num_envs=4, num_steps=64), policy="actor_learner(actors=2)")
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_an_actor_that_cannot_be_restarted_for_want_of_shared_memory_is_a_death_not_the_programs_error(monkeypatch):
    """A restart's report queue makes semaphores in /dev/shm: a full one raised ENOSPC, which the
    run reported as an error of the training program."""
    import errno

    from fragflow.backends.local import Reports

    real, asked = Reports.new, []

    def new(self: Any, process: str) -> Any:
        asked.append(process)
        if asked.count(process) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, process)

    monkeypatch.setattr(Reports, "new", new)
    killer = kill_actor_later(after=1.0)
    with pytest.raises(WorkerDied, match=r"actor 1 was killed by signal 9; it could not be restarted: \[Errno 28\] No "
                                         r"space left on device \(most likely shared memory \(/dev/shm\) ran out"):
        ff.run(ppo.train, ppo.Args(total_timesteps=200 * 256, num_envs=4, num_steps=64), policy="actor_learner(actors=2)")
    killer.join()
    assert asked.count("actor-1") == 2
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_a_killed_learner_is_named_not_the_peer_that_lost_its_connection():
    """Under multi_learner the other learner fails on its collective with the dead one (a gloo
    connection error): the run names the learner that was killed."""
    killer = kill_actor_later(name="fragflow-learner.0-0", after=1.5)
    with pytest.raises(WorkerDied, match="learner.0 process was killed by signal 9"):
        ff.run(ppo.train, ppo.Args(total_timesteps=400 * 256, num_envs=4, num_steps=64),
               policy="multi_learner(learners=2, actors=1)")
    killer.join()
    assert mp.active_children() == []
    assert shm_leftovers() == []


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_cli_reports_a_killed_worker_as_a_death_not_as_the_programs_error(tmp_path):
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("fragflow")
    proc = subprocess.Popen([str(exe), "run", "ppo", "--policy", "pipelined", "--out", str(out), "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [p for p in children_of(proc.pid) if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()]
        assert workers
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "a worker process died:" in err and "was killed by signal 9" in err, err
    assert "Traceback" not in err and "the training program raised" not in err
    assert shm_leftovers(proc.pid) == []


LEARN_ON_DATA = """
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fragflow as ff


@dataclass(frozen=True)
class Args:
    num_envs: int = 4
    num_steps: int = 16
    updates: int = 60
    lr: float = 0.01
    seed: int = 0


@ff.fragment("actor")
def act(w, obs, key):
    logits = obs @ w
    return np.argmax(logits + ff.random.gumbel(key, (logits.shape[-1],)), axis=-1)


@ff.fragment("learner", writes="state")
def learn(state, batch, lr):
    obs, action, reward = batch["obs"], batch["action"], batch["reward"]
    ret = np.cumsum(reward[::-1], axis=0)[::-1]
    adv = (ret - ret.mean()) / (ret.std() + 1e-8)
    logits = obs @ state["w"]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    grad = np.einsum("tei,tej,te->ij", obs, np.eye(2)[action] - p, adv) / adv.size
    return {"w": state["w"] + lr * grad}, {"mean_reward": float(reward.mean())}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=args.num_envs, seed=args.seed)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(args.num_steps)
    key = ff.random.keys(args.seed, env.ids)
    obs = env.reset()
    for update in range(args.updates):
        for _ in range(args.num_steps):
            key, sub = ff.random.split(key)
            action = act(state["w"], obs, sub)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward)
            obs = next_obs
        batch = buf.collect()
        if (terminated | truncated).any():       # learn only when an episode ended on the last step (data-dependent)
            state, metrics = learn(state, batch, args.lr)
            ff.log(metrics)
    return state
"""


ACT_ON_DATA = LEARN_ON_DATA.replace("""
        batch = buf.collect()
        if (terminated | truncated).any():       # learn only when an episode ended on the last step (data-dependent)
            state, metrics = learn(state, batch, args.lr)
            ff.log(metrics)""", """
        batch = buf.collect()
        state, metrics = learn(state, batch, args.lr)
        ff.log(metrics)""").replace("""
            action = act(state["w"], obs, sub)""", """
            if update > 0 and (terminated | truncated).any():   # acts greedily after an episode ended (data)
                action = act_greedy(state["w"], obs)
            else:
                action = act(state["w"], obs, sub)""").replace("""
@ff.fragment("learner", writes="state")""", """
@ff.fragment("actor")
def act_greedy(w, obs):
    return np.argmax(obs @ w, axis=-1)


@ff.fragment("learner", writes="state")""")


LEARN_ON_BATCH = LEARN_ON_DATA.replace("""
        if (terminated | truncated).any():       # learn only when an episode ended on the last step (data-dependent)
            state, metrics = learn(state, batch, args.lr)""", """
        if batch["obs"][..., 2].mean() > 0:   # learn only on a batch whose pole leans right (data-dependent)
            state, metrics = learn(state, batch, args.lr)  # @learn""")


def test_replicas_calling_a_learner_on_their_own_data_stop_at_once(write_algo, tmp_path):
    """A learner or an actor called under an `if` on data: one env worker's next call into the
    learner's process is another fragment than the other's. Each waited for the other's other call
    for good (a warning after 30 s: an actor chosen on data; a learner called on a batch's mean),
    or, where the learner's calls were paired later, refused then; now refused at the first call
    that differs, naming both calls."""
    exe = Path(sys.executable).with_name("fragflow")
    assert "act_greedy(state" in ACT_ON_DATA and "def act_greedy" in ACT_ON_DATA and "learn only when" not in ACT_ON_DATA
    assert "learn only on a batch" in LEARN_ON_BATCH and "learn only when" in LEARN_ON_DATA
    for name, source, first, second in [("learn_on_data.py", LEARN_ON_DATA.replace("learn(state, batch, args.lr)",
                                                                                   "learn(state, batch, args.lr)  # @learn"),
                                         "act", "learn"),
                                        ("act_on_data.py", ACT_ON_DATA, "act", "act_greedy"),
                                        ("learn_on_batch.py", LEARN_ON_BATCH, "act", "learn")]:
        path, marks = write_algo(source, name)
        program = load(str(path))
        assert ff.run(program.train, program.args_cls(updates=8), policy="single_process").summary["status"] == "completed"
        res = subprocess.run([str(exe), "run", str(path), "--policy", "central_inference(env_workers=2)", "--out",
                              str(tmp_path / f"run_{name}"), "--quiet", "--set", "updates=20"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        calls = sorted(re.findall(r"'(act|act_greedy|learn)' \(at ", res.stderr))
        assert calls == sorted([first, second]), res.stderr
        assert "this policy takes one call of each replica at a time, in order, and the replicas' calls differ" in res.stderr
        if "learn" in calls:   # (named at the learner's line)
            assert re.search(rf"\n\s+at \S+/{name}:{marks['learn']}\n", res.stderr), res.stderr


@pytest.mark.parametrize("sig, code, status", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_stops_every_process_and_leaves_no_shared_memory(tmp_path, sig, code, status):
    import json

    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("fragflow")
    proc = subprocess.Popen([str(exe), "run", "ppo", "--policy", "pipelined(actors=2)", "--out", str(out), "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = children_of(proc.pid)
        assert len(workers) >= 3        # learner, two actors (and the resource tracker)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=10)
        assert time.monotonic() - sent < 5
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, proc.stderr.read() if proc.stderr else ""
    time.sleep(0.5)
    assert [p for p in workers if alive(p)] == []
    assert shm_leftovers(proc.pid) == []
    assert json.loads((out / "summary.json").read_text())["status"] == status


def test_a_learner_drawing_from_the_global_generators_draws_the_same_numbers_every_run(write_algo, tmp_path):
    """The learner's process starts with the loop's random states as the loop made its state
    (after the program's seeding): a learner that shuffles with torch.randperm or numpy's global
    generator draws the same numbers in every run (each a new process) under a deterministic policy."""
    from tests.test_checkpoint import PROGRAM

    source = PROGRAM.replace("    return state, {\"loss\": loss.detach()}\n",
                             "    return state, {\"loss\": loss.detach(), \"draw\": float(np.random.permutation(1000)[0])"
                             " + float(torch.rand(()))}\n", 1)
    source = source.replace("    torch.manual_seed(args.seed)\n", "    torch.manual_seed(args.seed)\n    np.random.seed(args.seed)\n", 1)
    assert "np.random.permutation" in source and "np.random.seed" in source
    path, _ = write_algo(source, "drawing.py")
    exe = Path(sys.executable).with_name("fragflow")
    draws = []
    for run in ("a", "b"):
        res = subprocess.run([str(exe), "run", str(path), "--policy", "pipelined", "--out", str(tmp_path / run), "-q"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.returncode == 0, res.stderr
        draws.append([row["draw"] for row in csv.DictReader((tmp_path / run / "metrics.csv").open())])
    assert len(draws[0]) == 8 and draws[0] == draws[1]


SERVED_EXTRAS = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1), None, {}, {"logits": obs @ w}

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    seen = []
    for _ in range(3):
        for _ in range(4):
            action, nothing, empty, more = act(state["w"], obs)
            seen.append((nothing, empty, sorted(more), more["logits"].shape))
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, _ = learn(state, buf.collect())
    return seen
"""


@pytest.mark.parametrize("policy", ["single_process", "central_inference(env_workers=2)"])
def test_a_served_actors_outputs_come_back_whole_with_what_has_no_array(write_algo, policy):
    """None and an empty dict among an actor's outputs are not sent (no array): the loop gets them
    back from the traced output's skeleton, in place."""
    path, _ = write_algo(SERVED_EXTRAS, "extras.py")
    program = load(str(path))
    seen = ff.run(program.train, policy=policy).value
    rows = 4 if policy == "single_process" else 2
    assert seen == [(None, {}, ["logits"], (rows, 2))] * 12


STATIC_ARGS_WITH_JAX = """
from dataclasses import dataclass

import jax  # noqa: F401  -- only imported, never used
import numpy as np

import fragflow as ff


@dataclass(frozen=True)
class Args:
    updates: int = 3
    lr: float = 0.01


@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)


@ff.fragment("learner", writes="state")
def learn(state, batch, args: Args):
    return {"w": state["w"] + args.lr * batch["obs"].mean()}, {"m": float(batch["obs"].mean())}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(8):
            action = act(state["w"], obs)
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect(), args)
        ff.log(metrics)
    return state
"""


def test_an_args_dataclass_of_the_users_file_reaches_workers_started_from_a_fork_server(write_algo, tmp_path):
    """Importing jax makes fragflow start workers from a fork server, which has not imported the
    user's file: a static argument (the Args dataclass) travels by value, not by its module's name
    (the queue's own pickling failed in its feeder thread and the run waited for good)."""
    path, _ = write_algo(STATIC_ARGS_WITH_JAX, "static_jax.py")
    exe = Path(sys.executable).with_name("fragflow")
    res = subprocess.run([str(exe), "run", str(path), "--policy", "pipelined", "--out", str(tmp_path / "run"), "-q"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "PicklingError" not in res.stderr


UNEVEN_END = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    updates = 0
    while True:  # @loop
        for _ in range(4):
            obs, *_ = env.step(act(state["w"], obs))
            buf.add(obs=obs)
        state, _ = learn(state, buf.collect())  # @learn
        updates += 1
        if updates >= (3 if 0 in env.ids else 6):   # each replica on its own environments' ids
            break  # @break
    return state
"""


@pytest.mark.parametrize("more", [6, 4])
@pytest.mark.parametrize("policy", ["pipelined(actors=2)", "actor_learner(actors=2, max_lag=0)",
                                    "actor_learner(actors=2)", "async_relaxed(actors=2)"])
def test_replicas_leaving_the_loop_at_different_trips_stop_the_run_with_the_reason(write_algo, policy, more):
    """Gathered as they arrive (max_lag >= 1), the run waited for good (actor_learner: the replica
    left waited for a version the learner could not make) or went on (async_relaxed) (helper round 33 A3).
    Then it was refused only where the learner's process saw the replica with fewer trips end while
    the other still called: one trip apart, the run mostly completed (both had ended by then), at
    times not (refused 8 of 12 runs, helper round 34 B5). Now refused whatever the timing (at the
    latest once every replica has ended), at the loop's `break` (it was the loop's header line: open problem 2)."""
    from fragflow.errors import ConfigError

    path, marks = write_algo(UNEVEN_END.replace("else 6", f"else {more}"), "uneven_end.py")
    program = load(str(path))
    assert ff.run(program.train, policy="single_process").summary["updates"] == 3
    taken = "4" if more == 4 else r"\d"
    with pytest.raises(ConfigError, match=rf"loop replica\(s\) 0 ended the training loop while replica\(s\) 1 still "
                                          rf"called 'learn'.* left the loop \(`while True`, at {relpath(path)}:"
                                          rf"{marks['loop']}\) at different trips, by its `break` at {relpath(path)}:{marks['break']} .* or call "
                                          rf"'learn' \(at "
                                          rf"{relpath(path)}:{marks['learn']}\) under an `if` on such data \(calls "
                                          rf"of it taken: replica 0: 3, replica 1: {taken}\)\n"
                                          rf"  at {relpath(path)}:{marks['break']}\n"):
        ff.run(program.train, policy=policy)
    assert mp.active_children() == []
    assert shm_leftovers() == []


EVAL_BREAK = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):   # each update moves the policy toward a pole-angle controller
    target = np.array([[0.0, 0.0], [0.0, 0.0], [-1.0, 1.0], [-0.3, 0.3]])
    return {"w": state["w"] + 0.15 * (target - state["w"]) + 0.0 * batch["obs"].mean()}, {}

def evaluate(w, eval_env):
    obs = eval_env.reset()
    total, done = np.zeros(eval_env.num_envs), np.zeros(eval_env.num_envs, bool)
    for _ in range(200):
        obs, r, te, tr, _ = eval_env.step(act(w, obs))
        total += r * ~done
        done |= te | tr
        if done.all():
            break
    return float(total.mean())

def train(target=195.0):
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    eval_env = ff.envs.make("CartPole-v1", num_envs=2, seed=100, evaluation=True)
    state = ff.versioned({"w": np.array([[0.3, -0.3], [0.0, 0.0], [0.2, -0.2], [0.0, 0.0]])})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for update in range(60):  # @loop
        for _ in range(8):
            a = act(state["w"], obs)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        state, _ = learn(state, buf.collect())
        if update % 2 == 1:
            eval_return = evaluate(state["w"], eval_env)
            ff.log({"eval": eval_return})
            if eval_return >= target:
                break  # @break
    return state
"""


def test_a_break_on_an_evaluations_return_runs_where_every_replica_evaluates_the_same_version(write_algo, tmp_path):
    """A loop that leaves on an evaluation's return, evaluated every 2 updates on an evaluation env
    (which every replica steps whole): at max_lag=0 and under pipelined every replica evaluates the
    same version, so they leave at the same trip, as single_process does (open problem 2: the fix the
    refusal below names)."""
    path, _ = write_algo(EVAL_BREAK, "eval_break.py")
    program = load(str(path))
    expected = ff.run(program.train, policy="single_process", out=tmp_path / "one")
    assert expected.summary["updates"] == 8
    evals = [r["eval"] for r in csv.DictReader((tmp_path / "one" / "metrics.csv").open()) if r["eval"]]
    assert [float(e) for e in evals][-1] >= 195 > max(float(e) for e in evals[:-1])
    for i, policy in enumerate(["actor_learner(actors=2, max_lag=0)", "async_relaxed(actors=2, max_lag=0)",
                                "pipelined(actors=2, max_lag=0)"]):
        result = ff.run(program.train, policy=policy, out=tmp_path / str(i))
        assert same_tree(result.value, expected.value) and result.summary["updates"] == 8, policy
        assert [r["eval"] for r in csv.DictReader((tmp_path / str(i) / "metrics.csv").open()) if r["eval"]] == evals


@pytest.mark.parametrize("policy, fix", [("actor_learner(actors=2)", "actor_learner(actors=2, max_lag=0)"),
                                         ("async_relaxed(actors=2, max_lag=2)", "async_relaxed(actors=2, max_lag=0)")])
def test_replicas_leaving_the_loop_apart_on_an_evaluation_are_stopped_at_the_break_with_the_fix(
        write_algo, policy, fix):
    """Gathered as they arrive, each replica evaluates the newest version it has, which differs between
    them, so they may leave at different trips. The message named the loop's header line and suggested
    only a count, one replica or single_process; it names the `break` and its `if`, and the policy at
    max_lag=0 (open problem 2). The replicas are made to leave apart here whatever the timing: replica
    0 leaves at its first evaluation (any return reaches its target), replica 1 not before update 5
    (with a target the first evaluation reached, replica 0 could evaluate a version too old to reach
    it, and replica 1 one a few updates ahead that did, and both leave at the same trip: the test
    failed one run in about twenty)."""
    from fragflow.errors import ConfigError

    condition = "eval_return >= (-1.0 if 0 in env.ids else target + 1000.0 * (update < 5))"
    path, marks = write_algo(EVAL_BREAK.replace("if eval_return >= target:", f"if {condition}:"), "eval_break_apart.py")
    program = load(str(path))
    with pytest.raises(ConfigError, match=rf"left the loop \(`for update in range\(60\)`, at {relpath(path)}:"
                                          rf"{marks['loop']}\) at different trips, by its `break` at {relpath(path)}:"
                                          rf"{marks['break']} \(under `if {re.escape(condition)}`\), on a value each "
                                          rf"replica computes on its own \(data of its "
                                          rf"own environments, or an evaluation of the version it acts with(.|\n)*"
                                          rf"  at {relpath(path)}:{marks['break']}\n"
                                          rf"  fix: where it is an evaluation env's return, run with --policy "
                                          rf"\"{re.escape(fix)}\" or pipelined"):
        ff.run(program.train, policy=policy)
    assert mp.active_children() == []
    assert shm_leftovers() == []


def test_replicas_leaving_apart_on_an_evaluation_first_made_after_the_trace_are_given_the_evaluations_fix(write_algo):
    """The same, evaluating every 4 updates: the trace (2 updates) never stepped the evaluation env,
    and the message said only "a break on data of their own environments?" with a fix of a count, one
    replica or single_process, not the max_lag=0 policy where every replica evaluates the same version
    (helper round 37 A: a `while` on a solved evaluation, evaluated every 3 updates). The program's
    evaluation env, made before the loop, says it now."""
    from fragflow.errors import ConfigError

    path, marks = write_algo(EVAL_BREAK.replace("if eval_return >= target:",
                                                "if eval_return >= (50.0 if 0 in env.ids else target):")
                             .replace("if update % 2 == 1:", "if update % 4 == 3:"), "eval_break_late.py")
    program = load(str(path))
    with pytest.raises(ConfigError, match=rf"an evaluation of the version it acts with(.|\n)*"
                                          rf"  at {relpath(path)}:{marks['break']}\n"
                                          rf"  fix: where it is an evaluation env's return, run with --policy "
                                          rf"\"actor_learner\(actors=2, max_lag=0\)\" or pipelined"):
        ff.run(program.train, policy="actor_learner(actors=2)")


def test_learners_whose_replicas_leave_the_loop_at_different_trips_stop_the_run_with_the_reason(write_algo):
    """The learner still updating failed in gloo's all-reduce ('Connection closed by peer') (helper round 33 A4)."""
    from fragflow.errors import ConfigError

    torch_learner = UNEVEN_END.replace("import numpy as np", "import numpy as np\nimport torch").replace(
        """    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {}""",
        """    loss = (torch.as_tensor(batch["obs"], dtype=torch.float32) @ state["w"]).pow(2).mean()
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    return state, {}""").replace(
        """    state = ff.versioned({"w": np.ones((4, 2))})""",
        """    w = torch.ones(4, 2, requires_grad=True)
    state = ff.versioned({"w": w, "opt": torch.optim.SGD([w], lr=0.01)})""").replace(
        "np.argmax(obs @ w, axis=-1)", "np.argmax(obs @ w.detach().numpy(), axis=-1)")
    path, marks = write_algo(torch_learner, "uneven_end_torch.py")
    program = load(str(path))
    assert ff.run(program.train, policy="single_process").summary["updates"] == 3
    # (it named no `break`: the loop, its `break` and the `if` around it, as the loop replicas' own message)
    with pytest.raises(ConfigError, match=rf"learner\(s\) 0 ended their run .* while learner 1 still updated in 'learn'"
                                          rf".* left the loop \(`while True`, at {relpath(path)}:{marks['loop']}\) at "
                                          rf"different trips, by its `break` at {relpath(path)}:{marks['break']} \(under "
                                          rf"`if updates >= \(3 if 0 in env.ids else 6\)`\), on a value each replica "
                                          rf"computes on its own \(data of its own environments\)\n"
                                          rf"  at {relpath(path)}:{marks['break']}\n"):
        ff.run(program.train, policy="multi_learner")
    assert mp.active_children() == []
    assert shm_leftovers() == []
    # a learner's own error is the run's, not the other's failed all-reduce nor a different-trips
    # diagnosis (the first reached the driver first: review of round 33)
    own, _ = write_algo(torch_learner.replace("    state[\"opt\"].step()\n", """    state["opt"].step()
    import multiprocessing
    if multiprocessing.current_process().name.startswith("fragflow-learner.1"):
        raise ValueError("learner one's own bug")
"""), "own_error.py")
    with pytest.raises(WorkerFailed, match=r"learner.1 failed in fragment 'learn'(.|\n)*learner one's own bug"):
        ff.run(load(str(own)).train, policy="multi_learner")
    assert mp.active_children() == [] and shm_leftovers() == []


LOGGED = """
import numpy as np
import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, batch):
    w = state["w"] + 1e-3 * batch["obs"].mean()
    metrics = {"loss": float(np.abs(w).sum()), "parts": {"a": float(w[0, 0]), "b": [float(w[1, 1])]}}
    if state["n"] >= 2:   # a metric first returned after the first calls (within the trace or after it)
        metrics["late"] = float(state["n"])
    if state["n"] % 3 == 0:   # one returned now and then
        metrics["now_and_then"] = float(state["n"])
    return {"w": w, "n": state["n"] + 1}, metrics, w[0]

def train(opts=None):   # ff.run(train, {"named": True}) passes the dict
    named, late_element = bool(opts and opts.get("named")), bool(opts and opts.get("late_element"))
    after_trace = bool(opts and opts.get("after_trace"))
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2)), "n": 0})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for u in range(6):
        for _ in range(4):
            obs, *_ = env.step(np.zeros_like(obs[:, 0], np.int64))
            buf.add(obs=obs)
        state, m, row = learn(state, buf.collect())
        ff.log(m)
        ff.log({"again": m["parts"], "b0": m["parts"]["b"][0], "v0": row[0]})   # an element of an array output
        if u % 2 == 1:
            ff.log({"odd": m["loss"]})   # logged after some of the learner's calls only
        if named:
            ff.log({f"loss{u}": m["loss"]})   # a name made from the update number
        if late_element and u == 5:
            ff.log({"v1": row[1]})   # @late
        if after_trace and u == 4:
            ff.log({"once": m["loss"]})   # first logged after the trace (which stops after 2 updates)
    return state
"""


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "async_relaxed(actors=2)"])
def test_a_learner_output_first_logged_after_the_trace_reaches_a_row_where_calls_are_gathered_on_arrival(
        write_algo, tmp_path, policy):
    """Gathered on arrival, a learner's outputs are logged by the names the trace saw: one the loop
    logs first after it (`if update % 10 == 9: ff.log(m)`) was never written, with no word
    (helper round 29 N03). It is written once, as the loop logs it: the learner's latest value."""
    path, _ = write_algo(LOGGED, "logged.py")
    program = load(str(path))
    ff.run(program.train, {"after_trace": True}, policy=policy, out=tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    once = [r["once"] for r in rows if r.get("once")]
    assert len(once) == 1 and once[0] in [r["loss"] for r in rows]


LOG_EVERY_SECOND = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    log_every: int = 2
    num_updates: int = 20

@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    w = state["w"] + 1e-3 * batch["obs"].mean()
    return {"w": w, "n": state["n"] + 1}, {"loss": float(np.abs(w).sum()), "n": float(state["n"])}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.ones(1), "n": 0})
    buf = ff.RolloutBuffer(16)
    obs = env.reset()
    for update in range(args.num_updates):
        for _ in range(16):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        if update % args.log_every == 0:
            ff.log(metrics)
            ff.log({"u": float(update)})   # (a value of the loop's own, logged with them)
    return state
"""


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "async_relaxed(actors=2)"])
def test_a_loop_logging_every_second_update_has_those_rows_and_their_steps_where_calls_are_gathered_on_arrival(
        write_algo, tmp_path, policy):
    """Gathered on arrival, a loop that logs the learner's metrics at every second update got them in
    every row (the driver wrote every name the trace saw at every update), and the rows counted the
    env steps that had reached the driver (the workers report every 0.2 s: a short run's rows 1-17 said
    0 steps). The j-th update's row now holds what loop replica 0 logged of its j-th call, with that
    update's values: single_process's rows (but for a call dropped as stale, which leaves the run an
    update fewer); and the steps each replica had made at its latest call taken: 64 an update, 1280
    in all."""
    path, _ = write_algo(LOG_EVERY_SECOND, "every_second.py")
    program = load(str(path))
    ff.run(program.train, program.args_cls(), policy="single_process", out=tmp_path / "one")
    result = ff.run(program.train, program.args_cls(), policy=policy, out=tmp_path / "two")
    one = list(csv.DictReader((tmp_path / "one" / "metrics.csv").open()))
    rows = list(csv.DictReader((tmp_path / "two" / "metrics.csv").open()))
    assert [r["n"] for r in one] == [f"{float(u)}" if u % 2 == 0 else "" for u in range(20)] == [r["u"] for r in one]
    assert {"loss", "n"} <= set(rows[0]) and set(one[0]) <= set(rows[0])
    updates = result.summary["updates"]
    drops = result.summary["channels"]["trajectory"]["drops"]
    rows = without_closing_row(rows, result.summary)
    assert [float(r["updates"]) for r in rows] == [float(u) for u in range(1, updates + 1)]
    logged = [r for r in rows if r["loss"] != ""]
    assert [float(r["updates"]) for r in logged] == [float(j) for j in range(1, updates + 1, 2)]
    assert all(float(r["n"]) == float(r["updates"]) - 1 for r in logged)   # each the value of its row's update
    # the loop's own value logged with them in the same row (it went to the newest row, apart from
    # the learner's values, where replica 0 ran ahead of or behind the learner)
    assert [r["u"] for r in rows] == [r["n"] for r in rows]
    steps = [float(r["env_steps"]) for r in rows]
    assert all(s % 32 == 0 and s >= 64 * j for j, s in enumerate(steps, 1)) and steps == sorted(steps)
    assert steps[-1] <= 1280 and result.summary["env_steps"] == 1280
    if drops == 0:
        assert steps == [64.0 * j for j in range(1, 21)] and [r["n"] for r in rows] == [r["n"] for r in one]
    episodes = [float(r["episodes"]) for r in rows]
    assert episodes == sorted(episodes) and episodes[-1] <= result.summary["episodes"]


TWO_LEARNERS = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(a, obs):
    return (obs[:, 2] * a["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="a")
def learn_a(a, batch):
    return {"w": a["w"] + 1e-3 * batch["obs"].mean(), "n": a["n"] + 1}, {"aw": float(a["n"] + 1)}

@ff.fragment("learner", writes="b")
def learn_b(b, batch):
    return {"n": b["n"] + 1}, {"bw": float(b["n"] + 1)}

@dataclass(frozen=True)
class Args:
    b_first: bool = True
    trips: int = 10
    log_before: bool = False   # the loop's value and learn_b's logged before the clock is called

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    a = ff.versioned({"w": np.ones(1), "n": 0})
    b = ff.versioned({"n": 0})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for trip in range(args.trips):
        for _ in range(4):
            obs, *_ = env.step(act(a, obs))
            buf.add(obs=obs)
        batch = buf.collect()
        if args.log_before:
            ff.log({"trip": float(trip)})
            b, bm = learn_b(b, batch)
            ff.log(bm)
            a, am = learn_a(a, batch)
            ff.log(am)
            continue
        if args.b_first:
            b, bm = learn_b(b, batch)
            a, am = learn_a(a, batch)
        else:
            a, am = learn_a(a, batch)
            b, bm = learn_b(b, batch)
        ff.log(am)
        ff.log(bm)
    return a
"""


def without_closing_row(rows: list[dict[str, str]], summary: dict) -> list[dict[str, str]]:
    """The rows but the last one a run gathered on arrival writes, with a note, for what the loop logged
    after learner calls dropped as stale (they made no update): a row past the run's updates."""
    drops = sum(c.get("drops", 0) for c in summary.get("channels", {}).values())
    if drops and len(rows) == summary["updates"] + 1 and any("dropped as stale" in n for n in summary.get("notes") or ()):
        assert float(rows[-1]["updates"]) == summary["updates"]
        return rows[:-1]
    return rows


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "async_relaxed(actors=2, max_lag=2)",
                                    "central_inference(env_workers=2, max_lag=1)"])
@pytest.mark.parametrize("b_first", [True, False])
def test_a_second_learners_logged_values_join_the_rows_replica_0_logged_them_in_where_calls_are_gathered_on_arrival(
        write_algo, tmp_path, policy, b_first):
    """Gathered on arrival, what the loop logged of a second learner's outputs (one no actor reads:
    not the clock) went to the row of the update the driver had reached when that learner's call
    came: before the clock's first update a row of its own (``updates=0`` with the run's last step
    count), later a value a row behind, two calls in one row, rows without it (helper round 40). It
    now goes where replica 0 logged it, as the loop's own values do: every update's row has both
    learners' values, with no row single_process does not write."""
    path, _ = write_algo(TWO_LEARNERS, "two_learners.py")
    program = load(str(path))
    result = ff.run(program.train, program.args_cls(b_first=b_first), policy=policy, out=tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    updates = result.summary["updates"]
    drops = sum(c.get("drops", 0) for c in result.summary["channels"].values())
    rows = without_closing_row(rows, result.summary)
    assert [float(r["updates"]) for r in rows] == [float(j) for j in range(1, updates + 1)]
    assert [float(r["aw"]) for r in rows] == [float(j) for j in range(1, updates + 1)]
    missing = [r["updates"] for r in rows if r["bw"] == ""]
    assert len(missing) <= drops, (missing, drops)
    bw = [float(r["bw"]) for r in rows if r["bw"] != ""]
    # (each the learner's count at the call that merged replica 0's call: two replicas' calls a merge)
    assert bw == sorted(bw) and bw[0] >= 1 and bw[-1] <= 10
    steps = [float(r["env_steps"]) for r in rows]
    assert steps == sorted(steps) and steps[-1] <= result.summary["env_steps"] == 80


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "async_relaxed(actors=2, max_lag=2)",
                                    "central_inference(env_workers=2, max_lag=1)"])
def test_values_logged_before_the_clock_make_rows_of_their_own_where_calls_are_gathered_on_arrival(
        write_algo, tmp_path, policy):
    """Values the loop logs after its env steps and before the clock's call (its own, a second
    learner's) are a row of their own under single_process, after the update's. Gathered on arrival,
    the loop's went to rows at updates=0, all before the first update's row, with steps going back,
    and the second learner's into the update's row a row off (helper round 41). They now make the
    loop's rows, in single_process's order, their steps within the rows around them."""
    path, _ = write_algo(TWO_LEARNERS, "two_learners.py")
    program = load(str(path))
    shapes = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        result = ff.run(program.train, program.args_cls(log_before=True), policy=pol, out=tmp_path / run)
        rows = list(csv.DictReader((tmp_path / run / "metrics.csv").open()))
        steps = [float(r["env_steps"]) for r in rows]
        assert steps == sorted(steps) and steps[-1] <= result.summary["env_steps"]
        drops = sum(c.get("drops", 0) for c in result.summary.get("channels", {}).values())
        shapes.append(([(float(r["updates"]), r["trip"] != "", r["bw"] != "", r["aw"] != "") for r in rows], drops))
    (one, _), (other, drops) = shapes
    assert one == [(float(u), True, True, False) if k == 0 else (float(u + 1), False, False, True)
                   for u in range(10) for k in range(2)]
    if drops == 0:
        assert other == one
    else:   # (a dropped call: an update fewer, a row without a value)
        assert [r[0] for r in other] == sorted(r[0] for r in other) and len(other) >= len(one) - 2 * drops


def test_a_clock_output_logged_after_the_next_clock_call_joins_the_row_replica_0_logged_it_in(write_algo, tmp_path):
    """Gathered on arrival, a learner output the loop logs one trip late (``ff.log({"prev": prev})``
    after the next update) went to the row of the update that computed it, a row early (review of
    round 41's fix); it joins the row replica 0 logged it in, as under single_process."""
    source = TWO_LEARNERS.replace("""        if args.log_before:""", """        if args.log_before:   # (here: the previous trip's metrics, after this trip's update)
            a, am = learn_a(a, batch)
            if trip:
                ff.log({"prev": prev})
            prev = am["aw"]
            continue""", 1)
    path, _ = write_algo(source, "late.py")
    program = load(str(path))
    columns = []
    for run, pol in (("one", "single_process"), ("other", "actor_learner(actors=2)")):
        result = ff.run(program.train, program.args_cls(log_before=True), policy=pol, out=tmp_path / run)
        rows = list(csv.DictReader((tmp_path / run / "metrics.csv").open()))
        columns.append(([(r["updates"], r["prev"]) for r in rows], result.summary["channels"]["trajectory"]["drops"]
                        if "channels" in result.summary else 0))
    (one, _), (other, drops) = columns
    assert one == [("1", "")] + [(str(j), f"{j - 1}.0") for j in range(2, 11)]
    if drops == 0:
        assert other == one


EVALUATED_EACH_TRIP = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    trips: int = 30

@ff.fragment("actor")
def act(a, obs):
    return (obs[:, 2] * a["w"][0] > 0).astype(np.int64)

@ff.fragment("learner", writes="a")
def learn(a, batch):
    return {"w": a["w"] + 1e-3 * batch["obs"].mean(), "n": a["n"] + 1}, {"aw": float(a["n"] + 1)}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    ev = ff.envs.make("CartPole-v1", num_envs=1, seed=1, evaluation=True)
    a = ff.versioned({"w": np.ones(1), "n": 0})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    eobs = ev.reset()
    for _ in range(args.trips):
        for _ in range(4):
            obs, *_ = env.step(act(a, obs))
            buf.add(obs=obs)
        a, am = learn(a, buf.collect())
        ff.log(am)
        for _ in range(5):   # (an evaluation episode ends every few trips)
            eobs, *_ = ev.step(act(a, eobs))
    return a
"""


@pytest.mark.parametrize("policy", ["actor_learner(actors=2)", "async_relaxed(actors=2, max_lag=2)"])
def test_evaluation_columns_count_the_episodes_replica_0_had_ended_by_each_row_where_calls_are_gathered_on_arrival(
        write_algo, tmp_path, policy):
    """Gathered on arrival, rows wait for the loops' reports and a short run's were written together at
    its end: every row's eval_episodes said the run's total (helper round 40). Each row now counts
    the evaluation episodes replica 0 had ended by its call of the row's update, as single_process's
    rows do (the policy acts alike here: the evaluation env's episodes end at the same trips)."""
    path, _ = write_algo(EVALUATED_EACH_TRIP, "evaluated.py")
    program = load(str(path))
    columns = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        result = ff.run(program.train, program.args_cls(), policy=pol, out=tmp_path / run)
        rows = without_closing_row(list(csv.DictReader((tmp_path / run / "metrics.csv").open())), result.summary)
        assert len(rows) == result.summary["updates"]
        columns.append([(float(r["updates"]), float(r["eval_episodes"])) for r in rows])
    evaluated = [e for _, e in columns[0]]
    assert evaluated[0] == 0 and evaluated[-1] >= 2 and evaluated == sorted(evaluated)
    assert columns[1] == columns[0][:len(columns[1])]


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_logged_learner_outputs_reach_the_rows_single_process_writes_them_to(write_algo, tmp_path, policy):
    """Where the learner runs apart, what the loop logs of its outputs reaches the same rows as under
    single_process: every key of ff.log(metrics), those it returns only from some call on or now and
    then too (the trace lets a learner's metrics gain and lose keys), nested
    lists as 'b/0', an element of an array output taken in the loop, and a value logged after some
    of the learner's calls only (in those rows, not in every one)."""
    path, _ = write_algo(LOGGED, "logged.py")
    program = load(str(path))
    columns = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        ff.run(program.train, policy=pol, out=tmp_path / run)
        rows = list(csv.DictReader((tmp_path / run / "metrics.csv").open()))
        columns.append({k: [r[k] for r in rows] for k in rows[0]
                        if k in ("loss", "late", "now_and_then", "b0", "v0", "odd") or k.startswith(("parts/", "again/"))})
    assert set(columns[0]) == {"loss", "parts/a", "parts/b/0", "again/a", "again/b/0", "b0", "v0", "late", "odd",
                               "now_and_then"}
    assert columns[0]["late"] == ["", "", "2.0", "3.0", "4.0", "5.0"]
    assert columns[0]["now_and_then"] == ["0.0", "", "", "3.0", "", ""]
    assert [v != "" for v in columns[0]["odd"]] == [False, True] * 3
    assert columns[1] == columns[0]


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_a_namedtuple_output_logged_by_index_reaches_the_rows(tmp_path, write_algo, policy):
    """ff.log({"r": metrics[0]}) of a learner's namedtuple output: its part is reported by field
    name, and the loop's index named nothing there, so the column was silently left out (round 28 K05)."""
    path, _ = write_algo("""
        from collections import namedtuple
        import numpy as np
        import fragflow as ff

        M = namedtuple("M", "r s")

        @ff.fragment("actor")
        def act(w, obs):
            return (obs @ w).argmax(-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"w": state["w"] + 0.01 * batch["obs"].mean((0, 1))[:, None]}, \\
                M(batch["obs"].mean(), batch["obs"].sum())

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros((4, 2))})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for _ in range(4):
                for _ in range(4):
                    obs, *_ = env.step(act(state["w"], obs))
                    buf.add(obs=obs)
                state, metrics = learn(state, buf.collect())
                ff.log({"r": metrics[0], "both": metrics})
    """)
    program = load(str(path))
    columns = []
    for p in ("single_process", policy):
        ff.run(program.train, policy=p, out=tmp_path / "run")
        rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
        columns.append([(r["r"], r["both/r"], r["both/s"]) for r in rows])
    assert len(columns[0]) == 4 and all(c[0] for c in columns[0])
    assert columns[1] == columns[0]


GRID = """
import numpy as np
{imports}import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, obs):
    return {{"w": state["w"] * 0.5 + obs.mean()}}

@ff.fragment("learner", writes=None)
def metrics(state, obs):
    return {{"grid": {grid}}}

@ff.fragment("learner", writes=None)
def total(column):
    return {{"s": column.sum()}}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({{"w": np.zeros(2)}})
    obs = env.reset()
    for _ in range(6):
        obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
        state = learn(state, obs)
        m = metrics(state, obs)
        {use}   # @use
"""
NUMPY_GRID, TORCH_GRID = "np.outer(state['w'], np.arange(4.0)) + obs.sum()", "torch.ones(2, 4) * float(obs.sum())"


@pytest.mark.parametrize("grid", [NUMPY_GRID, TORCH_GRID])
@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_an_element_of_a_learners_array_taken_by_one_key_per_axis_is_logged_where_the_learner_runs_apart(
        write_algo, tmp_path, grid, policy):
    """ff.log({"x": m["grid"][1, 3]}) of a learner's 2-d output ran under single_process, and was
    refused after the trace where the learner runs apart ("which the trace did not see logged"):
    the trace followed `grid[1][3]` only. Each key-per-axis element reaches the rows single_process
    writes it to."""
    use = 'ff.log({"a": m["grid"][1, 3], "b": m["grid"][-1, 0], "c": m["grid"][np.int64(0), 2]})'
    path, _ = write_algo(GRID.format(imports="import torch\n" if "torch" in grid else "", grid=grid, use=use))
    program = load(str(path))
    columns = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        ff.run(program.train, policy=pol, out=tmp_path / run)
        rows = list(csv.DictReader((tmp_path / run / "metrics.csv").open()))
        columns.append([(r["a"], r["b"], r["c"]) for r in rows])
    assert len(columns[0]) == 6 and all(v for row in columns[0] for v in row)
    assert columns[1] == columns[0]


@pytest.mark.parametrize("grid", [NUMPY_GRID, TORCH_GRID])
@pytest.mark.parametrize("use, key", [('ff.log(total(m["grid"][:, 0]))', "[:, 0]"),
                                      ('ff.log({"x": m["grid"][1:2, 3]})', "[1:2, 3]"),
                                      ('ff.log({"x": m["grid"][..., -1].max()})', "[..., -1]")])
def test_a_part_of_a_learners_array_taken_in_the_loop_is_refused_at_its_line_where_the_learner_runs_apart(
        write_algo, grid, use, key):
    """The loop slicing a learner's output (`total(m["grid"][:, 0])`) ran under single_process; under
    pipelined the trace took the slice for a value of the loop's own, sent the trace's copy, and the
    run failed at its first call with "called with 0 array leaves" (a part logged: "the trace did not
    see logged"). The slice is refused at the trace, at its line, with the fix."""
    path, marks = write_algo(GRID.format(imports="import torch\n" if "torch" in grid else "", grid=grid, use=use))
    program = load(str(path))
    ff.run(program.train, policy="single_process")
    with pytest.raises(ff.errors.LearnerOutputOnActingSideError,
                       match=rf"output \['grid'\] of learner 'metrics' is indexed with {re.escape(key)} in the training "
                             r"loop, but policy 'pipelined' runs 'metrics' in another process(.|\n)*fix: send it whole to "
                             r"ff.log \(logged where it is computed\) or to fragments placed with it \(indexing it there\)") as info:
        ff.run(program.train, policy="pipelined")
    assert f"algo.py:{marks['use']}" in str(info.value)


@pytest.mark.parametrize("policy", ["single_process", "pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_a_logged_value_that_stops_being_a_scalar_after_the_trace_is_refused(write_algo, policy):
    """A learner metric a scalar while traced and a [2] array from update 4: one process failed in
    the monitor (a reshape error), the others left its column empty, silently (round 28 K06)."""
    path, marks = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs):
            return (obs @ w).argmax(-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            m = batch["obs"].mean()
            return {"w": state["w"] + 0.01, "t": state["t"] + 1}, {"m": m if state["t"] < 3 else np.ones(2) * m}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros((4, 2)), "t": 0})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for _ in range(6):
                for _ in range(4):
                    obs, *_ = env.step(act(state["w"], obs))
                    buf.add(obs=obs)
                state, metrics = learn(state, buf.collect())   # @learn
                ff.log(metrics)   # @log
    """)
    program = load(str(path))
    where = f"algo.py:{marks['log' if policy == 'single_process' else 'learn']}"
    with pytest.raises(ff.errors.FragflowError, match=r"ff.log got 'm' with shape \(2,\)|output \[1\]\['m'\] of fragment 'learn', which the loop logs, has shape \(2,\)") as info:
        ff.run(program.train, policy=policy)
    assert "not a scalar" in str(info.value) and where in str(info.value)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_a_learner_output_unpacked_in_the_assignment_runs_and_logs_as_indexed(tmp_path, write_algo, policy):
    """state, (m, d) = learn(...): a tuple output of known length was refused as 'iterated in the
    loop' where the learner runs apart, though m[0] and m[1] ran (round 28 K07)."""
    path, _ = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs):
            return (obs @ w).argmax(-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            obs = batch["obs"]
            return {"w": state["w"] + 0.01 * obs.mean((0, 1))[:, None]}, (obs.mean(), {"s": obs.sum()})

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros((4, 2))})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for _ in range(4):
                for _ in range(4):
                    obs, *_ = env.step(act(state["w"], obs))
                    buf.add(obs=obs)
                state, (m, d) = learn(state, buf.collect())
                ff.log({"m": m, "d": d})
    """)
    program = load(str(path))
    columns = []
    for p in ("single_process", policy):
        ff.run(program.train, policy=p, out=tmp_path / "run")
        rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
        columns.append([(r["m"], r["d/s"]) for r in rows])
    assert len(columns[0]) == 4 and all(a and b for a, b in columns[0])
    assert columns[1] == columns[0]


def test_learner_outputs_logged_under_names_of_the_loops_making_reach_the_rows_and_unseen_parts_are_refused(
        write_algo, tmp_path):
    """A learner output logged under a name the loop makes (from the update number) is logged by
    it; an element of an array output first taken after the trace is not among the parts the
    learner's process reports, and would never reach the metrics: refused at the line."""
    path, marks = write_algo(LOGGED, "logged_named.py")
    program = load(str(path))
    columns = []
    for run, pol in (("one", "single_process"), ("other", "pipelined(max_lag=0)")):
        ff.run(program.train, dict(named=True), policy=pol, out=tmp_path / run)
        rows = list(csv.DictReader((tmp_path / run / "metrics.csv").open()))
        columns.append({k: [r[k] for r in rows] for k in rows[0] if k.startswith("loss")})
    assert sorted(columns[0]) == ["loss", *(f"loss{u}" for u in range(6))] and columns[1] == columns[0]
    assert ff.run(program.train, dict(late_element=True), policy="single_process").summary["updates"] == 6
    with pytest.raises(ff.errors.LearnerOutputOnActingSideError,
                       match=rf"ff.log got output \[2\]\[1\] of fragment 'learn' as 'v1', "
                             rf"(.|\n)*logged_named.py:{marks['late']}"):
        ff.run(program.train, dict(late_element=True), policy="pipelined")
    assert mp.active_children() == []
    assert shm_leftovers() == []


ACTION_BIAS = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs, bias):
    return np.argmax(obs @ w + bias, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-2 * batch["obs"].mean(axis=(0, 1))[:, None]}, {"m": float(batch["obs"].mean())}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    bias = np.array([0.0, 0.01])   # one per action: CartPole has as many as there are environments
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for _ in range(6):
        for _ in range(8):
            obs, *_ = env.step(act(state["w"], obs, bias))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


def test_a_loop_constant_as_long_as_the_environments_reaches_a_served_actor_whole(write_algo, tmp_path):
    """While tracing, one process steps every environment, so a loop constant with as many rows
    (a bias over CartPole's two actions, two envs) is taken for per-environment rows; each worker
    holds it whole and sends its rows, and the server's merged call gets it back whole."""
    path, _ = write_algo(ACTION_BIAS, "bias.py")
    program = load(str(path))
    expected = ff.run(program.train, policy="single_process")
    result = ff.run(program.train, policy="central_inference(env_workers=2)")
    assert same_tree(result.value, expected.value) and result.summary["updates"] == 6
    assert sorted(result.episode_returns) == sorted(expected.episode_returns)


@pytest.mark.parametrize("policy", ["pipelined(actors=1, max_lag=0)", "actor_learner(actors=2, max_lag=0)",
                                    "central_inference(env_workers=2)"])
def test_metrics_rows_and_episodes_equal_single_processs_at_max_lag_zero(tmp_path, policy):
    """Each update's row counts the env steps and episodes the loops had made at their calls of that
    update, and episodes are in the order single_process finishes them: every column but the clock
    and channel ones is single_process's, and so are the episodes and the final return."""
    def run(name: str, pol: str) -> tuple[Any, list[dict[str, str]]]:
        result = ff.run(ppo.train, INVARIANT, policy=pol, out=tmp_path / name, target_return=25.0)
        return result, unclocked_rows(tmp_path / name)

    (one, one_rows), (other, other_rows) = run("one", "single_process"), run("other", policy)
    assert len(one_rows) == 16 and other_rows == one_rows
    assert other.episodes == one.episodes
    assert other.summary["final_return_mean"] == one.summary["final_return_mean"]
    # the step of the episode that took the mean to the target (it was the steps heard of when that
    # episode arrived: run to run different, helper round 31 W5)
    assert one.summary["solved_at_steps"] is not None
    assert other.summary["solved_at_steps"] == one.summary["solved_at_steps"]


SEVERAL_CALLS = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch, i):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean(), "calls": state["calls"] + 1}, {"i": i}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2)), "calls": np.int64(0)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(8):
        for _ in range(4):
            obs, *_ = env.step(act(state["w"], obs))
            buf.add(obs=obs)
        batch = buf.collect()
        for i in range(3):   # three steps on one rollout
            state, m = learn(state, batch, i)
        ff.log(m)
    return state
"""


def test_a_learner_called_several_times_on_one_rollout_is_not_stale_by_its_own_updates(write_algo):
    """Served inference keeps its staleness bound, but the updates a rollout's own earlier learner
    calls made are the algorithm's steps, not staleness: the third call is learned from (it was
    dropped, 1 of 3, under max_lag=1)."""
    path, _ = write_algo(SEVERAL_CALLS, "several.py")
    program = load(str(path))
    result = ff.run(program.train, policy="central_inference(env_workers=1, max_lag=1)")
    assert int(result.value["calls"]) == 24 and result.summary["updates"] == 24
    assert result.summary["channels"]["trajectory"]["drops"] == 0


LEARN_WHEN_DONE = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for step in range(400):
        obs, r, term, trunc, info = env.step(act(state["w"], obs))
        buf.add(obs=obs)
        if (step + 1) % 4 == 0:
            batch = buf.collect()
            if (term | trunc).any():   # a rollout where an episode ended
                state, _ = learn(state, batch)   # @learn
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined(actors=2)", "actor_learner(actors=2, max_lag=0)"])
def test_calls_gathered_one_per_replica_from_different_moments_are_refused(write_algo, policy):
    """Each replica calls the learner when an episode of its own environments ended: the calls
    paired into one update came after different numbers of env steps (silently mixed before)."""
    path, marks = write_algo(LEARN_WHEN_DONE, "learn_when_done.py")
    program = load(str(path))
    assert ff.run(program.train, policy="single_process").summary["updates"] > 0
    with pytest.raises(ConfigError, match=rf"'learn' is called by the loop replicas after different numbers of env "
                                          rf"steps \(replica 0 after \d+, replica 1 after \d+\)(.|\n)*"
                                          rf"learn_when_done.py:{marks['learn']}"):
        ff.run(program.train, policy=policy)
    assert mp.active_children() == [] and shm_leftovers() == []



SAMPLE_WHEN_DONE = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"], "n": state["n"] + 1}, {"r": batch["reward"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), "n": np.zeros(1)})
    rb = ff.ReplayBuffer(1000, seed=0)
    obs = env.reset()
    for step in range(600):
        action = act(state["w"], obs)
        next_obs, reward, term, trunc, info = env.step(action)
        rb.add(obs=obs, reward=reward)
        obs = next_obs
        if step > 20 and term.any():   # @if
            batch = rb.sample(8, beta=min(1.0, 0.4 + step / 600))   # @sample
            state, metrics = learn(state, batch)
            ff.log(metrics)
    return state
"""


@pytest.mark.parametrize("policy, message", [
    # (ordered: replica 0's next add was paired with its own previous one, "replica 1 after 60, replica 1 after 61")
    ("learner_replay(actors=2, max_lag=0)", r"loop replica \d's next call into the learner's process is '[\w.]+' \(at .*\), "
                                            r"while replica\(s\) \d called '[\w.]+' .*the loop calls 'replay.sample'"),
    # (gathered as they arrive: "beta of 'replay.sample' differs between the loop's replicas")
    ("learner_replay(actors=2)", r"'replay.sample' is called by the loop replicas after different numbers of env steps "
                                 r"\(its call \d+: replica 0 after \d+, replica 1 after \d+\), so its beta"),
])
def test_a_replay_sample_made_on_each_replicas_own_episode_ends_is_named_with_its_if(write_algo, policy, message):
    """A learner called when an episode ends, sampling the replay buffer beside it: the refusal
    names the conditional call and its `if`, not the add it disturbed or a value it made differ
    (round 34 B9)."""
    path, marks = write_algo(SAMPLE_WHEN_DONE, "sample_when_done.py")
    program = load(str(path))
    assert ff.run(program.train, policy="single_process").summary["updates"] > 0
    with pytest.raises(ConfigError, match=rf"{message}(.|\n)*under the `if` at .*sample_when_done.py:{marks['if']} on "
                                          rf"data of each replica's own environments(.|\n)*"
                                          rf"at .*sample_when_done.py:{marks['sample']}\n"):
        ff.run(program.train, policy=policy)
    assert mp.active_children() == [] and shm_leftovers() == []

TWO_METRICS = """
import numpy as np
import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, batch):
    w = state["w"] + 1e-3 * batch["obs"].mean()
    m1 = {"loss": float(np.abs(w).sum()), "x": float(w[0, 0])}
    m2 = {"ent": float(w[1, 1]), "y": 2.0}
    return {"w": w}, m1, m2

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for u in range(4):
        for _ in range(4):
            obs, *_ = env.step(np.zeros_like(obs[:, 0], np.int64))
            buf.add(obs=obs)
        state, m1, m2 = learn(state, buf.collect())
        ff.log(m1)
        ff.log(m2)
    return state
"""

METRICS_FILLED_LATER = """
import numpy as np
import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, batch):
    w = state["w"] + 1e-3 * batch["obs"].mean()
    m = {}
    if state["n"] >= 4:
        m["late"] = float(state["n"])
    return {"w": w, "n": state["n"] + 1}, m

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2)), "n": 0})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for u in range(8):
        for _ in range(4):
            obs, *_ = env.step(np.zeros_like(obs[:, 0], np.int64))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("source", [TWO_METRICS, METRICS_FILLED_LATER], ids=["two_outputs", "empty_while_tracing"])
def test_learner_outputs_logged_whole_reach_the_rows_whatever_the_trace_saw_of_them(write_algo, tmp_path, source):
    """Two outputs logged whole (both 'named' the root) each reach their columns; a metrics dict
    empty while tracing is logged once the learner fills it."""
    path, _ = write_algo(source, "whole.py")
    program = load(str(path))
    rows = []
    for run, pol in (("one", "single_process"), ("other", "pipelined(max_lag=0)")):
        ff.run(program.train, policy=pol, out=tmp_path / run)
        rows.append(unclocked_rows(tmp_path / run))
    assert rows[1] == rows[0]
    assert ({"loss", "x", "ent", "y"} <= set(rows[0][0])) if source is TWO_METRICS else rows[0][-1]["late"] == "7.0"


LOOP_LOGS = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff


@dataclass(frozen=True)
class Args:
    seed: int = 0
    steps: int = 60


@ff.fragment("actor")
def act(w, obs, key):
    return (ff.random.uniform(key, ()) < 0.5).astype(np.int64)


@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1.0}, {"loss": float(batch["reward"].sum()) + float(state["w"][0])}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=1, seed=args.seed)
    state = ff.versioned({"w": np.zeros(3)})
    rb = ff.ReplayBuffer(1000, seed=args.seed)
    key = ff.random.keys(args.seed, env.ids)
    obs = env.reset()
    for step in range(args.steps):
        eps = 1.0 - step / args.steps
        key, sub = ff.random.split(key)
        a = act(state["w"], obs, sub)
        nobs, r, term, trunc, info = env.step(a)
        rb.add(obs=obs, reward=r)
        obs = nobs
        if step % 5 == 0:
            ff.log({"epsilon": eps})
        if step >= 20 and step % 4 == 0:
            state, m = learn(state, rb.sample(8))
            ff.log(m)
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "learner_replay(max_lag=0)"])
def test_the_loops_own_values_make_the_rows_single_process_makes(write_algo, tmp_path, policy):
    """Values the loop logs itself (epsilon every 5 steps, from the warm-up on) make a row each after
    an env step, between the updates' rows, with the steps and updates of then, as single_process
    writes them (a warm-up's collapsed into one row, later ones joined the previous update's)."""
    path, _ = write_algo(LOOP_LOGS, "loop_logs.py")
    program = load(str(path))
    rows = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        ff.run(program.train, program.args_cls(), policy=pol, out=tmp_path / run)
        rows.append(unclocked_rows(tmp_path / run))
    assert len(rows[0]) == 22 and rows[1] == rows[0]


EVALUATED = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff


@dataclass(frozen=True)
class Args:
    seed: int = 0
    updates: int = 30


@ff.fragment("actor")
def act(w, obs, key):
    return (ff.random.uniform(key, ()) < 0.5).astype(np.int64)


@ff.fragment("actor", name="act_eval")
def act_eval(w, obs):
    return (obs[:, 2] > 0).astype(np.int64) + 0 * w.astype(np.int64)[:1]


@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1.0}, {"loss": float(batch["reward"].sum()) + float(state["w"][0])}


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=args.seed)
    eval_env = ff.envs.make("CartPole-v1", num_envs=2, seed=args.seed + 100, evaluation=True)
    state = ff.versioned({"w": np.zeros(3)})
    buf = ff.RolloutBuffer(8)
    key = ff.random.keys(args.seed, env.ids)
    obs = env.reset()
    for u in range(args.updates):
        for _ in range(8):
            key, sub = ff.random.split(key)
            obs, r, term, trunc, info = env.step(act(state["w"], obs, sub))
            buf.add(reward=r)
        state, m = learn(state, buf.collect())
        ff.log(m)
        if u % 2 == 0:
            eo = eval_env.reset()
            for _ in range(60):
                eo, _, _, _, _ = eval_env.step(act_eval(state["w"], eo))
    return state
"""


def test_evaluation_columns_and_tensorboard_episodes_are_single_processs(write_algo, tmp_path):
    """Evaluation episodes (every other update, stepped by every replica, reported by replica 0) join
    the rows single_process puts them in, and TensorBoard gets the training and evaluation episodes
    in single_process's order at its steps (they came in arrival order at the driver's count)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, _ = write_algo(EVALUATED, "evaluated.py")
    program = load(str(path))
    rows, board = [], []
    for run, pol in (("one", "single_process"), ("other", "actor_learner(actors=2, max_lag=0)")):
        ff.run(program.train, program.args_cls(), policy=pol, out=tmp_path / run)
        rows.append(unclocked_rows(tmp_path / run))
        events = EventAccumulator(str(tmp_path / run / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        board.append({tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]
                      if tag.startswith(("charts/episodic", "eval/"))})
    assert rows[1] == rows[0] and {r["eval_episodes"] for r in rows[0]} != {"0"}
    assert board[1] == board[0] and len(board[0]) >= 2


ONE_ELEMENT = """
import numpy as np
import fragflow as ff

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + batch["obs"].mean()}, {"m": np.ones(1) * batch["obs"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(4):
        for _ in range(4):
            obs, *_ = env.step(np.zeros(2, np.int64))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("policy", ["single_process", "pipelined(max_lag=0)"])
def test_a_one_element_array_logged_is_a_scalar(write_algo, tmp_path, policy):
    """The trace takes an array of one element as a scalar for ff.log; the run logs it (numpy's
    float() refuses a 1-d array: the run crashed at the first row)."""
    path, _ = write_algo(ONE_ELEMENT, "one_element.py")
    program = load(str(path))
    ff.run(program.train, policy=policy, out=tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert len(rows) == 4 and all(np.isfinite(float(r["m"])) for r in rows)


LEARNER_LOGS_AFTER_STEPS = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff


@dataclass(frozen=True)
class Args:
    pre: int = 4
    steps: int = 6


@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)


@ff.fragment("learner", writes="state")
def pretrain(state, obs):
    return {"w": state["w"] + 0.01 * obs.mean()}, {"pre_loss": obs.sum()}


@ff.fragment("learner", writes="state")
def learn(state, target, obs):
    return {"w": state["w"] - 0.01 * obs.mean() + 0.0 * target["w"]}, {"loss": obs.sum()}


@ff.fragment("learner", writes="target")
def sync(target, state, tau):
    return {"w": (1 - tau) * target["w"] + tau * state["w"]}


def train(args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones((4, 2))})
    target = ff.versioned({"w": np.zeros((4, 2))}, name="target")
    obs = env.reset()
    for _ in range(args.pre):   # a first phase: a learner that is not the clock, logged after steps
        obs, *_ = env.step(np.zeros(env.num_envs, dtype=np.int64))
        state, m = pretrain(state, obs)
        ff.log(m)
    target = sync(target, state, 1.0)   # one call more than learn's: the clock (the actor acts with the target)
    for _ in range(args.steps):
        obs, *_ = env.step(act(target["w"], obs))
        state, m = learn(state, target, obs)
        ff.log(m)
        target = sync(target, state, 0.1)
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_learner_outputs_logged_after_an_env_step_make_rows_of_their_own(write_algo, tmp_path, policy):
    """A learner's output the loop logs after an env step starts a row (with the steps and updates
    of then), as single_process writes it: a first phase's metrics were one row (the last value) and
    a learner called before the clock had its metrics joined to the previous update's row."""
    path, _ = write_algo(LEARNER_LOGS_AFTER_STEPS, "learner_logs.py")
    program = load(str(path))
    rows = []
    for run, pol in (("one", "single_process"), ("other", policy)):
        ff.run(program.train, program.args_cls(), policy=pol, out=tmp_path / run)
        rows.append(unclocked_rows(tmp_path / run))
    assert len(rows[0]) == 4 + 1 + 2 * 6 and rows[1] == rows[0]
    assert [r["pre_loss"] != "" for r in rows[0][:4]] == [True] * 4


def test_rows_wait_for_the_loops_marks_however_far_the_learners_updates_run_ahead(tmp_path):
    """The driver hears the learner's updates and the loop's marks on one queue, in arrival order; on a
    loaded machine the loop's messages came 64+ updates late, rows were then written without their
    marks (env steps of the wrong update, going backwards) and without the learner's values, whose late
    arrival made rows of their own: 1632 rows for 1500 updates in a pipelined run of a while loop."""
    from fragflow.runtime.monitor import Monitor
    from fragflow.runtime.outputs import RunOutputs

    monitor = Monitor(outputs=RunOutputs(tmp_path))
    monitor.rows_end_at_steps, monitor.marked_replicas = False, 1
    monitor.start()
    for u in range(1, 201):   # every update and its values first, as the learner's process sends them
        monitor.update()
        monitor.log_at(u, {"loss": float(u)}, steps=64 * u)
    for u in range(1, 201):   # then the loop's steps and marks
        monitor.env_step(64, [(10.0, 10)] if u % 5 == 0 else [], 0, [(64 * u, 10.0, 10)] if u % 5 == 0 else None)
        monitor.mark(0, u, 64 * u)
    monitor.loop_ended(0)
    monitor.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(float(r["updates"]), float(r["env_steps"]), float(r["loss"])) for r in rows] == \
        [(u, 64 * u, u) for u in range(1, 201)]
    assert [float(r["episodes"]) for r in rows] == [u // 5 for u in range(1, 201)]


def test_a_value_the_loop_logs_before_its_first_step_is_a_row_of_its_own_however_late_it_comes(tmp_path):
    """`ff.log({"pre": 1.0})` before the loop: single_process writes it as a row of update 0; where the
    learner's first updates reached the driver before the loop's message, it went into the newest
    update's row (probe round 46: 1 of 5 pipelined runs, 2 of 2 central_inference(env_workers=2))."""
    from fragflow.runtime.monitor import Monitor
    from fragflow.runtime.outputs import RunOutputs

    monitor = Monitor(outputs=RunOutputs(tmp_path))
    monitor.rows_end_at_steps, monitor.marked_replicas = False, 1
    monitor.start()
    for u in range(1, 5):   # the learner's updates first
        monitor.update()
        monitor.log_at(u, {"loss": float(u)}, steps=8 * u)
    monitor.log_at(0, {"pre": 1.0}, steps=0)   # then the loop's messages: its log before any step, its marks
    for u in range(1, 5):
        monitor.env_step(8, [], 0, None)
        monitor.mark(0, u, 8 * u)
    monitor.loop_ended(0)
    monitor.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(float(r["updates"]), float(r["env_steps"]), r["pre"], r["loss"]) for r in rows] == \
        [(0.0, 0.0, "1.0", "")] + [(u, 8 * u, "", str(float(u))) for u in range(1, 5)]


def test_what_the_loop_logs_after_learner_calls_dropped_as_stale_is_written_in_a_last_row_and_said(tmp_path):
    """Gathered on arrival (actor_learner(actors=2), max_lag=1, overflow=drop), a dropped call is an update
    the run never makes: the values the loop logged after its last calls (a final evaluation, a log after
    the loop) waited for updates that never came, and were left out with no word (probe round 46)."""
    from fragflow.runtime.monitor import Monitor
    from fragflow.runtime.outputs import RunOutputs

    monitor = Monitor(outputs=RunOutputs(tmp_path))
    monitor.rows_end_at_steps, monitor.marked_replicas, monitor.arrival = False, 0, True
    monitor.start()
    for u in range(1, 4):
        monitor.env_step(8, [], 0, None)
        monitor.update()
        monitor.log_at(u, {"loss": float(u)}, steps=8 * u)
    monitor.log_at(4, {"after": 1.0}, steps=32)   # after the loop's 4th learner call, dropped as stale
    monitor.channels({"trajectory": {"items": 4, "bytes": 10, "drops": 1, "depth": 0}})
    monitor.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["updates"], r["loss"], r["after"]) for r in rows] == \
        [("1", "1.0", ""), ("2", "2.0", ""), ("3", "3.0", ""), ("3", "", "1.0")]
    assert "values the loop logged after learner calls that were dropped as stale ('after'" in monitor.summary()["notes"][0]


def test_a_stopped_runs_rows_whose_loop_steps_never_came_are_left_out_not_written_behind(tmp_path):
    """A Ctrl-C under pipelined while the loop's messages lagged the learner's: the last rows were
    written with the steps and episodes heard by then, behind the rows before them (counts going
    backwards); and values the loop logged for an update that never came (its learner failed) made
    a second row of the last update. Both are left out, as single_process never wrote them."""
    from fragflow.runtime.monitor import Monitor
    from fragflow.runtime.outputs import RunOutputs

    monitor = Monitor(outputs=RunOutputs(tmp_path))
    monitor.rows_end_at_steps, monitor.marked_replicas = False, 1
    monitor.start()
    for u in range(1, 11):
        monitor.update()
        monitor.log_at(u, {"loss": float(u)}, steps=32 * u)
        if u <= 6:   # the loop's steps and marks of the first six updates reached the driver
            monitor.env_step(32, [(10.0, 10)] if u % 2 == 0 else [], 0, [(32 * u, 10.0, 10)] if u % 2 == 0 else None)
            monitor.mark(0, u, 32 * u)
    monitor.log_at(11, {"epsilon": 0.5}, steps=32 * 11)   # the loop's value of an update that never came
    monitor.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    # update 6's marks came: its row is written though the loop never went on to update 7 (a stop right
    # after a checkpoint at update 6 lost it, for good after a resume: helper round 31 V1)
    assert [(float(r["updates"]), float(r["env_steps"])) for r in rows] == [(u, 32 * u) for u in range(1, 7)]
    assert "epsilon" not in rows[0]
    assert "the last 4 update(s) have no row in metrics.csv" in monitor.summary()["notes"][0]


def test_closing_the_monitor_stops_its_progress_display_under_every_kind_of_run():
    """A refactor left the display's stop inside the lockstep policies' target check, so a run in
    one process, or without a target, left the live display running."""
    from fragflow.runtime.monitor import Monitor

    class Display:
        stopped = 0

        def start(self): pass

        def update(self, *args): pass

        def note(self, message): pass

        def stop(self):
            self.stopped += 1

    for target, lockstep in ((None, 0), (10.0, 0), (None, 1), (10.0, 1)):
        display = Display()
        monitor = Monitor(progress=display, target_return=target)   # type: ignore[arg-type]
        monitor.marked_replicas = lockstep
        monitor.start()
        monitor.close()
        assert display.stopped == 1, (target, lockstep)


def test_a_resumed_runs_summary_keeps_the_notes_of_its_restarts():
    """restarts: 1 came back from the checkpoint, the note saying why did not, while the CLI pointed
    at the notes (helper round 30 S8)."""
    from fragflow.runtime.monitor import Monitor

    before = Monitor()
    before.restarted("actor 0 was killed by signal 9: restarted (1 of 3)")
    after = Monitor()
    after.resume(before.counters())
    assert after.summary()["restarts"] == 1
    assert after.summary()["notes"] == ["actor 0 was killed by signal 9: restarted (1 of 3)"]


def test_metrics_columns_keep_the_loops_order_whatever_arrives_first(tmp_path):
    """The loop's own values ("n") logged after a learner's ("loss") can reach the driver first under a
    policy of several processes: the columns were in arrival order, so two same-seed pipelined runs
    wrote different headers. They follow the order the trace saw them logged, new ones included."""
    from fragflow.runtime.outputs import RunOutputs

    out = RunOutputs(tmp_path, column_order=("loss", "n", "late"))
    out.write_row({"env_steps": 8.0, "updates": 1.0, "n": 1.0, "loss": 0.5})
    out.write_row({"env_steps": 16.0, "updates": 2.0, "unseen": 3.0, "late": 2.0, "n": 2.0, "loss": 0.25})
    out.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert list(rows[0]) == ["env_steps", "updates", "loss", "n", "late", "unseen"]
    assert [r["late"] for r in rows] == ["", "2.0"] and [r["loss"] for r in rows] == ["0.5", "0.25"]


def test_a_new_metric_name_every_row_rewrites_metrics_csv_a_bounded_number_of_times(tmp_path, monkeypatch):
    """ff.log(f"loss{u}") (a name of the loop's making) rewrote metrics.csv at every update: 1,000
    updates of a single_process run took 48 s against 0.4 s under one name. Rewrites now come as the
    file doubles its rows (their cells add up to a few times the final file's), every row is in the
    file as it is written, and the file has every column and value at close."""
    from fragflow.runtime import outputs

    rewrites: list[tuple[int, int]] = []
    real = outputs._rewrite

    def counted(path: Path, columns: list[str], rows: list[dict[str, str]]) -> None:
        rewrites.append((len(rows), len(columns)))
        real(path, columns, rows)

    monkeypatch.setattr(outputs, "_rewrite", counted)
    n = 1000
    out = outputs.RunOutputs(tmp_path)
    for u in range(n):
        out.write_row({"env_steps": 8.0 * (u + 1), "updates": float(u + 1), "n": float(u), f"loss{u}": u / 4})
        if u == 700:   # midway (a run killed now): a valid CSV with every row written so far
            with open(tmp_path / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            assert [r["n"] for r in rows] == [str(float(i)) for i in range(701)]
            held = [c for c in rows[0] if c.startswith("loss")]
            assert 0 < len(held) < 701 and all(rows[int(c[4:])][c] == str(int(c[4:]) / 4) for c in held)
    out.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["env_steps", "updates", "n", *(f"loss{u}" for u in range(n))]
    assert [r["n"] for r in rows] == [str(float(u)) for u in range(n)]
    assert all(r[f"loss{u}"] == str(u / 4) and sum(v != "" for v in r.values()) == 4 for u, r in enumerate(rows))
    assert len(rewrites) <= 12   # (one per doubling of the rows: 1, 2, 4, ..., 512, and at close)
    assert sum(r * c for r, c in rewrites) <= 3 * n * (n + 3)


LOOP_LOGS_AFTER_LEARNER = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return np.argmax(obs @ w, axis=-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean()}, {"loss": batch["obs"].std(), "q": batch["obs"].mean()}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for u in range(12):
        for _ in range(8):
            obs, *_ = env.step(act(state["w"], obs))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
        ff.log({"n_added": float(u), "epsilon": 1.0 / (u + 1)})
    return state
"""


def test_a_pipelined_runs_metrics_header_is_single_processs(write_algo, tmp_path):
    path, _ = write_algo(LOOP_LOGS_AFTER_LEARNER, "loop_logs.py")
    program = load(str(path))
    headers = []
    for run, pol in (("one", "single_process"), ("a", "pipelined"), ("b", "pipelined")):
        ff.run(program.train, policy=pol, out=tmp_path / run)
        with open(tmp_path / run / "metrics.csv", newline="") as f:
            headers.append([c for c in next(csv.reader(f)) if not c.startswith("trajectory/")])
    assert headers[0][-4:] == ["loss", "q", "n_added", "epsilon"]
    assert headers[1] == headers[0] and headers[2] == headers[0]


def test_a_name_logged_from_a_learners_output_and_by_the_loop_is_refused_where_the_learner_runs_apart(write_algo):
    """Which value the row held depended on which process's message reached the driver first: three
    same-seed pipelined runs wrote three different columns (helper round 30 R30X-1)."""
    source = LOOP_LOGS_AFTER_LEARNER.replace("        ff.log(m)\n", "        ff.log(m)  # @learner_log\n").replace(
        'ff.log({"n_added": float(u), "epsilon": 1.0 / (u + 1)})',
        'ff.log({"loss": -1.0, "n_added": float(u), "epsilon": 1.0 / (u + 1)})  # @loop_log')
    path, marks = write_algo(source)
    program = load(str(path))
    rows = ff.run(program.train, policy="single_process").summary["updates"]   # the last ff.log wins, in one process
    assert rows == 12
    for policy in ("pipelined", "actor_learner(actors=2, max_lag=0)"):
        with pytest.raises(ff.errors.PlacementError,
                           match=rf"ff.log is given 'loss' both from an output of learner 'learn' \(at .*:"
                                 rf"{marks['learner_log']}\) and as a value of the loop's own, but policy .* runs "
                                 rf"'learn' in another process.*\n  at .*:{marks['loop_log']}\n  fix: log the loop's "
                                 rf"value under a name of its own"):
            ff.run(program.train, policy=policy)


def test_a_program_loaded_from_a_path_off_sys_path_runs_in_workers_started_afresh(write_algo, tmp_path, monkeypatch):
    """Loaded with importlib from a file not on sys.path: a forked worker has the module, one started
    from the fork server (JAX imported, a GPU machine) could not import it, and failed before it could
    report why ("exited with code 1 without reporting an error", helper round 30 R30X-4)."""
    import importlib.util

    monkeypatch.setenv("FRAGFLOW_START_METHOD", "forkserver")
    path, _ = write_algo(LOOP_LOGS_AFTER_LEARNER, "prog_by_path.py")
    spec = importlib.util.spec_from_file_location("prog_by_path_r30", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prog_by_path_r30", module)
    spec.loader.exec_module(module)
    assert ff.run(module.train, policy="pipelined").summary["updates"] == 12


class _Unloadable:
    """Pickles as a call that fails where it is loaded: a module the workers do not have."""

    def __reduce__(self):
        import importlib

        return importlib.import_module, ("a_module_no_worker_has_r30",)


def test_a_worker_that_cannot_load_the_program_reports_why(write_algo):
    path, _ = write_algo(LOOP_LOGS_AFTER_LEARNER.replace("def train():", "def train(extra=None):"), "unloadable.py")
    program = load(str(path))
    with pytest.raises(ConfigError, match=r"process could not load the program: No module named "
                                          r"'a_module_no_worker_has_r30'\n  fix: the worker could not import"):
        ff.run(program.train, _Unloadable(), policy="pipelined")


STOPS_ON_TARGET = """
from dataclasses import dataclass
import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 30

@ff.fragment("actor")
def act(w, obs, key):
    logits = obs @ w
    return np.argmax(logits + ff.random.gumbel(key, (logits.shape[-1],)), axis=-1)

@ff.fragment("learner")
def learn(state, batch):
    obs, reward = batch["obs"], batch["reward"]
    g = np.einsum("tei,te->i", obs, reward - reward.mean())[:, None] * np.array([[1.0, -1.0]])
    return {"w": state["w"] + 0.01 * g / reward.size}, {"mean_reward": reward.mean()}

def train(args):
    env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(16)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(16):
            key, sub = ff.random.split(key)
            action = act(state["w"], obs, sub)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward)
            obs = next_obs
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    return state
"""


def test_a_run_stopped_on_its_target_writes_each_row_at_its_own_steps(write_algo, tmp_path):
    """Stopping on the target, the driver dropped the rest of the message that reached it (the marks
    of the updates it held) and the later ones: the last rows were written with the steps and
    episodes of the moment, going backwards, and differed run to run (helper round 22)."""
    path, _ = write_algo(STOPS_ON_TARGET)
    program = load(str(path))

    def rows(policy, out):
        ff.run(program.train, program.args_cls(), policy=policy, out=out, target_return=20, stop_on_target=True)
        with open(out / "metrics.csv", newline="") as f:
            return [(int(float(r["updates"])), int(float(r["env_steps"])), int(float(r["episodes"])))
                    for r in csv.DictReader(f)]

    single = {u: row for u, *row in rows("single_process", tmp_path / "single")}
    for attempt in range(2):
        got = rows("pipelined(max_lag=0)", tmp_path / f"pipelined{attempt}")
        assert all(steps == 64 * u for u, steps, _ in got), got
        assert all(single[u][1] == episodes for u, _, episodes in got if u in single), (got, single)


def test_a_replay_buffer_beside_the_learner_samples_as_single_process_whichever_copy_came_first(write_algo, tmp_path):
    """learner_replay keeps the first copy of the buffer to reach the learner; each loop replica's
    copy had its own generator, so the samples depended on which actor's came first (helper round 22)."""
    path, _ = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs, key):
            return (ff.random.uniform(key, (1,))[:, 0] < 0.5).astype(np.int64)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"w": state["w"] + 1}, {"index_sum": float(batch["index"].sum())}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"w": np.zeros(1)})
            rb = ff.ReplayBuffer(1000, seed=0)
            key = ff.random.keys(0, env.ids)
            obs = env.reset()
            for step in range(30):
                key, sub = ff.random.split(key)
                a = act(state["w"], obs, sub)
                nobs, r, te, tr, info = env.step(a)
                rb.add(obs=obs, action=a, reward=r)
                obs = nobs
                if step >= 10:
                    state, m = learn(state, rb.sample(8))
                    ff.log(m)
            return state
    """)
    program = load(str(path))

    def sampled(policy, out):
        ff.run(program.train, policy=policy, out=out)
        with open(out / "metrics.csv", newline="") as f:
            return [r["index_sum"] for r in csv.DictReader(f)]

    reference = sampled("single_process", tmp_path / "single")
    for attempt in range(3):   # (which copy comes first is the OS's choice: the fault showed in 1-3 runs)
        assert sampled("learner_replay(actors=2, max_lag=0)", tmp_path / f"lr{attempt}") == reference, attempt


def test_a_learner_keeping_a_view_of_its_batch_keeps_that_batch(write_algo, tmp_path):
    """A batch reaches a learner process as zero-copy views of a ring slot, which the actor writes
    again once it is freed: a state holding a view (torch.as_tensor(batch["obs"])[-1]) held the next
    rollout's data at the next update (helper round 23)."""
    path, _ = write_algo("""
        import numpy as np
        import torch
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs, key):
            logits = torch.as_tensor(obs, dtype=torch.float32) @ w
            return np.argmax(logits.numpy() + ff.random.gumbel(key, (2,)), axis=-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            prev = state["last_obs"]                    # what the previous update kept
            obs = torch.as_tensor(batch["obs"])         # shares the batch's memory
            w = state["w"] + 0.01 * torch.einsum("tei->i", obs)[:, None] * torch.tensor([1.0, -1.0])
            return {"w": w, "last_obs": obs[-1]}, {"prev": float(prev.sum())}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=4, seed=0)
            state = ff.versioned({"w": torch.zeros(4, 2), "last_obs": torch.zeros(4, 4)})
            buf = ff.RolloutBuffer(8)
            key = ff.random.keys(0, env.ids)
            obs = env.reset()
            seen = []
            for _ in range(6):
                for _ in range(8):
                    key, sub = ff.random.split(key)
                    obs, r, term, trunc, _ = env.step(act(state["w"], obs, sub))
                    buf.add(obs=obs, reward=r)
                state, m = learn(state, buf.collect())
                ff.log(m)
            return state
    """)
    program = load(str(path))

    def kept(policy):
        ff.run(program.train, policy=policy, out=tmp_path / policy)
        with open(tmp_path / policy / "metrics.csv", newline="") as f:
            return [r["prev"] for r in csv.DictReader(f)]

    assert kept("pipelined(max_lag=0)") == kept("single_process")


def test_a_loop_failing_after_an_update_writes_that_updates_row_at_its_steps(write_algo, tmp_path):
    """The loop's own code raising right after an update: its row waited for a mark of the next
    update, which never came, and was forced out with the driver's counts of the moment (helper
    round 23)."""
    path, _ = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs, key):
            return (ff.random.uniform(key, ()) < 0.5).astype(np.int64)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"n": state["n"] + 1}, {"loss": float(batch["reward"].sum())}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            state = ff.versioned({"n": np.zeros(1)})
            buf = ff.RolloutBuffer(16)
            key = ff.random.keys(0, env.ids)
            obs = env.reset()
            for u in range(20):
                for t in range(16):
                    key, sub = ff.random.split(key)
                    obs, r, term, trunc, info = env.step(act(state["n"], obs, sub))
                    buf.add(reward=r)
                state, m = learn(state, buf.collect())
                ff.log(m)
                if u == 7:
                    raise ValueError("the loop fails after an update")
            return state
    """)
    program = load(str(path))

    def rows(policy):
        with pytest.raises((ValueError, WorkerFailed)):
            ff.run(program.train, policy=policy, out=tmp_path / policy)
        with open(tmp_path / policy / "metrics.csv", newline="") as f:
            return [(r["env_steps"], r["updates"], r["episodes"]) for r in csv.DictReader(f)]

    single = rows("single_process")
    assert single[-1][:2] == ("256", "8")
    for policy in ("pipelined(max_lag=0)", "actor_learner(actors=1, max_lag=0)"):
        assert rows(policy) == single, policy


def test_the_loops_own_rows_hold_the_evaluation_episodes_ended_by_then(write_algo, tmp_path):
    """A loop value logged after each env step makes rows of its own between updates; their
    evaluation columns counted every evaluation episode heard, those run after the next update
    included, so eval_episodes went 4, 4, 6, 6, 4 (helper round 23)."""
    path, _ = write_algo("""
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs, key):
            return (ff.random.uniform(key, ()) < 0.5).astype(np.int64)

        @ff.fragment("actor", name="act_eval")
        def act_eval(w, obs):
            return (obs[:, 2] > 0).astype(np.int64) + 0 * w.astype(np.int64)[:1]

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"w": state["w"] + 1.0}, {"loss": float(batch["reward"].sum())}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            ev = ff.envs.make("CartPole-v1", num_envs=2, seed=100, max_episode_steps=5, evaluation=True)
            state = ff.versioned({"w": np.zeros(3)})
            buf = ff.RolloutBuffer(4)
            key = ff.random.keys(0, env.ids)
            obs = env.reset()
            for u in range(6):
                for t in range(4):
                    key, sub = ff.random.split(key)
                    obs, r, term, trunc, info = env.step(act(state["w"], obs, sub))
                    buf.add(reward=r)
                    ff.log({"t": t})               # a row of its own after each env step
                state, m = learn(state, buf.collect())
                ff.log(m)
                if u % 2 == 1:
                    eo = ev.reset()
                    for _ in range(6):
                        eo, _, _, _, _ = ev.step(act_eval(state["w"], eo))
            return state
    """)
    program = load(str(path))

    def columns(policy):
        ff.run(program.train, policy=policy, out=tmp_path / policy)
        with open(tmp_path / policy / "metrics.csv", newline="") as f:
            return [(r["env_steps"], r["updates"], r["eval_episodes"], r["eval_return_mean"]) for r in csv.DictReader(f)]

    single = columns("single_process")
    # the evaluation after the last update is in that update's row (the last), not in the loop's rows before it
    assert [r[2] for r in single] == sorted(r[2] for r in single) and [r[2] for r in single[-2:]] == ["4", "6"]
    for policy in ("pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"):
        assert columns(policy) == single, policy


def test_a_restarted_first_actor_logs_each_loop_value_once(write_algo, tmp_path):
    """Loop replica 0 logs the loop's values; restarted, it re-runs the trips since its last snapshot,
    sending none of their calls again, but the ff.log after the last call it skipped was sent again:
    update u's value landed in update u+1's row (helper round 23)."""
    import collections

    path, _ = write_algo("""
        import time
        import numpy as np
        import torch
        import fragflow as ff

        @ff.fragment("actor")
        def act(net, obs, key):
            time.sleep(0.005)   # a run of a few seconds: the kill lands mid-run
            logits = net(torch.as_tensor(obs, dtype=torch.float32)).detach().numpy()
            return np.argmax(logits + ff.random.gumbel(key, (2,)), axis=-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            net, opt = state["net"], state["opt"]
            loss = net(torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            return state, {"loss": loss.detach()}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            torch.manual_seed(0)
            net = torch.nn.Linear(4, 2)
            state = ff.versioned({"net": net, "opt": torch.optim.Adam(net.parameters(), lr=1e-3)})
            buf = ff.RolloutBuffer(10)
            key = ff.random.keys(0, env.ids)
            obs = env.reset()
            for update in range(150):
                for step in range(10):
                    key, sub = ff.random.split(key)
                    obs, r, term, trunc, info = env.step(act(state["net"], obs, sub))
                    buf.add(obs=obs)
                state, m = learn(state, buf.collect())
                ff.log(m)
                ff.log({"u": update})
            return state
    """)
    program = load(str(path))
    killer = kill_actor_later("fragflow-actor-0", after=2.0)
    result = ff.run(program.train, policy="actor_learner(actors=2)", out=tmp_path / "run")
    killer.join()
    assert result.summary["status"] == "completed" and result.summary["restarts"] == 1
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        logged = [r["u"] for r in csv.DictReader(f) if r.get("u")]
    assert [u for u, n in collections.Counter(logged).items() if n > 1] == []


def test_a_first_actor_killed_before_it_sent_the_state_is_restarted_and_the_run_completes(write_algo, tmp_path):
    """Loop replica 0 sends the learner the state it makes: killed before that, its restarted
    process did not send it again, and the learner and both actors waited for each other forever
    (seen in a loaded test run, where starting the workers took longer than the kill's delay)."""
    path, _ = write_algo("""
        import multiprocessing
        import os
        import time
        import numpy as np
        import fragflow as ff

        @ff.fragment("actor")
        def act(w, obs):
            return (obs @ w).argmax(-1)

        @ff.fragment("learner", writes="state")
        def learn(state, batch):
            return {"w": state["w"] + 0.01 * batch["obs"].mean((0, 1))[:, None]}, {}

        def train():
            env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
            first = multiprocessing.current_process().name == "fragflow-actor-0"   # (not the trace, in the driver)
            if first and not os.path.exists(os.environ["FF_TEST_MARK"]):
                open(os.environ["FF_TEST_MARK"], "w").close()
                time.sleep(30)   # the first process of replica 0: killed here, before its state is made
            state = ff.versioned({"w": np.zeros((4, 2))})
            buf = ff.RolloutBuffer(4)
            obs = env.reset()
            for _ in range(5):
                for _ in range(4):
                    obs, *_ = env.step(act(state["w"], obs))
                    buf.add(obs=obs)
                state, _ = learn(state, buf.collect())
            return state
    """)
    program = load(str(path))
    os.environ["FF_TEST_MARK"] = str(tmp_path / "slept")

    def give_up(signum, frame):
        raise TimeoutError("the run hung")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(120)
    try:
        killer = kill_actor_later("fragflow-actor-0", after=1.0)
        result = ff.run(program.train, policy="actor_learner(actors=2)")
        killer.join()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        del os.environ["FF_TEST_MARK"]
    s = result.summary
    assert s["status"] == "completed" and s["restarts"] == 1
    # each replica's 5 rollouts (one of the 2 envs each) reach the learner once: learned from (two per
    # update) or dropped as stale while replica 1 ran ahead of the restarting replica 0 (a loaded
    # machine made 4 updates); each env step is counted once
    assert 2 * s["updates"] + s["channels"]["trajectory"]["drops"] == 10 and s["env_steps"] == 5 * 4 * 2
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("policy", ["single_process", "pipelined(max_lag=0)"])
def test_a_jax_key_the_loop_carries_is_saved_and_resumed(tmp_path, write_algo, policy):
    """key, sub = jax.random.split(key) in the loop: the checkpoint left the key out, and the resumed
    run started it again from its seed, replaying the first batches, silently (helper round 27 J04).
    (Here, not with the checkpoint tests: its program imports jax, after which workers start from a
    fork server, and the tests before test_graph_programs run without.)"""
    import fragflow as ff
    from fragflow.program import load

    path, _ = write_algo("""
        from dataclasses import dataclass
        import numpy as np
        import jax
        import jax.numpy as jnp
        import fragflow as ff

        @dataclass(frozen=True)
        class Args:
            seed: int = 1

        @ff.fragment("learner", writes="state")
        def learn(state, x, y):
            loss, g = jax.value_and_grad(lambda w: ((jnp.asarray(x) @ w - y) ** 2).mean())(state["w"])
            return {"w": state["w"] - 0.05 * g}, {"loss": loss}

        def train(args):
            state = ff.versioned({"w": jnp.zeros((4,))})
            key = jax.random.PRNGKey(args.seed)
            for u in range(16):
                key, sub = jax.random.split(key)
                x = np.asarray(jax.random.normal(sub, (16, 4)))
                state, m = learn(state, x, x @ np.arange(4.0, dtype=np.float32))
                ff.log(m)
            return state
    """)
    program = load(str(path))
    out = tmp_path / "run"
    whole = ff.run(program.train, program.args_cls(), policy=policy, out=out, checkpoint_every=4)
    first = min((c for c in (out / "checkpoints").iterdir() if int(c.name) < 16), key=lambda c: int(c.name))
    resumed = ff.run(program.train, program.args_cls(), policy=policy, resume=first)   # (pipelined: an update or more after 4)
    assert np.array_equal(np.asarray(whole.value["w"]), np.asarray(resumed.value["w"]))


INTERRUPTED = """
import numpy as np
import fragflow as ff

@ff.fragment("actor")
def act(w, obs):
    return (obs @ w).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"w": state["w"] + 1e-3 * batch["obs"].mean((0, 1))[:, None]}, {}

def train(updates=5):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for _ in range(updates):
        for _ in range(8):
            obs, *_ = env.step(act(state["w"], obs))
            buf.add(obs=obs)
        state, _ = learn(state, buf.collect())
    return state
"""


def test_a_ctrl_c_while_the_channels_are_made_stops_the_run_and_leaves_no_segment(write_algo, monkeypatch):
    """A Ctrl-C landing while shared memory was being made left a segment that nothing recorded, for
    good (round 28 L03): it is now held until the channels are made, then stops the run."""
    from multiprocessing import resource_tracker

    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))
    real, count = resource_tracker.register, [0]

    def register(name: str, rtype: str) -> Any:
        if rtype == "shared_memory" and "fragflow_" in name:
            count[0] += 1
            if count[0] == 2:
                signal.raise_signal(signal.SIGINT)   # the Ctrl-C lands here
        return real(name, rtype)

    monkeypatch.setattr(resource_tracker, "register", register)
    with pytest.raises(KeyboardInterrupt):
        ff.run(program.train, policy="pipelined(max_lag=0)")
    assert count[0] >= 2 and mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("policy", ["single_process", "pipelined"])
def test_a_ctrl_c_as_the_run_is_announced_writes_its_summary(write_algo, tmp_path, policy):
    """A Ctrl-C that comes as the placed run is announced (the CLI's "writing to OUT"), once the trace
    has ended (under single_process: the run's beginning, its first updates made), stops a run that
    has begun: summary.json says `interrupted`. No run directory was made, no summary (helper F)."""
    from fragflow import driver

    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))

    def placed(compiled: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        driver.run(program.train, None, policy=policy, out=tmp_path / "run", on_compiled=placed)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and mp.active_children() == [] and shm_leftovers() == []


def test_two_ctrl_c_in_quick_succession_leave_no_segment(write_algo):
    """A second SIGINT (a signal sent to the process and to its group) broke out of the shutdown's
    joins, and the channels' segments were never unlinked (round 28 L02)."""
    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))

    def twice() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    for delay in (0.3, 0.6):
        timer = threading.Timer(delay, twice)
        got = []
        timer.start()
        try:
            try:
                ff.run(program.train, 10 ** 6, policy="pipelined(max_lag=0)")
                got.append("completed")
            except KeyboardInterrupt:
                got.append("interrupted")
            timer.join()
        except KeyboardInterrupt:   # (the second signal, after the first had ended the run)
            timer.join()
        assert got == ["interrupted"]
        assert mp.active_children() == [] and shm_leftovers() == []


class _DroppedCtrlC:
    def __del__(self) -> None:
        raise KeyboardInterrupt   # as a Ctrl-C that arrives while Python runs a finalizer: it drops it


@pytest.mark.parametrize("policy", ["single_process", "pipelined(max_lag=0)"])
def test_a_ctrl_c_python_dropped_in_a_finalizer_still_stops_the_run(write_algo, policy):
    """A Ctrl-C whose KeyboardInterrupt was raised in a weakref callback ("Exception ignored in ...")
    was lost, and the run went on: on a loaded machine two Ctrl-C left a run of a million updates
    running (test_two_ctrl_c_in_quick_succession_leave_no_segment waited 8 minutes)."""
    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))
    timer = threading.Timer(1.0, _DroppedCtrlC)   # made and dropped in the timer's thread
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ff.run(program.train, 10 ** 5, policy=policy)
    finally:
        timer.join()
    assert mp.active_children() == [] and shm_leftovers() == []


def test_a_run_stopped_while_it_commits_a_checkpoint_leaves_no_half_written_one(write_algo, tmp_path, monkeypatch):
    """Stopped as the driver committed a checkpoint, a run left its staged parts in a hidden folder
    for good; one left by a process that is gone is removed when a run checkpoints there (round 28 L05)."""
    from fragflow.runtime import checkpoint

    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (root / f".tmp-req1-{gone.pid}").mkdir()   # a dead run's staged parts
    real, calls = checkpoint.finish, [0]

    def finish(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt   # Ctrl-C lands as the driver commits
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "finish", finish)
    with pytest.raises(KeyboardInterrupt):
        ff.run(program.train, 60, policy="pipelined(max_lag=0)", out=tmp_path / "run", checkpoint_every=1)
    assert calls[0] == 3 and [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("policy", ["single_process", "pipelined(max_lag=0)"])
def test_a_ctrl_c_while_a_row_is_written_writes_it_once(write_algo, tmp_path, monkeypatch, policy):
    """An interrupt between a row's CSV line and its TensorBoard scalars left the row pending, and the
    run's close wrote it again (round 28 L06)."""
    from fragflow.runtime import outputs

    path, _ = write_algo(INTERRUPTED)
    program = load(str(path))
    real, written = outputs.RunOutputs.write_row, [0]

    def write_row(self: Any, row: dict[str, float]) -> None:
        real(self, row)
        written[0] += 1
        if written[0] == 5:
            raise KeyboardInterrupt   # Ctrl-C lands as the row's TensorBoard scalars are written

    monkeypatch.setattr(outputs.RunOutputs, "write_row", write_row)
    with pytest.raises(KeyboardInterrupt):
        ff.run(program.train, 60, policy=policy, out=tmp_path / "run")
    updates = [r["updates"] for r in csv.DictReader((tmp_path / "run" / "metrics.csv").open())]
    assert len(updates) >= 5 and len(set(updates)) == len(updates)
    assert mp.active_children() == [] and shm_leftovers() == []


@pytest.mark.parametrize("value, message", [("np.ones(3)", "with shape \\(3,\\), not a scalar"),
                                            ("'abc'", "of type str, not a number")])
def test_a_value_the_loop_logs_first_after_the_trace_is_refused_at_its_line(write_algo, value, message):
    """ff.log({"hist": np.ones(3)}) first called at update 4 failed in the monitor with numpy's
    reshape error, shown as the user's own (round 28 M06)."""
    path, marks = write_algo(INTERRUPTED.replace("    for _ in range(updates):\n", "    for u in range(updates):\n").replace(
        "        state, _ = learn(state, buf.collect())\n",
        "        state, _ = learn(state, buf.collect())\n"
        f"        if u == 4:\n            ff.log({{'hist': {value}}})   # @log\n"))
    program = load(str(path))
    with pytest.raises(ff.errors.ConfigError, match=f"ff.log got 'hist' {message}") as info:
        ff.run(program.train, 6, policy="single_process")
    assert f"algo.py:{marks['log']}" in str(info.value)


CHANGES_STATE_LATE = """
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 8
    start: int = 4       # the update from which the state is changed in place (0: never), after the trace
    how: str = "actor"   # actor: act scales a weight; numpy: act adds to an array; loop: the loop scales it

@ff.fragment("actor")
def act(state, obs, u, start, how):
    with torch.no_grad():
        logits = state["pi"](torch.as_tensor(obs, dtype=torch.float32))
        if start and u >= start and how == "actor":
            state["pi"].weight.mul_(0.99)
        if start and u >= start and how == "numpy":
            state["w"] += 0.1
    return logits.argmax(-1).numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    loss = state["pi"](torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    state["opt"].zero_grad(); loss.backward(); state["opt"].step()
    return state, {"loss": loss.detach()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    pi = nn.Linear(4, 2)
    state = ff.versioned({"pi": pi, "opt": torch.optim.SGD(pi.parameters(), lr=0.01), "w": np.zeros(2)})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for u in range(args.updates):
        for _ in range(8):
            obs, *_ = env.step(act(state, obs, u, args.start, args.how))   # @act
            buf.add(obs=obs)
        if args.start and u >= args.start and args.how == "loop":
            with torch.no_grad():
                pi.bias.add_(1.0)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("how, leaf, who", [("actor", r"state\['pi'\]\['weight'\]", "by fragment 'act', or by the loop"),
                                            ("numpy", "", ""),
                                            ("loop", r"state\['pi'\]\['bias'\]", "by the loop")])
@pytest.mark.parametrize("policy", ["pipelined", "actor_learner(actors=2)"])
def test_state_changed_in_place_where_the_actor_runs_only_after_the_trace_is_refused_at_the_loops_line(
        write_algo, policy, how, leaf, who):
    """An actor (or the loop) that starts changing the versioned state in place once learning has
    begun, after the trace: the trace did not see it, and where the actor runs apart from the
    learner its copy's change was lost at the next version, silently. The version counters of the
    received tensors (and read-only numpy leaves) catch it at the call."""
    path, marks = write_algo(CHANGES_STATE_LATE)
    program = load(str(path))
    if how == "numpy":   # the write raises where it is made, saying why the array is read-only here
        with pytest.raises(WorkerFailed, match="read-only") as raised:   # (the user's ValueError, from the actor)
            ff.run(program.train, program.args_cls(how=how), policy=policy)
        assert "the numpy arrays of the versioned state are read-only" in str(raised.value)
        assert f"algo.py\", line {marks['act']}" in str(raised.value)
    else:
        with pytest.raises(VersionedStateError, match=rf"versioned state {leaf}.*{re.escape(who)}.*was changed in place "
                                                      r"in an acting process, but this policy runs the learner in another "
                                                      r"process") as info:
            ff.run(program.train, program.args_cls(how=how), policy=policy)
        assert f"algo.py:{marks['act']}" in str(info.value)
    assert mp.active_children() == [] and shm_leftovers() == []
    # never changed, or in one process (as eagerly): it runs (every step; an update may be dropped as stale)
    for args, where in ((program.args_cls(how=how, start=0), policy), (program.args_cls(how=how), "single_process")):
        summary = ff.run(program.train, args, policy=where).summary
        assert summary["status"] == "completed" and summary["env_steps"] == 128, (where, summary["status"])


ACTS_UNDER_INFERENCE_MODE = """
from dataclasses import dataclass
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 6
    start: int = 0   # the update from which act changes the state in place (0: never)

@ff.fragment("actor")
def act(state, obs, u, start):
    if start and u >= start:
        state["t"].add_(1.0)
    return ((torch.as_tensor(obs, dtype=torch.float32) * state["t"]).sum(-1) > 0).long().numpy()

@ff.fragment("learner", writes="state")
def learn(state, batch):
    state["t"] = state["t"] + torch.as_tensor(batch["obs"], dtype=torch.float32).mean((0, 1))
    return state, {"t": state["t"].sum()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"t": torch.zeros(4)})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for u in range(args.updates):
        for _ in range(8):
            with torch.inference_mode():
                a = act(state, obs, u, args.start)   # @act
            obs, *_ = env.step(a)
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined", "actor_learner(actors=2)"])
def test_an_actor_called_under_inference_mode_reads_the_state_as_eagerly(write_algo, policy):
    """The loop calls the actor under torch.inference_mode(): the received tensors were made there,
    and tensors made under it keep no version counter, so the check for state changed in place
    failed every call with torch's 'Inference tensors do not track version counter'. They are made
    outside it (ordinary tensors, as the state's are eagerly), and a change is still seen."""
    path, marks = write_algo(ACTS_UNDER_INFERENCE_MODE)
    program = load(str(path))
    whole = ff.run(program.train, program.args_cls(), policy="single_process").summary
    summary = ff.run(program.train, program.args_cls(), policy=policy).summary   # (an update may be dropped as stale)
    assert summary["status"] == "completed" and summary["env_steps"] == whole["env_steps"] and whole["updates"] == 6
    with pytest.raises(VersionedStateError, match=r"versioned state state\['t'\] \(by fragment 'act'.*was changed "
                                                  r"in place in an acting process") as info:
        ff.run(program.train, program.args_cls(start=3), policy=policy)
    assert f"algo.py:{marks['act']}" in str(info.value)
    assert mp.active_children() == [] and shm_leftovers() == []


DRAWS_FROM_THE_STATES_GENERATOR = """
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 6
    kind: str = "torch"
    draws: bool = True   # act draws its exploration noise from the state's generator (else only the learner does)

def uniform(gen, n):
    if isinstance(gen, torch.Generator):
        return torch.rand(n, generator=gen).numpy()
    return gen.random(n) if isinstance(gen, np.random.Generator) else gen.random_sample(n)

@ff.fragment("actor")
def act(state, obs, draws):
    noise = uniform(state["gen"], obs.shape[0]) if draws else 0.5
    return ((np.asarray(obs) @ state["w"] + noise - 0.5) > 0).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    o = np.asarray(batch["obs"]).reshape(-1, 4)
    state["w"] = state["w"] - o.mean(0) * 0.01 * uniform(state["gen"], 1)
    return state, {"w": float(state["w"].sum())}

def train(args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    gen = {"torch": lambda: torch.Generator().manual_seed(5), "numpy": lambda: np.random.default_rng(5),
           "legacy": lambda: np.random.RandomState(5)}[args.kind]()
    state = ff.versioned({"w": np.full(4, 0.1), "gen": gen})
    buf = ff.RolloutBuffer(8)
    obs = env.reset()
    for u in range(args.updates):
        for _ in range(8):
            obs, *_ = env.step(act(state, obs, args.draws))   # @act
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("kind", ["torch", "numpy", "legacy"])
def test_an_actor_drawing_from_a_generator_of_the_state_is_refused_where_the_learner_runs_apart(write_algo, kind):
    """A generator in the versioned state is not in the versions sent to the acting side: an actor
    that drew its noise from it drew from its process's copy, which the learner's draws never met
    (under pipelined(max_lag=0) the run moved apart from single_process's with no error) and which
    every actor process held alike (two actors drew the same numbers). The draw is a change of the
    state in place, refused at the call; an actor given the state that does not draw runs, and in
    one process the draws are eager's."""
    path, marks = write_algo(DRAWS_FROM_THE_STATES_GENERATOR)
    program = load(str(path))
    eager = program.train(program.args_cls(kind=kind))
    got = ff.run(program.train, program.args_cls(kind=kind), policy="single_process").value
    assert np.array_equal(got["w"], eager["w"])
    for policy in ("pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"):
        with pytest.raises(VersionedStateError, match=r"versioned state state\['gen'\] \(a random generator, drawn "
                                                      r"from by fragment 'act'.*was changed in place in an acting "
                                                      r"process.*draws the same numbers") as info:
            ff.run(program.train, program.args_cls(kind=kind), policy=policy)
        assert f"algo.py:{marks['act']}" in str(info.value)
        assert mp.active_children() == [] and shm_leftovers() == []
        quiet = program.train(program.args_cls(kind=kind, draws=False))
        got = ff.run(program.train, program.args_cls(kind=kind, draws=False), policy=policy).value
        assert np.array_equal(got["w"], quiet["w"]), policy


def test_steps_per_second_count_from_the_loops_first_env_steps(monkeypatch):
    """Under single_process the program's setup before its loop (imports, networks, a first
    torch.optim optimizer, which loads torch._dynamo: 0.9 s on this machine) was in steps_per_second,
    where CleanRL's SPS and SB3's fps count from the loop's start; wall_seconds stays the whole run's."""
    from fragflow.runtime import monitor as monitor_module
    from fragflow.runtime.monitor import Monitor

    clock = [100.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: clock[0])
    monitor = Monitor()
    monitor.start(from_first_step=True)   # (single_process: the clock starts before the program)
    assert monitor.summary()["steps_per_second"] == 0.0   # (no steps yet)
    clock[0] = 110.0   # ten seconds of setup
    monitor.env_step(4, [])   # the first steps heard of (made before now: not in the rate)
    for _ in range(5):
        clock[0] += 1.0
        monitor.env_step(8, [])
    s = monitor.summary()
    assert s["steps_per_second"] == 8.0 and s["wall_seconds"] == 15.0 and s["env_steps"] == 44
    # a run over several processes starts its clock after the trace, its processes' start in it:
    # their reports come some steps at a time (a first one may hold a whole warm-up), all counted
    monitor = Monitor()
    monitor.start()
    clock[0] += 3.0
    monitor.env_step(2000, [])
    clock[0] += 2.0
    monitor.env_step(500, [])
    assert monitor.summary()["steps_per_second"] == 500.0


def test_steps_per_second_of_a_run_whose_steps_all_came_in_one_report(monkeypatch):
    """Under single_process the rate counts from the loop's first env steps heard of; a run whose
    env steps all come in one report (a user's env fragment that steps a whole rollout in one
    call, a run of one env.step) has none after them: its steps_per_second came out 0.0, where it
    is its steps over the run."""
    from fragflow.runtime import monitor as monitor_module
    from fragflow.runtime.monitor import Monitor

    clock = [100.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: clock[0])
    monitor = Monitor()
    monitor.start(from_first_step=True)
    clock[0] = 104.0
    monitor.env_step(1000, [])
    clock[0] = 105.0
    assert monitor.summary()["steps_per_second"] == 200.0


def test_steps_per_second_count_from_the_loops_first_env_call(monkeypatch):
    """A one-process run's rate counts from just before the loop's first env call (its reset), as
    CleanRL's SPS and SB3's fps count from just before their first reset, every step in it: the
    steps of a first rollout heard of in one report (a trace merges steps without an episode's end)
    were left out, with their time, while the update after them was counted."""
    from fragflow.runtime import monitor as monitor_module
    from fragflow.runtime.monitor import Monitor

    clock = [100.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: clock[0])
    monitor = Monitor()
    monitor.start(from_first_step=True)
    clock[0] = 110.0   # ten seconds of setup
    monitor.loop_begins()
    clock[0] = 112.0   # the reset and a first rollout of 1000 steps, heard of at once
    monitor.env_step(1000, [])
    clock[0] = 116.0   # an update (2 s), a second rollout (2 s)
    monitor.env_step(1000, [])
    assert monitor.summary()["steps_per_second"] == round(2000 / 6.0, 1)   # (the summary rounds to 0.1)
    monitor.loop_begins(120.0)   # (heard once: the clock does not move)
    assert monitor.summary()["steps_per_second"] == round(2000 / 6.0, 1)


SLOW_LOOP = """
import time
from dataclasses import dataclass
import gymnasium as gym
import numpy as np
import fragflow as ff

class Slow(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        time.sleep(0.15)   # (an Atari game's reset loads its ROM)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        time.sleep(0.005)
        return np.zeros(2, np.float32), 0.0, False, False, {}   # (no episode ends: one report a rollout)

@dataclass(frozen=True)
class Args:
    updates: int = 2

@ff.fragment("actor")
def act(state, obs):
    return np.zeros(obs.shape[0], dtype=np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    time.sleep(1.0)   # (a learner's update: as long as a rollout or more)
    return {"w": state["w"] + 1.0}

def train(args: Args):
    time.sleep(0.5)   # the program's setup
    env = ff.envs.make(Slow, num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros(1)})
    buffer = ff.RolloutBuffer(30)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(30):
            action = act(state["w"], obs)
            obs, *_ = env.step(action)
            buffer.add(obs=obs)
        state = learn(state, buffer.collect())
    return state
"""


@pytest.mark.parametrize("checkpoint_every", [None, 1000])
def test_a_single_process_run_s_rate_counts_its_first_rollout_and_its_reset(write_algo, tmp_path, checkpoint_every):
    """Under single_process the rate counts from just before the loop's reset: 120 steps over the
    reset (2 x 0.15 s), two rollouts of 30 x 2 x 5 ms and two updates of 1 s; the first rollout,
    merged into one report by the trace, was left out with its time (60 steps over 1 + 0.3 + 1 s,
    ~26/s), while the update after it was counted. The program's setup (0.5 s) is not counted. With
    --checkpoint-every the run goes on after its trace, the loop run again from its start."""
    from fragflow import driver
    from fragflow.program import load

    path, _ = write_algo(SLOW_LOOP)
    prog = load(str(path))
    driver.run(prog.train, prog.args_cls(), policy="single_process", out=tmp_path / "run",
               checkpoint_every=checkpoint_every)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    slept = 2 * 0.15 + 2 * (30 * 2 * 0.005 + 1.0)
    assert summary["env_steps"] == 120
    # every step over at least the time slept from the reset on, and at most 1.3 s more (this
    # process's own work, the trace's included, on a loaded machine); neither the first rollout left
    # out (at most 26/s) nor the setup counted (the run's own steps, 120 over the sleeps, at most 41.4/s)
    assert 120 / (slept + 1.3) < summary["steps_per_second"] <= 120 / slept, summary


FAST_LOGGING = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 3000
    keep_first: bool = False

@ff.fragment("actor")
def act(w, obs, key):
    return np.argmax(obs @ w + ff.random.gumbel(key, (2,)), axis=-1)

@ff.fragment("learner")
def learn(state, batch):
    return {"w": state["w"] + 0.01}, {"loss": float(batch["reward"].sum() + state["w"][0, 0])}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(2)
    key = ff.random.keys(0, env.ids)
    obs = env.reset()
    first = None
    for u in range(args.updates):
        for _ in range(2):
            key, sub = ff.random.split(key)
            action = act(state["w"], obs, sub)
            obs, reward, terminated, truncated, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward)
        state, metrics = learn(state, buf.collect())
        if u == 0:
            first = metrics
        ff.log(metrics)
        if args.keep_first and u == args.updates - 1:
            ff.log({"first_loss": first["loss"]})   # @first
    return state
"""


def test_a_fast_loops_logged_learner_outputs_reach_every_row(write_algo, tmp_path):
    """A loop of ~1000 updates a second: its report of ff.log(metrics) for a call came hundreds of
    calls after the learner's values of it, which the driver had forgotten by then (by count): blocks
    of 90-330 rows went without their loss, silently. Values are now kept seconds, not calls."""
    path, _ = write_algo(FAST_LOGGING, "fast_logging.py")
    program = load(str(path))
    ff.run(program.train, program.args_cls(), policy="actor_learner(actors=2,max_lag=0)", out=str(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3000
    assert [r["updates"] for r in rows if r["loss"] == ""] == []


def test_the_driver_forgets_a_calls_logged_values_by_age_and_says_when_a_forgotten_one_is_asked_for():
    """What the driver keeps of the calls' values is bounded by calls and by seconds: a value computed
    just now is kept however far behind its call is (a fast loop's report comes a flush later), one
    both old and far behind is forgotten, and an ff.log of it later is said once, not lost silently."""
    from types import SimpleNamespace

    from fragflow.runtime.multiprocess import Driver

    warned: list[str] = []
    fake = SimpleNamespace(_KEEP_CALLS=8, _KEEP_SECONDS=10.0, _computed_logs={}, _asked_for={}, _merged_into={},
                           _computed_when={}, _forgotten={}, _said_forgotten=set(), _newest_call={}, _look_at=[32] * 3,
                           monitor=SimpleNamespace(marked_replicas=True, warn=warned.append))
    now = time.monotonic()
    for c in range(40):   # calls 0-19 computed a minute ago, 20-39 just now
        fake._computed_logs[("learn", c)] = {0: {"loss": float(c)}}
        fake._computed_when[("learn", c)] = now - 60.0 if c < 20 else now
    Driver._forget_logs(fake, "learn", 39)
    assert sorted(c for _, c in fake._computed_logs) == list(range(20, 40))   # (30 is 9 calls behind, but recent)
    assert fake._forgotten == {"learn": 19}
    assert not Driver._was_forgotten(fake, "learn", 25, "loss")
    assert Driver._was_forgotten(fake, "learn", 0, "first_loss") and Driver._was_forgotten(fake, "learn", 3, "x")
    assert len(warned) == 1 and "call 1 of 'learn' as 'first_loss'" in warned[0] and "rows miss such values" in warned[0]


def test_the_driver_looks_through_the_values_it_keeps_once_they_doubled_not_at_every_call():
    """The driver keeps ``_KEEP_SECONDS`` of calls (a thousand a second from a fast learner): looking
    through all of them at every call it heard made its work grow with the square of the run's
    updates, and took a core from the loop and the learner (a 150k-step pipelined DQN: 9.0k steps/s,
    12.9k once looked through as they double). The looks walk each entry a few times in all, and the
    old ones are still forgotten."""
    from types import SimpleNamespace

    from fragflow.runtime.multiprocess import Driver

    class Counted(dict):
        looks = 0

        def get(self, key, default=None):
            Counted.looks += 1
            return super().get(key, default)

    fake = SimpleNamespace(_KEEP_CALLS=8, _KEEP_SECONDS=10.0, _computed_logs={}, _asked_for={}, _merged_into={},
                           _computed_when=Counted(), _forgotten={}, _said_forgotten=set(), _newest_call={},
                           _look_at=[32] * 3, monitor=SimpleNamespace(marked_replicas=True, warn=print))
    now = time.monotonic()
    for c in range(4000):   # all computed just now: kept
        fake._computed_logs[("learn", c)] = {0: {"loss": float(c)}}
        fake._computed_when[("learn", c)] = now
        Driver._forget_logs(fake, "learn", c)
    assert len(fake._computed_logs) == 4000
    assert Counted.looks < 3 * 4 * 4000   # (at every call: 8 million)
    for c in range(4000):   # ... until they are old: forgotten at the next look
        fake._computed_when[("learn", c)] = now - 60.0
    for c in range(4000, 8200):
        fake._computed_logs[("learn", c)] = {0: {"loss": float(c)}}
        fake._computed_when[("learn", c)] = now
        Driver._forget_logs(fake, "learn", c)
    assert min(c for _, c in fake._computed_logs) == 4000 and fake._forgotten == {"learn": 3999}


IMPORTABLE = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

COUNT = {"evals": 0}


@dataclass(frozen=True)
class Args:
    updates: int = 30


@ff.fragment("actor")
def act(state, obs):
    return (obs[:, 2] * state["w"][0] > 0).astype(np.int64)


@ff.fragment("learner", writes="state")
def learn(state, batch):
    r = float(batch["obs"].mean())
    return {"w": state["w"] + 1e-3 * r}, {"r": r}


def greedy_share(state, obs):
    # a helper of the module that calls the actor (as an evaluation would)
    COUNT["evals"] += 1
    return float(act(state, obs).mean())


def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for n in range(args.updates):
        for _ in range(4):
            obs, *_ = env.step(act(state, obs))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
        if n >= 20:   # after the trace
            ff.log({"share": greedy_share(state, obs), "evals": COUNT["evals"]})
    return state
"""


@pytest.mark.parametrize("policy", ["pipelined", "central_inference(env_workers=1)"])
def test_a_training_module_imported_by_name_keeps_one_copy_of_its_globals_in_a_worker(tmp_path, monkeypatch, policy):
    """``ff.run(module.train, ...)`` of a module imported by its name (not a file path): the loop's
    recompiled training function travelled by value, with copies of the globals it names, while a
    helper of the module (by reference) saw the module's own: an actor the helper called after the
    trace was a second fragment ('act_1', refused under central_inference), and a global dict the
    helper updated read 0 in the loop (helper round 44's program, silently under pipelined)."""
    import importlib

    (tmp_path / "ff_importable_helper.py").write_text(IMPORTABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("ff_importable_helper")
    try:
        columns = {}
        for run in ("single_process", policy):
            out = tmp_path / run
            result = ff.run(module.train, module.Args(), policy=run, out=str(out), progress=False)
            assert result.summary["updates"] == 30
            with open(out / "metrics.csv") as f:
                columns[run] = [r["evals"] for r in csv.DictReader(f) if r["evals"] != ""]
            module.COUNT["evals"] = 0
        assert columns[policy] == columns["single_process"] == [str(float(n)) for n in range(1, 11)]
    finally:
        sys.modules.pop("ff_importable_helper", None)


def test_the_final_return_of_a_run_gathered_on_arrival_is_over_the_rows_window(tmp_path):
    """summary.json's final_return_mean took the last 20 episodes to reach the driver, the rows the
    last 20 by the step that ended them: one actor_learner(actors=2) run said 24.25 and 19.05 over
    the same 43 episodes (helper round 44). Both take the rows' window now."""
    from fragflow.runtime.monitor import Monitor
    from fragflow.runtime.outputs import RunOutputs

    monitor = Monitor(outputs=RunOutputs(tmp_path))
    monitor.rows_end_at_steps, monitor.marked_replicas = False, 0
    monitor.start()
    # replica 1's reports reach the driver after replica 0's, though its episodes ended earlier
    for replica, first in ((0, 100.0), (1, 0.0)):
        for k in range(20):
            steps = 10 * (k + 1) + (0 if replica == 0 else 5)   # replica 1 ends its k-th episode 5 steps later
            monitor.env_step(10, [(first + k, 10)], replica, [(steps, first + k, 10)])
    monitor.close()
    by_step = sorted([(10 * (k + 1), 100.0 + k) for k in range(20)] + [(10 * (k + 1) + 5, float(k)) for k in range(20)])
    assert monitor.summary()["final_return_mean"] == pytest.approx(sum(ret for _, ret in by_step[-20:]) / 20)
    assert monitor.summary()["episodes"] == 40


LEARNER_KEY = """
from dataclasses import dataclass

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 6

@ff.fragment("actor")
def act(state, obs, key):
    u = ff.random.uniform(key, ())
    return (u < 0.5 + 0.1 * np.tanh(obs[:, 2] * state["w"][0])).astype(np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch, nkey):
    noise = ff.random.normal(nkey, (3,))[0]   # the learner's own noise: one key, not one per environment
    return {"w": state["w"] + 1e-3 * batch["obs"].mean() + 1e-4 * noise.sum()}, {"noise": float(noise.sum())}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.ones(1)})
    buf = ff.RolloutBuffer(4)
    key = ff.random.keys(0, env.ids)
    nkey = ff.random.keys(1000, np.arange(1))
    obs = env.reset()
    for n in range(args.updates):
        for _ in range(4):
            key, sub = ff.random.split(key)
            obs, *_ = env.step(act(state, obs, sub))
            buf.add(obs=obs)
        nkey, nsub = ff.random.split(nkey)
        state, metrics = learn(state, buf.collect(), nsub)
        ff.log(metrics)
    return state
"""


def test_a_learner_noise_key_the_loop_splits_beside_two_environments_is_not_taken_per_environment(write_algo, tmp_path):
    """``ff.random.keys(seed, np.arange(1))`` beside a two-env vector, split in the loop and passed to
    the learner (TD3's target smoothing noise): it was taken as one key per environment and refused
    by every policy that splits the environments (helper round 44). Its noise is the same wherever
    the learner runs."""
    from fragflow.program import load

    path, _ = write_algo(LEARNER_KEY, "learner_key.py")
    program = load(str(path))
    noise = {}
    for policy in ("single_process", "actor_learner(actors=2,max_lag=0)", "pipelined(actors=2,max_lag=0)"):
        out = tmp_path / policy
        ff.run(program.train, program.args_cls(), policy=policy, out=str(out), progress=False)
        with open(out / "metrics.csv") as f:
            noise[policy] = [r["noise"] for r in csv.DictReader(f)]
    assert len(noise["single_process"]) == 6
    assert noise["actor_learner(actors=2,max_lag=0)"] == noise["pipelined(actors=2,max_lag=0)"] == noise["single_process"]


def test_a_rows_evaluation_episodes_are_found_by_halving_the_reports_in_their_order():
    """Each row counts the evaluation episodes replica 0 had ended by its update and steps: the first
    ones of the reports, whose counts never go back, found by halving (a scan of all of them at every
    row made a pipelined run with an evaluation every update fall from 4.9k to 1.4k steps/s over 60k
    steps); counted one by one where reports came out of order, and the monitor notices that."""
    import random

    from fragflow.runtime.arrivalrows import ended_by
    from fragflow.runtime.monitor import Monitor

    rng = random.Random(0)
    tagged, u, t = [], 0, 0
    for _ in range(3000):
        u, t = u + rng.choice((0, 0, 1)), t + rng.choice((0, 1, 5))
        tagged.append((u, t, rng.random(), 1))
    for _ in range(300):
        at, steps = rng.randrange(-1, u + 2), rng.randrange(-1, t + 2)
        lexical = lambda e, at=at, steps=steps: e[0] < at or (e[0] == at and e[1] <= steps)   # noqa: E731
        both = lambda e, at=at, steps=steps: e[0] <= at and e[1] <= steps   # noqa: E731
        for ended in (lexical, both):
            asked: list = []

            def counted(e, ended=ended, asked=asked):
                asked.append(e)
                return ended(e)

            assert ended_by(tagged, counted) == sum(1 for e in tagged if ended(e))
            assert len(asked) <= 13   # (log2 of 3000, not 3000)
    shuffled = tagged[:]
    rng.shuffle(shuffled)
    ended = lambda e: e[0] <= u // 2   # noqa: E731
    assert ended_by(shuffled, ended, in_order=False) == sum(1 for e in tagged if ended(e))
    monitor = Monitor()
    monitor.marked_replicas = 1
    monitor.eval_episode(1.0, 1, at=(2, 10))
    monitor.eval_episode(1.0, 1, at=(2, 12))
    assert monitor._evals_in_order
    monitor.eval_episode(1.0, 1, at=(1, 30))
    assert not monitor._evals_in_order


PARALLEL_KERNELS = """
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 4
    threads: int = 0   # the program's own torch threads (0: leave them)

@ff.fragment("actor")
def act(net, obs):
    with torch.no_grad():   # a kernel torch runs in parallel (a 512 x 512 product, a copy of 256k floats)
        x = net["w"] @ net["w"]
        return np.full(obs.shape[0], int(x.clone().sum() > 0))

@ff.fragment("learner", writes="state")
def learn(state, batch):
    w = state["net"]["w"]
    return {"net": {"w": w * 0.5 + (w @ w) * 1e-6}}, {"m": float(batch["obs"].mean())}

def train(args: Args):
    if args.threads:
        torch.set_num_threads(args.threads)
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"net": {"w": torch.eye(512)}})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(4):
            obs, *_ = env.step(act(state["net"], obs))
            buf.add(obs=obs)
        state, m = learn(state, buf.collect())
        ff.log(m)
    return state
"""


@pytest.mark.parametrize("environ, extra", [({"FRAGFLOW_THREADS": "2"}, []), ({}, ["--set", "threads=2"])])
def test_workers_computing_with_several_torch_threads_do_not_wait_forever(tmp_path, monkeypatch, environ, extra):
    """torch's OpenMP threads do not survive a fork: a worker forked from a driver that ran a parallel
    kernel (the trace, at the run's count) waited forever at its own first one (a SAC run with
    FRAGFLOW_THREADS=2 hung from its first step). Workers that compute with several threads, as
    FRAGFLOW_THREADS or the program's own torch.set_num_threads gives them, start from a fork server."""
    from fragflow.backends.local import start_method

    monkeypatch.delenv("FRAGFLOW_START_METHOD", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if start_method(1) == "fork":   # (a machine whose workers fork)
        assert start_method(2) == "forkserver"
    (tmp_path / "kernels.py").write_text(PARALLEL_KERNELS)
    exe = Path(sys.executable).with_name("fragflow")
    res = subprocess.run([str(exe), "run", str(tmp_path / "kernels.py"), "--policy", "pipelined", "--out",
                          str(tmp_path / "run"), "-q", *extra], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["updates"] == 4


@pytest.mark.parametrize("policy", ["single_process", "pipelined", "actor_learner(actors=2, overflow=deliver)"])
def test_metrics_rows_count_in_integers_and_every_row_has_its_rate(tmp_path, policy):
    """The counters are written as integers (they were 128.0, 1.0) and each row's steps_per_second
    is its own steps over its time: the first rows of a run over several processes had 0.0, made
    before the loops' step reports reached the driver. (Two actors deliver a piece that falls
    behind, not drop it: on a busy machine one was dropped, and the run made 15 updates of 16.)"""
    ff.run(ppo.train, ppo.Args(total_timesteps=2048, num_envs=2, num_steps=64, seed=1), policy=policy,
           out=tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert len(rows) == 16
    for r in rows:
        for column in ("env_steps", "updates", "episodes", "eval_episodes", "restarts"):
            assert re.fullmatch(r"\d+", r[column]), (column, r[column])
        assert float(r["steps_per_second"]) > 0, r
    assert [int(r["env_steps"]) for r in rows] == [128 * (u + 1) for u in range(16)]


@pytest.mark.parametrize("tagged", [False, True])
def test_the_driver_keeps_an_episode_in_a_few_dozen_bytes(tagged):
    """Every episode a run ends stays in the driver (the returns plot, the result's episodes): as a
    tuple in a list, ~140 bytes each and twice that where replicas tag theirs, a long run of short
    CartPole episodes grew by hundreds of MB. Now three typed arrays."""
    import tracemalloc

    from fragflow.runtime.monitor import Monitor

    monitor = Monitor()
    monitor.start()
    n = 50_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            monitor.env_step(20, [(float(i % 500), 20)], 0, [(20 * (i + 1), float(i % 500), 20)] if tagged else None)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(monitor.episodes) == n and monitor.episodes[-1] == (20 * n, float((n - 1) % 500), 20)
    assert grown / n < (64 if tagged else 40), grown / n


RETURNS_METRICS = """
from dataclasses import dataclass
import threading

import numpy as np
import fragflow as ff

@dataclass(frozen=True)
class Args:
    how: str = "tuple"

@ff.fragment("actor")
def act(w, obs, key):
    return (obs @ w + ff.random.gumbel(key, (2,))).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, b):
    w = state["w"] + 0.01 * np.asarray(b["obs"]).mean((0, 1))[:, None]
    return {"w": w}, {"wsum": float(w.sum())}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"w": np.zeros((4, 2))})
    buf = ff.RolloutBuffer(8)
    keys = ff.random.keys(0, env.ids)
    obs = env.reset()
    for u in range(3):
        for _ in range(8):
            keys, sub = ff.random.split(keys)
            obs, r, term, trunc, info = env.step(act(state["w"], obs, sub))
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    if args.how == "tuple":
        return state, metrics
    if args.how == "dict":
        return {"state": state, "m": metrics, "n": 3}
    return state, threading.Lock()   # (what no process can send)
"""


@pytest.mark.parametrize("policy", ["pipelined(max_lag=0)", "actor_learner(actors=2, max_lag=0)"])
def test_a_returned_learner_output_is_none_and_the_rest_of_the_value_comes_back(write_algo, policy):
    """``return state, metrics`` (metrics a learner's output the loop never saw): the whole value was
    None, the state with it, with no word (probe helper); now the output alone is None, as the
    README says. What cannot be pickled at all is None too, and named."""
    path, _ = write_algo(RETURNS_METRICS, "returns.py")
    program = load(str(path))
    one = ff.run(program.train, program.args_cls(), policy="single_process")
    for how in ("tuple", "dict", "lock"):
        r = ff.run(program.train, program.args_cls(how=how), policy=policy)
        state = r.value[0] if how != "dict" else r.value["state"]
        assert np.array_equal(state["w"], one.value[0]["w"]), how
        if how == "tuple":
            assert r.value[1] is None
        elif how == "dict":
            assert r.value["m"] is None and r.value["n"] == 3
        else:
            assert r.value[1] is None
            assert any("cannot be sent from the loop's process" in n and "[1] (lock" in n
                       for n in r.summary.get("notes", [])), r.summary.get("notes")
