"""The heap during a run. The collector: the objects that exist as the loop starts and once the
program has made its state are frozen (out of the collector's full walks), in the driver and in
every worker, and the driver hands them back when the run ends, however it ends. glibc's malloc:
every process of a run keeps the memory it frees for its next allocations, and the driver's gets
thresholds glibc's own rule reaches back after the run."""

from __future__ import annotations

import csv
import gc
import json
import subprocess
import sys

import pytest

import fragflow as ff
from fragflow.errors import ConfigError
from fragflow.program import load
from fragflow.runtime import heap

PROGRAM = """
import gc
from dataclasses import dataclass
import numpy as np
import torch
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 6
    fail_at: int = 0   # the update at which learn raises (0: never)

@ff.fragment("actor")
def act(params, obs):
    return np.zeros(obs.shape[0], dtype=np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch, fail_at):
    if fail_at and state["t"][0] + 1 >= fail_at:
        raise RuntimeError("boom in learn")
    return {"t": state["t"] + 1, "net": state["net"]}, {"frozen": gc.get_freeze_count()}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"t": np.zeros(1), "net": torch.nn.Linear(2, 2)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(4):
            action = act(state["t"], obs)
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect(), args.fail_at)
        ff.log(metrics)
    return state
"""


def _frozen_column(run_dir) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r["frozen"]) for r in csv.DictReader(f)]


@pytest.mark.parametrize("policy", ["single_process", "pipelined(actors=1)"])
def test_a_run_freezes_its_objects_and_the_driver_hands_them_back(write_algo, tmp_path, policy):
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects())
    ff.run(program.train, program.args_cls(), policy=policy, out=tmp_path / "run")
    frozen = _frozen_column(tmp_path / "run")
    # the learner (in the driver's process, or in a worker's) ran with the process's objects frozen:
    # at least those that existed as the loop started (the imports: many thousands), and from the first
    # update on, the program's too (its network, environments, buffers)
    assert len(frozen) == 6 and min(frozen) > 1000 and frozen[-1] > frozen[0]
    assert gc.get_freeze_count() == 0                    # handed back to the collector
    assert len(gc.get_objects()) >= before * 0.5         # (and still tracked by it)


def test_a_failed_run_hands_them_back_too(write_algo):
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    with pytest.raises(RuntimeError, match="boom in learn"):
        ff.run(program.train, program.args_cls(fail_at=3), policy="single_process")
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_is_left_as_it_is(write_algo, tmp_path):
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        ff.run(program.train, program.args_cls(), policy="single_process", out=tmp_path / "run")
        # nothing frozen beyond the user's (a frozen object freed by its references leaves the count)
        assert max(_frozen_column(tmp_path / "run")) <= mine
        assert 0 < gc.get_freeze_count() <= mine                 # nor handed back
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_left_disabled_and_nothing_frozen(write_algo, tmp_path):
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    gc.disable()
    try:
        ff.run(program.train, program.args_cls(), policy="single_process", out=tmp_path / "run")
        assert set(_frozen_column(tmp_path / "run")) == {0}
        assert not gc.isenabled()
    finally:
        gc.enable()


MALLOC_PROGRAM = """
import ctypes
from dataclasses import dataclass
import numpy as np
import fragflow as ff

def own_pages(nbytes):
    '''Whether an allocation of nbytes gets pages of its own from the system (glibc's mmapped blocks).'''
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    before = libc.mallinfo2().hblkhd
    block = np.empty(nbytes, np.uint8)
    grew = libc.mallinfo2().hblkhd - before
    del block
    return float(grew >= nbytes)

@dataclass(frozen=True)
class Args:
    updates: int = 3

@ff.fragment("actor")
def act(t, obs):
    return np.zeros(obs.shape[0], dtype=np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    return {"t": state["t"] + 1}, {"own_pages": own_pages(64 << 20)}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    state = ff.versioned({"t": np.zeros(1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(4):
            action = act(state["t"], obs)
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    return state
"""

glibc = pytest.mark.skipif(heap._glibc() is None or not hasattr(heap._glibc(), "mallinfo2"),
                           reason="glibc's malloc (2.33 or later) only: other C libraries are left as they are")


def _own_pages_column(run_dir) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r["own_pages"]) for r in csv.DictReader(f)]


