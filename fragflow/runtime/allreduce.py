"""Gradient all-reduce between replicated learners (``multi_learner``, the DD-PPO shape).

Each learner process runs the user's ``learn`` on its own actors' share of the batch. For the K
of them to make the update one learner would make on the whole batch, every gradient is averaged
over the K processes as soon as it is computed, before the user's code clips it or steps the
optimizer: what ``backward()`` accumulates into the parameters of the learner's state (those of
every ``torch.optim`` optimizer in it, and of its modules and tensors, which an optimizer the
learner makes itself steps; a hook on each parameter collects them, one all-reduce of them all runs
when the backward pass ends, as DDP's buckets do), and what ``torch.autograd.grad`` returns while
the learner runs (functional updates, such as the PPO here, whose Adam is hand-written).
Parameters and optimizer states then stay identical in every learner, so one of them publishes
the weights for all.

Where every learner's tensors are on the CPU and the backend made them a shared-memory segment
(the local backend, on x86-64), the gradients are summed there (``backends/local/sharedsum.py``:
an update's 41 all-reduces of PPO's gradient took 16-23 ms on 2 cores against 102-109 ms with gloo);
else, or with ``FRAGFLOW_ALLREDUCE=gloo``, by the process group: ``torch.distributed`` with gloo
(nccl where each learner's parameters are on a GPU of its own), meeting at a TCP store the driver
hosts, which every learner joins either way (the checks below all-reduce through it). The user's update must make the same number of backward
passes in every learner per update (no data-dependent early stop), as in DD-PPO: each all-reduce
carries a few numbers saying where its learner is (which update, called after how many env steps,
which gradient of it), and one more, as each update ends, says it ended; the learners refuse the
run where they differ, rather than average unrelated gradients or wait for one that never comes.
That last all-reduce also carries a checksum of the new state each learner made: learners whose
states differ (a value computed from a learner's own share: a running statistic, a counter, a
BatchNorm's running moments) are refused, the parts that differ named, rather than left to hold
different states of which learner 0's alone is published and checkpointed.
(A separate all-reduce of those numbers before each gradient's made two learners on two cores
15-20% slower: 4,212 and 3,757 samples/s against 5,364 and 4,435 in `benchmarks/multi_learner.py`;
carried in the gradient's, 5,403 and 5,029 against 5,155 and 5,183.)
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fragflow.errors import ConfigError
from fragflow.runtime import learnerstate


def setting() -> str:
    """``FRAGFLOW_ALLREDUCE``: how learners on one machine with their tensors on the CPU sum their
    gradients: ``shm`` (the default, where the machine allows: see sharedsum) or ``gloo``."""
    value = os.environ.get("FRAGFLOW_ALLREDUCE", "").strip().lower() or "shm"
    if value not in ("shm", "gloo"):
        raise ConfigError(f"FRAGFLOW_ALLREDUCE={value!r} is not a way multi_learner's learners sum their gradients",
                          fix="unset it (shared memory where the learners share a machine) or set FRAGFLOW_ALLREDUCE=gloo")
    return value


def group_backend(devices: list[str]) -> str:
    """The process group's backend from every learner's devices (``devices[k]``: learner k's, comma
    separated): nccl where each learner's tensors are all on a GPU of its own, else gloo (which also
    averages tensors on a GPU). Every learner must choose the same: nccl refuses two learners on one
    GPU, and learners that chose differently would wait for each other for good."""
    gpus = [d for d in devices if d.startswith("cuda") and "," not in d]
    return "nccl" if len(gpus) == len(devices) and len(set(gpus)) == len(gpus) else "gloo"


class GradientAllReduce:
    def __init__(self, rank: int, world: int, rendezvous: tuple[str, int] | None, sums: str = "",
                 stop: Any = None) -> None:
        import torch.distributed as dist

        if rendezvous is None:
            raise ConfigError("replicated learners need a rendezvous address", fix="run them through fragflow.run")
        self.rank, self.world = rank, world
        self.dist = dist
        self.rendezvous = rendezvous
        self.watched: set[int] = set()
        self.handles: list[Any] = []
        self.group_backend: str | None = None
        self.averaged = 0
        self.learned = False                # whether any update of this run has averaged a gradient
        self.closes = 0                     # updates ended (their states compared: large arrays every 16th)
        self.pending: list[Any] = []        # parameters whose gradient this backward pass accumulated
        self.queued = False
        self.order: dict[int, int] = {}     # a watched parameter's place in every learner's all-reduces
        self.next_order = 0
        self.call: _Call | None = None      # the update in progress: what every learner must agree on
        self.device: Any = "cpu"            # where the all-reduced numbers are
        self.last: tuple[int, Any, Any] = (0, None, None)   # the size, dtype and device of the last gradient
        # and of each gradient of the updates of each fragment, in order (the longest of its updates so far)
        self.sizes: dict[str, list[tuple[int, Any, Any]]] = {}
        self.params: list[Any] = []         # the parameters watched (see watch)
        self.store: Any = None
        self.sums = sums                    # the run's shared-memory segment for summing (learners of one machine)
        self.shared: Any = None             # its SharedSum, where every learner's tensors are on the CPU
        self.stop = stop                    # the run's stop event: a shared-memory sum's wait ends on it
        # where a learner's time goes (see report): its updates, the user's calls in them, the all-reduces
        self.timing = {"busy_ns": 0, "call_ns": 0, "sync_ns": 0, "all_reduces": 0, "updates": 0}
        self.ways: set[str] = set()         # how its sums went (shared memory, gloo, nccl)
        # fragment -> the loop its call is in that replicas could leave apart (placement.refusals.left_loop)
        self.left_loop: dict[str, Any] = {}

    def _join(self, devices: set[Any]) -> None:
        """Join the process group, with the backend :func:`group_backend` chooses from every
        learner's devices (each learner tells the others its own through the store)."""
        assert self.rendezvous is not None
        host, port = self.rendezvous
        store = self.dist.TCPStore(host, port, self.world + 1, is_master=False)
        store.set(f"fragflow.devices.{self.rank}", ",".join(sorted({str(d) for d in devices})))
        seen = [store.get(f"fragflow.devices.{k}").decode() for k in range(self.world)]   # (get waits for the key)
        self.group_backend = group_backend(seen)
        if self.group_backend == "nccl":   # (nccl reduces only tensors on the learner's GPU)
            self.device = next(d for d in devices if str(d).startswith("cuda"))
        self.dist.init_process_group(self.group_backend, store=store, rank=self.rank, world_size=self.world)
        self.store = store
        if self.sums and all(d in ("", "cpu") for d in seen):   # (no segment: FRAGFLOW_ALLREDUCE=gloo)
            from fragflow.backends.local.sharedsum import SharedSum

            self.shared = SharedSum(self.sums, self.rank, self.world)

    def _all_reduce(self, tensor: Any, **kwargs: Any) -> None:
        """``all_reduce``; where it fails because another learner ended its run (every loop replica it
        serves left the loop) while this one still updates, the reason, not the transport's error."""
        import torch

        t0 = time.perf_counter_ns()
        if self.shared is not None and not kwargs and tensor.dtype in (torch.float32, torch.float64):
            # (every learner's tensors are on the CPU; detached: a gradient taken with create_graph=True
            # requires grad, and is summed in place, as gloo does)
            self.shared.sum(tensor.detach().numpy(), self._check_peers)
            self.ways.add("shared memory")
        else:
            if not kwargs:   # (a sum: gloo's where the tensor is bfloat16 or float16, or on a GPU)
                self.ways.add(str(self.group_backend))
            try:
                self.dist.all_reduce(tensor, **kwargs)
            except RuntimeError:
                ended, failed = self._peers_out()
                if failed:   # another learner's own error is the run's: its report goes to the driver first
                    time.sleep(0.5)
                if not ended:
                    raise
                raise self._ended(ended) from None
        self.timing["sync_ns"] += time.perf_counter_ns() - t0
        self.timing["all_reduces"] += 1

    def _ended(self, ended: list[int]) -> ConfigError:
        from fragflow.placement.refusals import left_apart, left_at

        call = self.call
        loop = self.left_loop.get(call.fragment) if call is not None else None
        from fragflow.runtime.replicas import apart

        return apart(ConfigError(
            f"learner(s) {', '.join(map(str, ended))} ended their run (every loop replica they serve left the "
            f"training loop) while learner {self.rank} still updated"
            + (f" in '{call.fragment}'" if call is not None else "")
            + ", and multi_learner averages every update's gradients across the learners: the loop replicas "
              "left the loop" + left_apart(loop),
            where=left_at(loop) or (call.called_at if call is not None else None),
            fix="end the loop on a count every replica shares (updates, the configured total of steps), or run "
                "with one learner (learners=1) or a single-learner policy"))

    def _check_peers(self) -> None:
        """While waiting for the others in a shared-memory sum: raise where one of them will not come
        (it ended its run, or failed: then its own error, reported first, is the run's), or the run
        has stopped (a learner killed by a signal says nothing in the store)."""
        others = [k for k in range(self.world) if k != self.rank]
        failed = [k for k in others if self.store.check([f"fragflow.failed.{k}"])]
        if failed:
            time.sleep(0.5)
            raise RuntimeError(f"learner(s) {', '.join(map(str, failed))} failed while learner {self.rank} "
                               "waited for their gradients")
        ended = [k for k in others if self.store.check([f"fragflow.ended.{k}"])]
        if ended:
            raise self._ended(ended)
        if self.stop is not None and self.stop.is_set():
            from fragflow.backends import Stopped

            raise Stopped

    def watch(self, state: Any, name: str, states: dict[str, Any] | None = None) -> None:
        """Average what backward accumulates into the parameters of ``state`` (see _watchable; an
        optimizer the learner makes itself, each call, is in no state), also each state a learner
        writes (a module made anew, ``copy.deepcopy(net)``), letting go of those no state of ``states`` holds."""
        import torch

        from fragflow.compiler.pytree import leaf_paths

        if self.group_backend is None:
            tensors = [x for _, x in leaf_paths(state) if isinstance(x, torch.Tensor)]
            self._join({t.device for t in tensors})
        added = False
        for p in _watchable(state):
            if id(p) not in self.watched:
                self.watched.add(id(p))
                self.order[id(p)] = self.next_order
                self.next_order += 1
                self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
                self.params.append(p)
                added = True
        if added and states is not None:   # (a module made anew: the old one's parameters let go)
            held = {id(p) for s in states.values() for p in (*_watchable(s), *_parameters(s))}   # (frozen ones too)
            for p, h in [(p, h) for p, h in zip(self.params, self.handles) if id(p) not in held]:
                h.remove()
                self.watched.discard(id(p))
                del self.order[id(p)]
            self.params, self.handles = [p for p in self.params if id(p) in held], [h for p, h in zip(self.params, self.handles) if id(p) in held]

    def _accumulated(self, p: Any) -> None:
        """A parameter's gradient is accumulated: averaged, with the others of this backward pass, in
        one all-reduce when the pass ends (the order is the parameters', the same in every learner)."""
        if p.grad is None:
            return
        self.pending.append(p)
        if not self.queued:
            import torch

            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        self.queued = False
        pending, self.pending = sorted(self.pending, key=lambda q: self.order[id(q)]), []
        grads = [q.grad for q in pending]
        # which parameters: learners' gradients of as many values may be of different ones (a branch on the share)
        which = zlib.crc32(repr([self.order[id(q)] for q in pending]).encode()) % 251 ** 3
        flat = self._reduce([g.detach().reshape(-1) for g in grads], which=which)
        flat.div_(self.world)
        pos = 0
        for q, g in zip(pending, grads):
            mean = flat[pos:pos + g.numel()].view_as(g)
            if g.requires_grad:   # backward(create_graph=True): differentiated as this learner's own (see average)
                q.grad = mean + (g - g.detach())
            else:
                g.copy_(mean)
            pos += g.numel()
        self.averaged += 1

    def average(self, grads: tuple[Any, ...], inputs: Any = None) -> tuple[Any, ...]:
        """``torch.autograd.grad``'s result, averaged across the learners (one all-reduce). Taken
        with ``create_graph=True``, each average is differentiated as this learner's own gradient
        (the average's value, plus the gradient less itself): a term on it (a gradient penalty)
        gives each learner its share's part, which the learners' next average makes the whole
        batch's, as one learner differentiates it (differentiated through the average, divided by K,
        it was 1/K of that). A gradient with respect to a tensor the learner computed (one of
        ``inputs`` that is not a leaf: its outputs for the chain rule, ``a.backward(dl_da)``; a
        sample mixed with a generator's) is of this learner's own samples, and is its own, not
        averaged (averaged, sample i of one learner's share was mixed with sample i of another's);
        the parameters' gradient it leads to is averaged as any. Leaves (parameters, copies of them,
        a batch's ``x.requires_grad_()``) cannot be told apart, nor views of them (a flat parameter
        vector's pieces): their gradients are averaged."""
        import torch

        ins = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs) if isinstance(inputs, (list, tuple)) else []
        mine = [isinstance(x, torch.Tensor) and not x.is_leaf and (x._base is None or not x._base.is_leaf)
                for x in ins] if len(ins) == len(grads) else [False] * len(grads)
        present = [g for g, own in zip(grads, mine) if g is not None and not own]
        if not present:
            return grads
        flat = self._reduce([g.detach().reshape(-1) for g in present])
        flat.div_(self.world)
        out: list[Any] = []
        pos = 0
        for g, own in zip(grads, mine):
            if g is None or own:
                out.append(g)
                continue
            mean = flat[pos:pos + g.numel()].view_as(g)
            out.append(mean + (g - g.detach()) if g.requires_grad else mean)   # (the value is the average's, exactly)
            pos += g.numel()
        self.averaged += 1
        return tuple(out)

    @contextmanager
    def update(self, fragment: str, required: bool = True, where: Any = None, steps: int = -1,
               called_at: Any = None, given: tuple[tuple[str, int], ...] = ()) -> Iterator[Written]:
        """Around a call that writes the learners' state: the gradients it takes with
        ``torch.autograd.grad`` are averaged too. ``steps``: the env steps its loop replicas had made
        when they called it (-1: not the same in every learner by design); ``given``: (path, checksum)
        of the call's arguments without a batch axis, which every learner must be given alike (a value
        the loop computes over its replica's share differs). The caller puts the new state in the
        :class:`Written` it is given: the update's last all-reduce compares it, and learners whose new
        states differ (a value each computed from its own share: a running statistic, a coefficient
        adapted to its share's KL, a counter; a learner that computes no gradient, ``required``: the
        clock) are refused, naming the part that differs, rather than left to learn apart."""
        import torch

        original = torch.autograd.grad

        def grad(*args: Any, **kwargs: Any) -> Any:
            return self.average(original(*args, **kwargs), kwargs.get("inputs", args[1] if len(args) > 1 else None))

        self.averaged = 0
        key = learnerstate.key([c for _, c in given]) if given else 0   # (what _digits carries)
        self.call = _Call(fragment, zlib.crc32(fragment.encode()) & 0xFFFFFF, steps, where, called_at, given, key)
        torch.autograd.grad = grad
        written = Written()
        try:
            yield written
        finally:
            torch.autograd.grad = original
        self.learned = self.learned or self.averaged > 0
        whole = self.closes < 16 or self.closes % 16 == 0   # (the same updates in every learner)
        self.closes += 1
        sums = learnerstate.state_sums(written.state, written.name, whole)
        self.call = dataclasses.replace(self.call, state=tuple(sums), state_key=learnerstate.key([c for _, c in sums]),
                                        required=required)
        # every learner ends the update here, none still averaging, each with the state it made, in an
        # all-reduce of the size of the gradient another learner may be at instead (gloo needs the sizes alike):
        # this fragment's next gradient, as an earlier update of it took it (a backward pass into other
        # parameters, a critic's then an actor's), else its last gradient's; having averaged none in any update
        # of it, of the parameters it watches of the state written (another may be at its first gradient)
        sizes = self.sizes.setdefault(fragment, [])
        if self.averaged < len(sizes):
            numel, dtype, device = sizes[self.averaged]
        elif self.averaged:
            numel, dtype, device = self.last
        else:
            written_params = {id(p) for p in _parameters(written.state)} | {
                id(p) for _, opt in learnerstate.optimizers_at(written.state) for group in opt.param_groups
                for p in group["params"]}
            watched = [p for p in self.params if p.is_floating_point()]
            watched = [p for p in watched if id(p) in written_params] or watched
            numel = sum(int(p.numel()) for p in watched)
            dtype, device = (watched[0].dtype, watched[0].device) if watched else (torch.float32, self.device)
        self._reduce([torch.zeros(numel, dtype=dtype, device=device)], closing=True)
        self.call = None

    def _reduce(self, parts: list[Any], closing: bool = False, which: int = 0) -> Any:
        """``parts`` concatenated and all-reduced (summed), with a few numbers saying where this
        learner is (see :meth:`_agree`) in the same all-reduce: small integers and their squares,
        whose sums are equal across the learners, and exact in float32, where every learner's are
        the same (K * sum(x^2) == sum(x)^2). Where they differ, :meth:`_agree` says how. ``which``:
        a number for the parameters the gradient is of (0: not known)."""
        import torch

        numel = sum(int(p.numel()) for p in parts)
        dtype, device = parts[0].dtype, parts[0].device
        call = self.call
        if call is not None and not closing:   # (the update's gradients in order: see update)
            sizes = self.sizes.setdefault(call.fragment, [])
            if self.averaged >= len(sizes):
                sizes.append((numel, dtype, device))
        if call is None or dtype not in (torch.float32, torch.float64):   # (bfloat16 sums are not exact)
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            if self.shared is not None and call is not None:
                # where it is, summed in shared memory as an exact gradient's sum is: a learner at this one and
                # another at a float32 gradient meet at the same sum (their sizes differ), not each at its own
                digits = self._where_digits(numel, closing, which, torch.float64, "cpu")
                both = torch.cat([digits, digits * digits])
                self._summed(both, numel, closing, which)
                self._check_where(both, numel, closing, which)
            else:
                self._agree(numel, closing, which)   # (its own all-reduce: where it is the update's end, the only one)
            if not closing:
                self._summed(flat, numel, closing, which)
            self.last = (numel, dtype, device)
            return flat
        digits = self._where_digits(numel, closing, which, dtype, device)
        flat = torch.cat([*parts, digits, digits * digits])
        self._summed(flat, numel, closing, which)
        self._check_where(flat[numel:], numel, closing, which)
        self.last = (numel, dtype, device)
        return flat[:numel]

    def _where_digits(self, numel: int, closing: bool, which: int, dtype: Any, device: Any) -> Any:
        """Where this learner is, as the digits :meth:`_reduce` sums (see :func:`_digits`)."""
        import torch

        call = self.call
        assert call is not None
        return torch.tensor(_digits(call.key, call.steps + 1, int(closing), self.averaged, numel, call.given_key,
                                    which, call.state_key, len(call.state)), dtype=dtype, device=device)

    def _check_where(self, summed: Any, numel: int, closing: bool, which: int) -> None:
        """``summed``: the digits' sums, then their squares' sums; every learner got the same ones, and
        where they tell of learners at different places, each asks :meth:`_agree`, and refuses, alike."""
        import torch

        m = summed.numel() // 2
        sums, squares = summed[:m].double().cpu(), summed[m:].double().cpu()
        if not torch.equal(sums * sums, squares * self.world):
            self._agree(numel, closing, which)

    def _summed(self, flat: Any, numel: int, closing: bool, which: int = 0) -> None:
        """``flat`` all-reduced in place; where the learners' sizes differ (a shared-memory sum finds
        it before it sums), :meth:`_agree` says how."""
        from fragflow.backends.local.sharedsum import SizesDiffer

        try:
            self._all_reduce(flat)
        except SizesDiffer:
            self._agree(numel, closing, which)
            raise ConfigError("the learners all-reduced gradients of different sizes outside an update",
                              fix="compute gradients only inside the learner's update") from None

    def _agree(self, numel: int, closing: bool = False, which: int = 0) -> None:
        """Every learner must be at the same point of the same update (the same fragment, called by
        its loop replicas after as many env steps; the same gradient of it, of the same size and
        parameters), else
        the all-reduce would average, or wait for, what another learner never computes. Those
        numbers, all-reduced to their maximum and minimum, so that every learner sees any difference
        and each refuses the same way, saying what differs: where the sums :meth:`_reduce` carried
        differed, or before each all-reduce of gradients whose sums would not be exact."""
        import torch

        call = self.call
        if call is None:   # (a gradient outside any update: nothing to agree on)
            return
        mine = torch.tensor([call.key, call.steps, -1 if closing else self.averaged, numel, call.given_key, which,
                             call.state_key, len(call.state)], dtype=torch.float64, device=self.device)
        both = torch.cat([mine, -mine])
        self._all_reduce(both, op=self.dist.ReduceOp.MAX)
        high, low = both[:8].cpu(), -both[8:].cpu()
        if torch.equal(high, low):
            return
        if high[1] != low[1]:   # (the same message as a gathering policy's: the calls are not paired)
            raise ConfigError(
                f"'{call.fragment}' is called by the loop replicas after different numbers of env steps (from "
                f"{int(low[1])} to {int(high[1])} in the learners' replicas), and multi_learner averages each "
                "learner's gradients with the others' at the same call: the loop calls it under a condition on data "
                "of each replica's own environments (an episode that ended, a reward), which the replicas see "
                "differently", where=call.called_at,
                fix="call it on a schedule every replica shares (every N trips, once the buffer holds N steps counted "
                    "in trips), or run with one learner (learners=1) or a single-learner policy")
        if high[4] != low[4] and high[0] == low[0]:   # (the same call, given other values)
            sums = torch.tensor([c for _, c in call.given], dtype=torch.float64, device=self.device)
            apart = torch.cat([sums, -sums])
            self._all_reduce(apart, op=self.dist.ReduceOp.MAX)
            n = len(call.given)
            differ = [i for i in range(n) if apart[i].item() != -apart[n + i].item()]
            path = call.given[differ[0]][0] if differ else "an argument without a batch axis"
            raise ConfigError(
                f"{path} of '{call.fragment}' differs between the loop's replicas, each stepping its share of the "
                "environments, and has no batch axis: multi_learner gives each learner its own replicas' value, so "
                "the learners would learn from different values where one process learns from one (a statistic "
                "the loop computes over its own share of the batch?)", where=call.called_at,
                fix="compute it inside the learner from its batch, pass per-environment data through "
                    "ff.RolloutBuffer or ff.ReplayBuffer (which declare their batch axes), or run with one learner "
                    "(learners=1) or a single-learner policy")
        if high[2] != low[2]:   # (the points before agree: only an ended update differs from a gradient)
            n = int(high[2])
            what = f"one had averaged {n} gradient{'' if n == 1 else 's'} when another ended the update"
        elif high[3] != low[3]:
            what = f"at gradient {int(high[2]) + 1} one averaged {int(low[3]):,} values, another {int(high[3]):,}"
        elif high[5] != low[5] and high[0] == low[0]:   # (the same fragment: else its state differs)
            what = f"at gradient {int(high[2]) + 1} they averaged the gradients of different parameters"
        elif high[6] != low[6] and high[0] == low[0]:   # (the same update, ended alike: the states it made differ)
            raise self._states_apart(bool(high[7] == low[7]))
        else:
            what = "they were updating different state"
        raise ConfigError(
            f"the learners made different gradients in one update of '{call.fragment}' ({what}), and "
            "multi_learner averages each gradient with the others' at the same point of the update: every learner "
            "must make the same backward passes per update, whatever its share of the data (an early stop on a "
            "value of its own share, such as `if approx_kl > target_kl: break`, makes them differ)", where=call.where,
            fix="make the backward passes per update the same in every learner: decide an early stop on a value every "
                "learner holds alike, its mean over the learners (`if ff.learners() > 1: "
                "torch.distributed.all_reduce(kl); kl /= ff.learners()`, as ppo.py's target_kl "
                "does), or turn the stop off (a threshold of your Args it never reaches, or a switch), or run a "
                "single-learner policy (pipelined, actor_learner)")

    def _states_apart(self, alike: bool) -> ConfigError:
        """The learners ended an update alike but hold different new states: which parts differ (each
        learner's checksum of each part, all-reduced to their maximum and minimum, where the states
        have as many parts: ``alike``), and why that is refused (see learnerstate.apart)."""
        import torch

        call = self.call
        assert call is not None
        paths: list[str] = []
        if alike and (self.learned or not call.required):
            sums = torch.tensor([c for _, c in call.state], dtype=torch.float64, device=self.device)
            both = torch.cat([sums, -sums])
            self._all_reduce(both, op=self.dist.ReduceOp.MAX)
            n = len(call.state)
            paths = [call.state[i][0] for i in range(n) if both[i].item() != -both[n + i].item()]
        return learnerstate.apart(call.fragment, paths, call.where, learned=self.learned or not call.required)

    def _peers_out(self) -> tuple[list[int], list[int]]:
        """The other learners that left the group: having ended their run, and by an error of their own
        (each says which, as it closes; one it waits a second for)."""
        others = [k for k in range(self.world) if k != self.rank]
        deadline = time.monotonic() + 1.0
        while self.store is not None:
            ended = [k for k in others if self.store.check([f"fragflow.ended.{k}"])]
            failed = [k for k in others if self.store.check([f"fragflow.failed.{k}"])]
            if ended or failed or time.monotonic() > deadline:
                return ended, failed
            time.sleep(0.05)
        return [], []

    def report(self) -> None:
        """Leave where this learner's time went in the store, for the driver's summary (read by
        :func:`timings`): its updates' time, the user's calls in them, its all-reduces (the wait
        for the slowest learner included) and how they went, and its torch threads."""
        import json

        import torch

        if self.store is not None:
            self.store.set(f"fragflow.timing.{self.rank}",
                           json.dumps({**self.timing, "threads": torch.get_num_threads(),
                                       "via": " and ".join(sorted(self.ways)) or str(self.group_backend)}))
            self.store.check([f"fragflow.timing.{self.rank}"])   # (a round trip: the store has it before "final")

    def close(self, ended: bool = True) -> None:
        """Leave the group; ``ended``: this learner's run ended as the loop did, else it failed: a
        learner still updating reads which to say why its all-reduce failed."""
        if self.store is not None:   # (before the group goes)
            self.store.set(f"fragflow.{'ended' if ended else 'failed'}.{self.rank}", "1")
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def _watchable(state: Any) -> list[Any]:
    """The tensors whose gradients the learners average: the parameters of ``state``'s optimizers,
    modules and bare tensors that take gradients, in the state's order."""
    import torch

    owned = [p for _, opt in learnerstate.optimizers_at(state) for group in opt.param_groups for p in group["params"]]
    return [p for p in [*owned, *_parameters(state)] if isinstance(p, torch.Tensor) and p.requires_grad]


