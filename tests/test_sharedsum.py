"""The replicated learners' shared-memory sum (fragflow/backends/local/sharedsum.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from fragflow.backends.local import sharedsum
from fragflow.backends.local.sharedsum import SLOT, SharedSum, SizesDiffer

pytestmark = pytest.mark.skipif(not sharedsum.available(), reason="the shared-memory sum runs on x86-64 only")


def _values(rank: int, n: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(dtype)


def _learner(name: str, rank: int, world: int, sizes: list[int], dtype: str, out: mp.Queue) -> None:
    s = SharedSum(name, rank, world)
    got = []
    try:
        for n in sizes:
            x = _values(rank, n, dtype)
            s.sum(x, lambda: None)
            got.append(x)
        out.put((rank, got))
    except SizesDiffer:
        out.put((rank, "sizes differ"))
    finally:
        s.close()


def _run(world: int, sizes: list[list[int]], dtype: str = "float32") -> dict[int, object]:
    ctx = mp.get_context("spawn")
    seg = sharedsum.create(world, world)
    out = ctx.Queue()
    procs = [ctx.Process(target=_learner, args=(seg.name, k, world, sizes[k], dtype, out)) for k in range(world)]
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(10)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        seg.close()
        seg.unlink()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_learner_gets_the_same_sums_in_rank_order_over_several_rounds(dtype):
    world = 3
    big = SLOT // np.dtype(dtype).itemsize * 2 + 1001   # three rounds of a slot
    sizes = [5, big, 0, 7]                              # (and an empty tensor, and a small one after a large)
    results = _run(world, [sizes] * world, dtype)
    for i, n in enumerate(sizes):
        expected = _values(0, n, dtype)
        for k in range(1, world):
            expected = expected + _values(k, n, dtype)   # (the order every stripe is summed in)
        for k in range(world):
            got = results[k][i]
            assert got.dtype == np.dtype(dtype) and np.array_equal(got, expected), (k, n)


def test_learners_summing_different_sizes_each_find_it_before_summing():
    results = _run(2, [[4, 6], [4, 5]])
    assert results == {0: "sizes differ", 1: "sizes differ"}


def test_a_learner_waiting_for_one_that_never_comes_asks_its_check():
    seg = sharedsum.create(2, 2)
    s = SharedSum(seg.name, 0, 2)
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise RuntimeError("learner 1 ended")

    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="learner 1 ended"):
            s.sum(np.ones(3, np.float32), check)
        assert len(calls) == 2 and calls[0] - start >= sharedsum.CHECK_EVERY * 0.9
    finally:
        s.close()
        seg.close()
        seg.unlink()


def test_learners_spin_longer_where_every_process_of_the_run_has_a_core(monkeypatch):
    monkeypatch.setattr(sharedsum.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert sharedsum.spin_for(9) == sharedsum.SPIN_SPARE and sharedsum.spin_for(17) == sharedsum.SPIN_SECONDS
    for processes, spin in ((9, sharedsum.SPIN_SPARE), (17, sharedsum.SPIN_SECONDS)):
        seg = sharedsum.create(8, processes)
        s = SharedSum(seg.name, 3, 8)
        try:
            assert s.spin == spin and s.reached == 0
        finally:
            s.close()
            seg.close()
            seg.unlink()


def test_a_learner_waiting_in_a_shared_memory_sum_leaves_when_the_run_stops():
    """The run's stop (a learner killed by a signal says nothing in the store; an actor failed) ends
    the wait, as the module's text says, rather than the driver's terminate a few seconds later."""
    import threading

    from fragflow.backends import Stopped
    from fragflow.runtime.allreduce import GradientAllReduce

    class Store:   # (no learner has said it ended or failed)
        def check(self, keys):
            return False

    stop = threading.Event()
    stop.set()
    reducer = GradientAllReduce(0, 2, ("127.0.0.1", 0), "", stop)
    reducer.store = Store()
    with pytest.raises(Stopped):
        reducer._check_peers()
