"""What one multi_learner minibatch step costs: its arithmetic and its gradient all-reduce, by K.

``multi_learner(learners=K)`` splits each update's samples over K learners and averages every
minibatch's gradient across them (one all-reduce of the flattened gradient, gloo on the CPU). This
times the two parts apart, on PPO's networks (``algorithms/ppo.py``: separate actor and critic MLPs
of ``--hidden`` units, CartPole's sizes) with the benchmark's update (2,048 samples, 4 minibatches):
one process's forward, backward and Adam step on a minibatch of 512 / K samples, and K processes'
all-reduce of a gradient that size (torch.distributed, gloo, one thread each), the median of
``--calls`` calls after a warm-up. Where the all-reduce outweighs what K learners save in
arithmetic, more learners cannot go faster.

    python benchmarks/allreduce.py [--learners 1 2 4 8] [--hidden 256] [--calls 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from common import save


def _mlp(hidden: int, out: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))


def _step_seconds(hidden: int, batch: int, calls: int) -> float:
    import torch

    torch.set_num_threads(1)
    actor, critic = _mlp(hidden, 2), _mlp(hidden, 1)
    opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=2.5e-4)
    obs, act, ret = torch.randn(batch, 4), torch.randint(0, 2, (batch,)), torch.randn(batch)
    times = []
    for i in range(calls + 10):
        t = time.perf_counter()
        logp = torch.distributions.Categorical(logits=actor(obs)).log_prob(act)
        loss = -(logp * ret).mean() + 0.5 * ((critic(obs).squeeze(1) - ret) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 10:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _reduce(rank: int, world: int, port: int, numel: int, calls: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    flat = torch.randn(numel)
    times = []
    for i in range(calls + 10):
        t = time.perf_counter()
        dist.all_reduce(flat)
        if i >= 10:
            times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    out.put(statistics.median(times))


def _reduce_seconds(world: int, numel: int, calls: int) -> float:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_reduce, args=(r, world, store.port, numel, calls, out)) for r in range(world)]
    for p in procs:
        p.start()
    medians = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return max(medians)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default="allreduce", help="results file name")
    a = p.parse_args(argv)
    numel = sum(q.numel() for net in (_mlp(a.hidden, 2), _mlp(a.hidden, 1)) for q in net.parameters())
    rows = []
    for k in a.learners:
        step = _step_seconds(a.hidden, 512 // k, a.calls)
        reduce = _reduce_seconds(k, numel, a.calls) if k > 1 else 0.0
        rows.append({"learners": k, "minibatch": 512 // k, "step_ms": 1e3 * step, "allreduce_ms": 1e3 * reduce})
        print(f"K={k}: minibatch of {512 // k}: arithmetic {1e3 * step:.2f} ms, all-reduce of {numel:,} floats "
              f"{1e3 * reduce:.2f} ms", flush=True)
    result = {"command": "python benchmarks/allreduce.py " + " ".join(argv or sys.argv[1:]), "hidden": a.hidden,
              "gradient_floats": numel, "calls": a.calls, "rows": rows, "cpus": os.cpu_count()}
    save(a.out, result)
    return result


if __name__ == "__main__":
    main()