# The run in a process of its own: whether a block gets pages of its own depends on the heap's free
# chunks too (one that fits is used whatever the threshold), and a test process that ran many runs
# before holds some of 64 MB and more
FRESH_RUN = """
import json, sys
import fragflow as ff
from fragflow.program import load

program = load(sys.argv[1])
own_pages = program.train.__globals__["own_pages"]
before = own_pages(64 << 20)
ff.run(program.train, program.args_cls(), policy=sys.argv[2], out=sys.argv[3])
print(json.dumps({"before": before, "after": [own_pages(64 << 20), own_pages(16 << 20)]}))
"""


def _run_fresh(write_algo, tmp_path, policy) -> dict:
    path, _ = write_algo(MALLOC_PROGRAM)
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_RUN)
    res = subprocess.run([sys.executable, str(script), str(path), policy, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@glibc
@pytest.mark.parametrize("policy, start", [("single_process", ""), ("pipelined(actors=1)", "fork"),
                                           ("pipelined(actors=1)", "spawn")])
def test_a_run_keeps_the_memory_it_frees_and_the_driver_gets_glibc_s_thresholds_back(write_algo, tmp_path, policy,
                                                                                 start, monkeypatch):
    """(A forked worker inherits the driver's thresholds; a spawned one sets its own.)"""
    for name in ("FRAGFLOW_MALLOC", *heap._USERS_OWN, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    if start:
        monkeypatch.setenv("FRAGFLOW_START_METHOD", start)
    seen = _run_fresh(write_algo, tmp_path, policy)
    assert seen["before"] == 1.0   # glibc's own: a block this big (above 32 MiB) is given its own pages
    # the learner (in the driver's process, or a worker's) took a 64 MB block from the heap, kept there
    assert _own_pages_column(tmp_path / "run") == [0.0, 0.0, 0.0]
    # after the run, the process's mmap threshold is back at 32 MiB (what glibc's own rule reaches at most),
    # its trim threshold at 64 MiB: a 64 MB block gets its own pages again, a 16 MB one comes from the heap
    assert seen["after"] == [1.0, 0.0]


@glibc
@pytest.mark.parametrize("environ", [{"FRAGFLOW_MALLOC": "system"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}])
def test_malloc_left_as_it_is_where_asked_or_where_the_process_has_glibc_s_own_settings(write_algo, tmp_path,
                                                                                       monkeypatch, environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FRAGFLOW_START_METHOD", "fork")   # (the learner's process has the driver's settings)
    _run_fresh(write_algo, tmp_path, "pipelined(actors=1)")
    assert _own_pages_column(tmp_path / "run") == [1.0, 1.0, 1.0]


def test_a_malformed_fragflow_malloc_is_refused_before_the_run(write_algo, monkeypatch):
    monkeypatch.setenv("FRAGFLOW_MALLOC", "jemalloc")
    path, _ = write_algo(MALLOC_PROGRAM)
    program = load(str(path))
    with pytest.raises(ConfigError, match=r"FRAGFLOW_MALLOC='jemalloc' is not one of keep, system") as info:
        ff.run(program.train, program.args_cls(), policy="single_process")
    assert "FRAGFLOW_MALLOC=system" in info.value.fix


class _OldGlibc:
    """glibc before 2.35: mallopt refuses an mmap threshold above 32 MiB (and changes nothing then)."""

    def __init__(self, refuse_all: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse_all = refuse_all

    def mallopt(self, param: int, value: int) -> int:
        if param == heap.M_MMAP_THRESHOLD and (self.refuse_all or value > 32 << 20):
            return 0
        self.calls.append((param, value))
        return 1


def test_an_older_glibc_refusing_the_threshold_gets_32_mib_and_the_trim_threshold_only_then(monkeypatch):
    for name in ("FRAGFLOW_MALLOC", *heap._USERS_OWN, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    old = _OldGlibc()
    monkeypatch.setattr(heap, "_glibc", lambda: old)
    assert heap.keep_freed()
    assert old.calls == [(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, heap.KEEP_FREE)]
    # a C library that takes no threshold at all is left as it is: no trim threshold either (a value
    # given turns glibc's own rule off)
    none = _OldGlibc(refuse_all=True)
    monkeypatch.setattr(heap, "_glibc", lambda: none)
    assert not heap.keep_freed() and none.calls == []
    # glibc's tunables of other parts of malloc (its arenas) leave the thresholds to fragflow
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    old.calls.clear()
    monkeypatch.setattr(heap, "_glibc", lambda: old)
    assert heap.keep_freed() and old.calls[-1] == (heap.M_TRIM_THRESHOLD, heap.KEEP_FREE)
