"""The learning side of a distributed policy: a service loop over the trajectory channels.

Each update gathers one batch (one piece per actor: in actor order, or as they arrive), checks
every piece's version against ``max_lag``, calls the learner fragment, publishes the new version of
the state the actors read, and reports the scalars that reach ``ff.log``.
"""

from __future__ import annotations

import time
from typing import Any

import cloudpickle
import numpy as np

from fragflow.placement import Overflow
from fragflow.pytree import flatten, to_numpy, unflatten
from fragflow.runtime.channels import ChannelClosed, ParamChannel, Stopped, TrajectoryChannel, _acquire
from fragflow.runtime.control import LEARN_NS, UPDATES, WAIT_NS, Control
from fragflow.runtime.monitor import flat_scalars
from fragflow.runtime.plan import RunPlan


class Learner:
    def __init__(self, plan: RunPlan, trajs: list[TrajectoryChannel], params: ParamChannel | None,
                 control: Control, results: Any, init: Any, stop: Any) -> None:
        self.plan, self.trajs, self.params = plan, trajs, params
        self.control, self.results, self.init, self.stop = control, results, init, stop
        self.version = 0
        self.current = plan.learner
        self._ready = trajs[0].h.ready

    def _receive(self, kind: str) -> Any:
        while True:
            try:
                tag, blob = self.init.get(timeout=0.05)
            except Exception:
                if self.stop.is_set():
                    raise Stopped from None
                continue
            if tag == kind:
                return cloudpickle.loads(blob)

    def publish(self, state: Any) -> None:
        if self.params is None:
            return
        leaves: list[Any] = []
        for path in self.plan.read_paths:
            sub = state
            for k in path:
                sub = sub[k]
            leaves.extend(flatten(sub)[0])
        self.params.publish(leaves, self.version)

    # -- gathering a batch -----------------------------------------------------------------
    def gather(self) -> list[tuple[TrajectoryChannel, int, list[Any]]] | None:
        if self.plan.trajectory == "ordered":
            pieces = []
            for ch in self.trajs:
                try:
                    item = ch.get()
                except ChannelClosed:
                    return None
                assert item is not None
                pieces.append((ch, item[0], item[1]))
            return pieces
        return self._gather_arrival()

    def _gather_arrival(self) -> list[tuple[TrajectoryChannel, int, list[Any]]] | None:
        pieces: list[tuple[TrajectoryChannel, int, list[Any]]] = []
        while len(pieces) < self.plan.actors:
            # the oldest piece first: it is the one closest to going stale
            heads = [(v, i) for i, ch in enumerate(self.trajs) if (v := ch.peek_version()) is not None]
            if heads:
                ch = self.trajs[min(heads)[1]]
                item = ch.try_get()
                if item is None:
                    continue
                lag = self.version - item[0]
                if lag > self.plan.max_lag and self.plan.overflow is Overflow.DROP:
                    ch.release(dropped=True)
                else:
                    pieces.append((ch, item[0], item[1]))
                continue
            if all(ch.closed and ch.available == 0 for ch in self.trajs):
                for ch, _, _ in pieces:
                    ch.release(dropped=True)
                return None
            _acquire(self._ready, self.stop, 0.05)
        return pieces

    def assemble(self, pieces: list[tuple[TrajectoryChannel, int, list[Any]]]) -> list[Any]:
        if len(pieces) == 1:
            return pieces[0][2]
        out = []
        for j, (axis, spec) in enumerate(zip(self.plan.env_axes, self.plan.piece_specs)):
            if axis is None:
                out.append(pieces[0][2][j])
                continue
            joined = np.concatenate([to_numpy(p[2][j]) for p in pieces], axis=axis)
            if spec.backend == "torch":
                import torch

                out.append(torch.from_numpy(joined))
            else:
                out.append(joined)
        return out

    # -- the service loop ----------------------------------------------------------------------
    def run(self) -> None:
        state = self._receive("state")
        _, _, learn = cloudpickle.loads(self.plan.program)
        self.publish(state)
        treedef = None
        words = self.control.words
        while True:
            t0 = time.perf_counter_ns()
            pieces = self.gather()
            t1 = time.perf_counter_ns()
            words[WAIT_NS] += t1 - t0
            if pieces is None:
                break
            if treedef is None:
                treedef = self._receive("treedef")
            self.control.set_busy(True)
            payload = unflatten(treedef, self.assemble(pieces))
            out = learn.fn(**{self.plan.writes: state}, **payload)
            state = out[0]
            self.version += 1
            self.publish(state)
            self.control.set_busy(False)
            for ch, v, _ in pieces:
                ch.release(lag=self.version - 1 - v)
            words[LEARN_NS] += time.perf_counter_ns() - t1
            words[UPDATES] += 1
            logged: dict[str, float] = {}
            for i in self.plan.log_outputs:
                logged.update(flat_scalars(out[i]))
            self.results.put(("update", self.version, logged))
        self.results.put(("final", cloudpickle.dumps(state)))
