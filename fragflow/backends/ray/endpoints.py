"""The Ray backend's channel endpoints: a ring, a broadcast, the admission counters and a queue, each
a handle on the run's hub actor (:class:`~.hub.Hub`) whose operations are its remote methods; numpy
arrays travel through Ray's object store."""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np

from fragflow.backends import Stopped, WorkerDied
from fragflow.backends.local.shm import Layout
from fragflow.compiler.pytree import from_numpy, to_numpy
from fragflow.errors import ConfigError

from .hub import CLOSED, STOPPED


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray backend needs Ray, which is not installed",
                          fix='pip install "fragflow[ray]" (or pip install ray)') from None
    return ray


def _get(ref: Any) -> Any:
    ray = _ray()
    try:
        out = ray.get(ref)
    except ray.exceptions.RayActorError as exc:   # (the hub: every channel of the run was in it)
        raise WorkerDied(f"the run's channel hub (a Ray actor) died: {str(exc).splitlines()[0]}") from None
    if isinstance(out, str) and out == STOPPED:
        raise Stopped
    return out


class ChannelClosed(Exception):
    """The producer closed the channel and every item has been consumed."""


def _pack(layout: Layout, leaves: list[Any]) -> list[Any]:
    out: list[Any] = []
    for leaf, spec, dtype in zip(leaves, layout.specs, layout.dtypes):
        if spec.backend == "python":
            out.append(leaf)
        else:
            arr = np.asarray(to_numpy(leaf))
            if arr.dtype != dtype or arr.shape != tuple(spec.shape):
                raise ValueError(f"leaf {spec.short()} got {arr.dtype}{list(arr.shape)}")
            out.append(arr)
    return out


def _unpack(layout: Layout, items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item, spec in zip(items, layout.specs):
        if spec.backend == "python":
            out.append(item)
        else:   # a writable copy (object-store arrays are read-only)
            out.append(from_numpy(np.array(item), spec.backend, spec.device))
    return out


class RayRing:
    """A ring of the hub, seen from one process (implements ``backends.Ring``)."""

    def __init__(self, hub: Any, name: str, layout: Layout, capacity: int | None = None) -> None:
        self.hub, self.name, self.layout = hub, name, layout
        if capacity is not None:   # (its slots, taken pieces included: the gathering's hold asks it)
            self.capacity = capacity
        self.nbytes = layout.nbytes
        self.epoch: int | None = None   # this producer's incarnation (asked at its first put)
        self._peeked: tuple[bool, int, int, int] | None = None

    def put(self, leaves: list[Any], version: int, timeout: float | None = None, tag: int = 0, aux: int = 0,
            order: int = 0, steps: int = 0) -> bool:
        if self.epoch is None:
            self.epoch = int(_get(self.hub.epoch_of.remote(self.name)))
        return bool(_get(self.hub.put.remote(self.name, _pack(self.layout, leaves), version, tag, aux, order,
                                             self.nbytes, timeout, self.epoch, steps)))

    def close(self) -> None:
        _get(self.hub.close.remote(self.name))

    def peek(self) -> tuple[int, int, int, int, int] | None:
        out, state = _get(self.hub.peek.remote(self.name))
        if out is not None:
            self._peeked = None
            return (int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4]))
        self._peeked = (bool(state[0]), int(state[1]), int(state[2]), int(state[3]))
        return None

    def try_get(self) -> tuple[int, list[Any]] | None:
        self._peeked = None
        out = _get(self.hub.try_get.remote(self.name))
        return None if out is None else (int(out[0]), _unpack(self.layout, out[1]))

    def get(self, timeout: float | None = None) -> tuple[int, list[Any]] | None:
        self._peeked = None
        out = _get(self.hub.get.remote(self.name, timeout))
        if isinstance(out, str) and out == CLOSED:
            raise ChannelClosed(self.name)
        return None if out is None else (int(out[0]), _unpack(self.layout, out[1]))

    def release(self, lag: int | None = None, dropped: bool = False) -> None:
        self._peeked = None
        _get(self.hub.release.remote(self.name, lag, dropped))

    def _state(self) -> tuple[bool, int, int, int]:
        """(closed, available, depth, puts). After a ``peek`` that found nothing, the state it brought
        serves until this process takes from the ring again (the service asks whether an empty ring is
        closed and drained: one remote call, not three; a closed ring gets no more items)."""
        if self._peeked is not None:
            return self._peeked
        state = _get(self.hub.ring_state.remote(self.name))
        return (bool(state[0]), int(state[1]), int(state[2]), int(state[3]))

    @property
    def closed(self) -> bool:
        return self._state()[0]

    @property
    def available(self) -> int:
        return self._state()[1]

    @property
    def queued(self) -> int:
        return self._state()[1]

    @property
    def depth(self) -> int:
        return self._state()[2]

    @property
    def puts(self) -> int:
        return self._state()[3]

    def stats(self) -> dict[str, Any]:
        return dict(_get(self.hub.stats.remote([self.name]))[0])

    def repair_producer(self) -> None:
        """The producer died: a put is one call of the hub, queued whole or not at all, but one may
        still be in flight (or waiting for space); fencing the ring discards it."""
        _get(self.hub.fence.remote(self.name))

    def detach(self) -> None:
        pass


