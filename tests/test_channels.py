from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import struct
import threading
import time

import numpy as np
import pytest
import torch

from fragflow.backends.local.channels import ChannelClosed, ParamChannel, TrajectoryChannel
from fragflow.compiler.pytree import TensorSpec

CTX = mp.get_context("spawn")
SPECS = [TensorSpec((3, 4), "float32", "numpy"), TensorSpec((2,), "int64", "torch"), TensorSpec((), "float", "python")]


def shm_leftovers() -> list[str]:
    """Segments this test process created and left (another fragflow run on the machine does not count)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"fragflow_{os.getpid()}_")]


@pytest.fixture
def ring():
    handles, seg = TrajectoryChannel.create(CTX, "t", SPECS, capacity=2)
    ch = TrajectoryChannel(handles, seg)
    yield ch
    ch.detach()
    seg.unlink()


def test_ring_keeps_order_versions_types_and_zero_copy(ring):
    assert ring.put([np.full((3, 4), 1, np.float32), torch.tensor([1, 2]), 0.5], version=7)
    assert ring.put([np.full((3, 4), 2, np.float32), torch.tensor([3, 4]), 1.5], version=8)
    assert not ring.put([np.zeros((3, 4), np.float32), torch.tensor([0, 0]), 0.0], version=9, timeout=0.05)  # full
    version, (a, b, c) = ring.get()
    assert version == 7 and a[0, 0] == 1 and isinstance(b, torch.Tensor) and b.tolist() == [1, 2] and c == 0.5
    assert np.shares_memory(a, ring.seg.buf)   # a view into the slot, not a copy
    ring.release(lag=1)
    version, (a, _, c) = ring.get()
    assert version == 8 and a[0, 0] == 2 and c == 1.5
    ring.release(dropped=True)
    ring.close()
    with pytest.raises(ChannelClosed):
        ring.get(timeout=1)
    stats = ring.stats()
    assert stats["puts"] == 2 and stats["gets"] == 2 and stats["drops"] == 1 and stats["lag_histogram"][1] == 1


def _item(i):
    return [np.full((3, 4), i, np.float32), torch.tensor([i, -i]), float(i)]


def test_ring_reuses_the_slot_released_last_and_keeps_fifo_order():
    handles, seg = TrajectoryChannel.create(CTX, "t", SPECS, capacity=3)
    ch = TrajectoryChannel(handles, seg)
    try:
        def where(item) -> int:
            return item[0].__array_interface__["data"][0]

        ch.put(_item(0), version=0)
        _, first = ch.get()
        hot = where(first)
        ch.release()
        for i in range(1, 5):        # a consumer that keeps up: every item lands in the same hot slot
            ch.put(_item(i), version=i)
            _, got = ch.get()
            assert got[0][0, 0] == i and where(got) == hot
            ch.release()
        ch.put(_item(5), version=5)   # three items held at once take three different slots
        ch.put(_item(6), version=6)
        ch.put(_item(7), version=7)
        held = [ch.get() for _ in range(3)]
        assert [v for v, _ in held] == [5, 6, 7] and where(held[0][1]) == hot
        assert len({where(item) for _, item in held}) == 3
        ch.release()                  # frees item 5's slot, then item 6's: the next put takes 6's
        ch.release()
        ch.put(_item(8), version=8)
        assert ch.put(_item(9), version=9)
        ch.release()
        (v8, got8), (v9, got9) = ch.get(), ch.get()
        assert (v8, v9) == (8, 9) and got8[0][0, 0] == 8 and got9[0][0, 0] == 9
        assert where(got8) == where(held[1][1]) and where(got9) == where(held[0][1])
    finally:
        ch.detach()
        seg.unlink()


def test_ring_rejects_wrong_dtype(ring):
    with pytest.raises(TypeError):
        ring.put([np.zeros((3, 4), np.float64), torch.tensor([1, 2]), 0.5], version=0)


def _produce(handles, n):
    ch = TrajectoryChannel.open(handles)
    for i in range(n):
        ch.put([np.full((3, 4), i, np.float32), torch.tensor([i, -i]), float(i)], version=i)
    ch.close()
    ch.detach()


def test_ring_between_processes_delivers_everything_in_order():
    handles, seg = TrajectoryChannel.create(CTX, "t", SPECS, capacity=3)
    ch = TrajectoryChannel(handles, seg)
    p = CTX.Process(target=_produce, args=(handles, 300))
    p.start()
    seen = []
    try:
        while True:
            try:
                item = ch.get(timeout=10)
            except ChannelClosed:
                break
            assert item is not None
            v, (a, b, c) = item
            assert (a == v).all() and b.tolist() == [v, -v] and c == float(v)
            seen.append(v)
            ch.release(lag=0)
    finally:
        p.join(10)
        ch.detach()
        seg.unlink()
    assert seen == list(range(300))
    assert shm_leftovers() == []


PARAMS = [TensorSpec((256, 256), "float32", "torch"), TensorSpec((1000,), "float64", "numpy")]


def _write(handles, stop):
    ch = ParamChannel.open(handles)
    v, end = 0, time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < end:
        ch.publish([torch.full((256, 256), float(v)), np.full(1000, float(v))], v)
        v += 1
    ch.detach()


def _read(handles, wanted, out):
    """Reads until ``wanted`` reads (of at least a few versions), however slow the machine is."""
    ch = ParamChannel.open(handles)
    reads, torn, last, versions, end = 0, 0, -1, set(), time.monotonic() + 60
    while (reads < wanted or len(versions) < 5) and time.monotonic() < end:
        if ch.latest < 0:
            continue
        v, (w, x) = ch.read()
        if not ((w == v).all() and (x == v).all()):
            torn += 1
        if v < last:
            torn += 1
        last, reads = v, reads + 1
        versions.add(v)
        ch._cache = None
    out.put((reads, len(versions), torn))
    ch.detach()


def test_parameter_broadcast_never_tears_under_concurrent_writes():
    """Readers read while a writer publishes new versions as fast as it can: no read mixes two
    versions, none goes back. Counted in reads, not seconds, so a busy machine only makes it slower."""
    handles, seg = ParamChannel.create("p", PARAMS, depth=2)
    out, stop = CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=_write, args=(handles, stop))] + [
        CTX.Process(target=_read, args=(handles, 200, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in range(2)]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
        seg.close()
        seg.unlink()
    assert all(reads >= 200 and versions >= 5 for reads, versions, _ in results), results
    assert [torn for _, _, torn in results] == [0, 0]


def test_exact_versions_stay_readable_within_the_ring_depth():
    handles, seg = ParamChannel.create("p", PARAMS, depth=3)
    ch = ParamChannel(handles, seg)
    try:
        with pytest.raises(LookupError):
            ch.read()
        for v in range(5):
            ch.publish([torch.full((256, 256), float(v)), np.full(1000, float(v))], v)
        assert ch.latest == 4
        assert float(ch.read(2)[1][0][0, 0]) == 2.0
        with pytest.raises(LookupError, match="overwritten"):
            ch.read(1)
        assert ch.wait_for(4, timeout=0.1) == 4
        with pytest.raises(TimeoutError):
            ch.wait_for(9, timeout=0.05)
    finally:
        ch.detach()
        seg.unlink()


def _die_holding_the_write_lock(q) -> None:   # killed midway through a report, its queue's write lock held
    q._wlock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _die_midway_through_a_report(q) -> None:   # a report's header and a tenth of its bytes, then killed
    q.put("whole, before")
    q.close()
    q.join_thread()
    os.write(q._writer.fileno(), struct.pack("!i", 100) + b"x" * 10)
    os.kill(os.getpid(), signal.SIGKILL)


def _report(q) -> None:
    q.put("from actor 1")   # a process exits only once its queue has flushed this


def test_a_process_killed_while_reporting_blocks_no_other_processs_reports():
    from fragflow.backends.local import Reports

    ctx = mp.get_context("fork")
    reports = Reports(ctx)
    killed = reports.new("actor-0")
    p = ctx.Process(target=_die_holding_the_write_lock, args=(killed,))
    p.start()
    reports.started("actor-0")
    p.join()
    assert p.exitcode == -signal.SIGKILL
    other = reports.new("actor-1")
    r = ctx.Process(target=_report, args=(other,))   # sharing the killed one's queue, it would never exit
    r.start()
    reports.started("actor-1")
    r.join(timeout=20)
    assert r.exitcode == 0
    assert reports.get(timeout=5) == "from actor 1"
    with pytest.raises(queue.Empty):   # both processes have ended: their queues too
        reports.get(timeout=0.05)

    # killed midway through a report: what it sent whole arrives, the rest ends its queue
    q = reports.new("actor-0")
    p = ctx.Process(target=_die_midway_through_a_report, args=(q,))
    p.start()
    reports.started("actor-0")
    p.join()
    assert reports.get(timeout=5) == "whole, before"
    with pytest.raises(queue.Empty):
        reports.get(timeout=0.5)
    restarted = ctx.Process(target=_report, args=(reports.new("actor-0"),))   # restarted: a queue of its own
    restarted.start()
    reports.started("actor-0")
    assert reports.get(timeout=5) == "from actor 1"
    restarted.join(timeout=20)
    reports.close()


def _report_from_the_loop(q, out) -> None:
    q.put({"steps": 3})
    out.put(threading.active_count())   # (a feeder thread would be the second, started by the put)


def test_a_report_is_written_on_the_calling_thread_and_dropped_once_the_driver_stops_reading():
    """A worker's report queue started a feeder thread, which waited for the GIL while the loop
    computed and was woken in vain at every numpy call that let it go (about 10 us each, on the
    pipelined DQN actor's argmax): reports are written by the thread that puts them."""
    from fragflow.backends.local import Reports

    ctx = mp.get_context("fork")
    reports = Reports(ctx)
    threads = ctx.SimpleQueue()
    p = ctx.Process(target=_report_from_the_loop, args=(reports.new("actor-0"), threads))
    p.start()
    reports.started("actor-0")
    assert reports.get(timeout=5) == {"steps": 3}
    p.join(timeout=20)
    assert p.exitcode == 0
    assert threads.get() == 1
    go = ctx.Event()
    p = ctx.Process(target=_report_late, args=(reports.new("actor-1"), go))
    p.start()
    reports.started("actor-1")
    reports.retire("actor-1")   # the driver no longer reads it (its run is ending)
    go.set()
    p.join(timeout=20)
    assert p.exitcode == 0      # its reports dropped, not raised into its loop
    reports.close()


def _report_late(q, go) -> None:
    q.writing_only()   # (as a worker's endpoints do)
    go.wait(10)
    q.put("late")
    q.put("x" * 200_000)   # (more than the pipe holds)


def test_segments_of_a_driver_that_no_longer_runs_are_removed_by_the_next_run():
    """A SIGKILL to a run's whole process group (timeout -s KILL, a scheduler) kills Python's
    resource tracker too: the run's segments stayed in /dev/shm for good (helper round 32 S)."""
    import subprocess
    import sys

    from fragflow.backends.local.shm import PREFIX, sweep_dead

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    names = [f"{PREFIX}{dead}_0", f"{PREFIX}{os.getpid()}_999999"]
    for name in names:
        with open(os.path.join("/dev/shm", name), "wb") as f:
            f.write(b"\0" * 64)
    try:
        assert names[0] in sweep_dead()
        assert not os.path.exists(os.path.join("/dev/shm", names[0]))
        assert os.path.exists(os.path.join("/dev/shm", names[1]))   # a live driver's: kept
    finally:
        for name in names:
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))


def test_a_segment_dev_shm_has_no_room_for_is_an_error_as_it_is_made_and_is_not_left_behind(monkeypatch):
    """A segment's pages were taken as they were first touched: past a full /dev/shm the process
    touching one (the driver zeroing a broadcast, an actor writing its ring) was killed by SIGBUS.
    They are taken as the segment is made, where running out is an error."""
    import errno

    from fragflow.errors import SharedMemoryError

    sizes = []

    def full(fd: int, offset: int, length: int) -> None:
        sizes.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryError, match=r"a shared-memory segment of 3\.0 MB could not be made: /dev/shm "
                                                r"is full \(\d+\.\d MB free\)\n  fix: .*--shm-size"):
        ParamChannel.create("s", [TensorSpec((3, 1 << 18), "float32", "numpy")], depth=1)
    assert sizes == [ParamChannel.nbytes([TensorSpec((3, 1 << 18), "float32", "numpy")], 1)]
    assert shm_leftovers() == []
