"""The collector during a run: the objects that exist as the loop starts and once the program has
made its state are frozen (out of the collector's full walks), in the driver and in every worker,
and the driver hands them back when the run ends, however it ends."""

from __future__ import annotations

import csv
import gc

import pytest

import fragflow as ff
from fragflow.program import load

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