class RayBroadcast:
    """A versioned broadcast of the hub (implements ``backends.Broadcast``); reads are cached."""

    def __init__(self, hub: Any, name: str, layout: Layout) -> None:
        self.hub, self.name, self.layout = hub, name, layout
        self._cache: tuple[int, list[Any]] | None = None
        self._stamp = -1

    def publish(self, leaves: list[Any], version: int, stamp: int = 0) -> None:
        _get(self.hub.publish.remote(self.name, _pack(self.layout, leaves), version, stamp))

    def read(self, version: int | None = None, stamp: int | None = None) -> tuple[int, list[Any]]:
        if (self._cache is not None and version is not None and self._cache[0] == version
                and (stamp is None or self._stamp >= stamp)):
            return self._cache
        out = _get(self.hub.read.remote(self.name, version, stamp))
        if out[0] == "overwritten":
            raise LookupError(f"version {version} was overwritten (ring depth {out[1]})")
        v, items, got = out
        self._cache, self._stamp = (int(v), _unpack(self.layout, items)), int(got)
        return self._cache

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        out = _get(self.hub.wait_for.remote(self.name, version, timeout))
        if out is None:
            raise TimeoutError(f"parameter version {version} not published in {timeout}s")
        return int(out)

    @property
    def latest(self) -> int:
        return int(_get(self.hub.latest_of.remote(self.name)))

    def detach(self) -> None:
        self._cache = None


class RayAdmission:
    """The balance controller and counters, in the hub (implements ``backends.Admission``)."""

    POLL = 0.05   # the checkpoint request is asked at most this often (it is asked at every loop trip)

    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self.last_ticket = 0
        self._request = (0.0, 0, 0)

    def admit(self, replica: int, max_lag: int) -> int:
        version, self.last_ticket = _get(self.hub.admit.remote(replica, max_lag))
        return int(version)

    def produced(self, replica: int = 0) -> None:
        _get(self.hub.produced.remote(replica))

    def forget(self, replica: int) -> None:
        _get(self.hub.forget.remote(replica))

    def set_busy(self, busy: bool) -> None:
        _get(self.hub.set_busy.remote(busy))

    def add_wait(self, ns: int) -> None:
        self.hub.add_wait.remote(ns)

    def add_busy(self, ns: int) -> None:
        self.hub.add_busy.remote(ns)

    def counters(self) -> dict[str, float]:
        return dict(_get(self.hub.counters.remote()))

    def request_checkpoint(self, seq: int, at: int = 0) -> None:
        _get(self.hub.request_checkpoint.remote(seq, at))

    def checkpoint_request(self) -> int:
        now = time.monotonic()
        if now - self._request[0] >= self.POLL:
            seq, at = _get(self.hub.checkpoint_request.remote())
            self._request = (now, int(seq), int(at))
        return self._request[1]

    def checkpoint_at(self) -> int:
        return self._request[2]   # (of the request checkpoint_request last read)

    def at_trip(self, replica: int, trip: int) -> None:
        pass   # a remote call every trip costs too much: the hub names the trip after the asking replica's
        # (a replica already past it saves at its own, and the driver then gives that checkpoint up)

    def cut_trip(self, seq: int, trip: int) -> int:
        return int(_get(self.hub.cut_trip.remote(seq, trip)))

    def request_seq(self, request: int, seq: int) -> int:
        return int(_get(self.hub.request_seq.remote(request, seq)))

    def waiting(self, replica: int, version: int) -> None:
        _get(self.hub.waiting.remote(replica, version))

    def waiting_for(self, replica: int) -> int:
        return int(_get(self.hub.waiting_for.remote(replica)))

    def producing(self, replica: int) -> int:
        return int(_get(self.hub.producing.remote(replica)))

    def release_waits(self) -> None:
        _get(self.hub.release_waits.remote())

    def waits_released(self) -> bool:
        return bool(_get(self.hub.waits_released.remote()))


class RayQueue:
    """A queue of the hub (reports, definitions): ``put``, ``get(timeout)``, ``get_nowait``."""

    def __init__(self, hub: Any, name: str) -> None:
        self.hub, self.name = hub, name

    def put(self, obj: Any) -> None:
        _get(self.hub.qput.remote(self.name, obj))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        ok, obj = _get(self.hub.qget.remote(self.name, timeout if block else 0.0))
        if not ok:
            raise queue.Empty
        return obj

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def close(self) -> None:
        pass

    def cancel_join_thread(self) -> None:
        pass