def _parameters(tree: Any) -> Any:
    """The parameters of the modules in ``tree`` and its tensors that take gradients (a bare
    ``nn.Parameter``, an entropy coefficient's log)."""
    import torch

    if isinstance(tree, torch.nn.Module):
        yield from tree.parameters()
    elif isinstance(tree, torch.Tensor):
        if tree.requires_grad and tree.is_leaf:
            yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _parameters(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _parameters(v)


def host(world: int, address: str = "127.0.0.1") -> tuple[Any, tuple[str, int]]:
    """The driver's side: a TCP store the ``world`` learners meet at; ``(store, (address, port))``."""
    import torch.distributed as dist

    store = dist.TCPStore(address, 0, world + 1, is_master=True, wait_for_workers=False)
    return store, (address, store.port)


def timings(store: Any, world: int) -> list[dict[str, Any]]:
    """The driver's side of :meth:`GradientAllReduce.report`: each learner's time, in seconds (the
    learners that have reported)."""
    import json

    out = []
    for k in range(world):
        if store.check([f"fragflow.timing.{k}"]):
            t = json.loads(store.get(f"fragflow.timing.{k}").decode())
            out.append({"learner": k, "updates": t["updates"], "busy_s": t["busy_ns"] / 1e9,
                        "call_s": t["call_ns"] / 1e9, "sync_s": t["sync_ns"] / 1e9,
                        "all_reduces": t["all_reduces"], "threads": t["threads"], "via": t["via"]})
    return out


def _digits(*values: int) -> list[int]:
    """Each value as three digits in base 251: K learners' sums of them and of their squares stay
    under 2**24, exact in float32, up to 267 learners."""
    return [(v // 251 ** k) % 251 for v in values for k in range(3)]


@dataclass(frozen=True)
class _Call:
    """An update in progress, as the learners compare it: its fragment (and a number for it), the
    env steps its loop replicas had made when they called it, where it is defined and called."""

    fragment: str
    key: int
    steps: int
    where: Any
    called_at: Any
    given: tuple[tuple[str, int], ...] = ()   # (path, checksum) of its arguments without a batch axis
    given_key: int = 0                        # one checksum of them all
    state: tuple[tuple[str, int], ...] = ()   # (path, checksum) of each part of the new state, as the update ends
    state_key: int = 0                        # one checksum of them all
    required: bool = True                     # the clock's update (which must learn)


class Written:
    """What an update (:meth:`GradientAllReduce.update`) wrote: the new state, and its name."""

    def __init__(self) -> None:
        self.state: Any = None
        self.name = ""
