"""Trajectory channel bandwidth between two processes vs memcpy and multiprocessing.Queue.

A producer process puts float32 batches of each size into a trajectory channel (shared-memory slots,
three by default: max_lag + 2 for the default policy's max_lag=1); the consumer (this process)
takes each with ``get`` (a zero-copy view), touches it and releases it. Baselines in the same run: ``np.copyto`` of the same batch in one process (memcpy), and
the same batches through a ``multiprocessing.Queue``. Each figure is the median of several
repetitions of moving about 2 GB (64 MB through the Queue).

Steady state is measured: the clock starts after the ring has gone round twice, so every slot's
pages are mapped in both processes, as they are a few updates into any run (the first touch of a
fresh 4 MB slot costs about a thousand page faults, more than the copy itself).

    python benchmarks/channel_bandwidth.py [--reps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import print_rows, row, save, stats  # noqa: E402

from fragflow.backends.local.channels import ChannelClosed, TrajectoryChannel  # noqa: E402
from fragflow.compiler.pytree import TensorSpec  # noqa: E402

SIZES = {"64KB": 64 << 10, "1MB": 1 << 20, "4MB": 4 << 20, "16MB": 16 << 20}
VOLUME = 2 << 30
CTX = mp.get_context("spawn")


def _channel_producer(handles, n: int, nbytes: int) -> None:
    ch = TrajectoryChannel.open(handles)
    batch = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    for i in range(n):
        ch.put([batch], version=i)
    ch.close()
    ch.detach()


def _queue_producer(q, n: int, nbytes: int) -> None:
    batch = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    for _ in range(n):
        q.put(batch)
    q.put(None)


def channel(nbytes: int, capacity: int) -> float:
    warm = 2 * capacity
    n = warm + max(8, VOLUME // nbytes)
    handles, seg = TrajectoryChannel.create(CTX, "bench", [TensorSpec((nbytes // 4,), "float32", "numpy")],
                                            capacity=capacity)
    ch = TrajectoryChannel(handles, seg)
    p = CTX.Process(target=_channel_producer, args=(handles, n, nbytes))
    p.start()
    try:
        for _ in range(warm):          # start the clock once every slot has been used twice
            first = ch.get(timeout=60)
            assert first is not None
            ch.release()
        t0, count, check = time.perf_counter(), 0, 0.0
        while True:
            try:
                item = ch.get(timeout=60)
            except ChannelClosed:
                break
            assert item is not None
            check += float(item[1][0][-1])   # touch the data
            ch.release()
            count += 1
        dt = time.perf_counter() - t0
    finally:
        p.join(30)
        ch.detach()
        seg.unlink()
    return count * nbytes / dt


def queue_(nbytes: int) -> float:
    n = max(8, min(VOLUME, 64 << 20) // nbytes)
    q = CTX.Queue(maxsize=4)
    p = CTX.Process(target=_queue_producer, args=(q, n, nbytes))
    p.start()
    q.get()
    t0, count = time.perf_counter(), 0
    while q.get() is not None:
        count += 1
    dt = time.perf_counter() - t0
    p.join(30)
    return count * nbytes / dt


def memcpy(nbytes: int) -> float:
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    n = max(8, VOLUME // nbytes)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, src)
    return n * nbytes / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--capacity", type=int, default=3, help="ring slots (policies use max_lag + 2)")
    a = p.parse_args(argv)
    rows, raw = [], {}
    for label, nbytes in SIZES.items():
        ch, mc, qu = [], [], []
        for _ in range(a.reps):
            ch.append(channel(nbytes, a.capacity) / 1e9)
            mc.append(memcpy(nbytes) / 1e9)
            qu.append(queue_(nbytes) / 1e9)
        raw[label] = {"channel_GBps": ch, "memcpy_GBps": mc, "queue_GBps": qu}
        rows.append(row(f"channel {label} GB/s vs memcpy", stats(ch), "memcpy", stats(mc), "GB/s", ">= 0.5 (1-16MB)"))
        rows.append(row(f"channel {label} GB/s vs mp.Queue", stats(ch), "mp.Queue", stats(qu), "GB/s", ">= 10 (1-16MB)"))
        print(f"{label}: channel {np.median(ch):.2f} GB/s, memcpy {np.median(mc):.2f} GB/s, queue {np.median(qu):.2f} GB/s",
              flush=True)
    save(f"channel_bandwidth_capacity{a.capacity}", {"capacity": a.capacity, "command": "python benchmarks/channel_bandwidth.py " + " ".join(argv or sys.argv[1:]),
                               "rows": rows, "raw": raw})
    print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
