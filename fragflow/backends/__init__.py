"""Backends: what the runtime needs to move calls, versions and reports between processes.

The runtime (the loop interpreter, the service runner, the driver) speaks to these interfaces
only; a backend is one folder that implements them and registers under a name, as distribution
policies do. ``local`` (processes on this machine, shared memory) is the default.

=============  ======================================================================================
Ring           one producer's calls of one remote fragment: ``put(leaves, version, tag=, aux=)`` on
               the producer side; ``peek() -> (version, tag, aux)``, ``take()``, ``release(lag, dropped)``
               on the consumer side; version-stamped, bounded, zero-copy where it can be
Broadcast      a versioned latest-value store of one state's views: ``publish(leaves, version)``,
               ``read(version)``, ``wait_for(version)``, ``latest``; readers never block the writer
Admission      the balance controller: ``admit(replica, max_lag) -> version``, ``produced()``,
               ``set_busy(flag)``, the learner's wait/busy counters, and the run's checkpoint request
               (``request_checkpoint(seq, at)`` in the driver, ``checkpoint_request()`` everywhere,
               ``checkpoint_at()``: the loop's update count from which it is cut, 0 at once;
               ``cut_trip(seq, trip)``: the trip every loop replica saves its part at)
Endpoints      what one process holds: rings, broadcasts, admission, the report queue, the queue
               of definitions (fragments, call structures, initial states), the stop event
Backend        ``wire(lowered) -> Wiring`` (creates everything, in the driver), ``start(target, args,
               name) -> process``; ``Wiring.attach() -> Endpoints`` in a worker; ``Wiring.release()``
=============  ======================================================================================

A new backend touches only its own folder and :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from fragflow.errors import ConfigError, did_you_mean

BACKENDS = {"local": "fragflow.backends.local", "ray": "fragflow.backends.ray"}


class Stopped(Exception):
    """The run is stopping (its stop event was set while a process waited)."""


class WorkerDied(Exception):
    """A worker process ended without a word (killed, or crashed in native code), or the process
    holding the run's channels did."""


class Ring(Protocol):
    def put(self, leaves: list[Any], version: int, timeout: float | None = None, tag: int = 0, aux: int = 0,
            order: int = 0) -> bool: ...
    def close(self) -> None: ...
    def peek(self) -> tuple[int, int, int, int] | None: ...
    def try_get(self) -> tuple[int, list[Any]] | None: ...
    def get(self, timeout: float | None = None) -> tuple[int, list[Any]] | None: ...
    def release(self, lag: int | None = None, dropped: bool = False) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def available(self) -> int: ...
    @property
    def queued(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...


class Broadcast(Protocol):
    def publish(self, leaves: list[Any], version: int, stamp: int = 0) -> None: ...
    def read(self, version: int | None = None, stamp: int | None = None) -> tuple[int, list[Any]]: ...
    def wait_for(self, version: int, timeout: float | None = None) -> int: ...
    @property
    def latest(self) -> int: ...


class Admission(Protocol):
    last_ticket: int

    def admit(self, replica: int, max_lag: int) -> int: ...
    def produced(self, replica: int = 0) -> None: ...
    def forget(self, replica: int) -> None: ...
    def set_busy(self, busy: bool) -> None: ...
    def add_wait(self, ns: int) -> None: ...
    def add_busy(self, ns: int) -> None: ...
    def counters(self) -> dict[str, float]: ...
    def request_checkpoint(self, seq: int, at: int = 0) -> None: ...
    def checkpoint_request(self) -> int: ...
    def checkpoint_at(self) -> int: ...
    def at_trip(self, replica: int, trip: int) -> None: ...
    def cut_trip(self, seq: int, trip: int) -> int: ...
    def request_seq(self, request: int, seq: int) -> int: ...
    def waiting(self, replica: int, version: int) -> None: ...
    def waiting_for(self, replica: int) -> int: ...
    def release_waits(self) -> None: ...
    def waits_released(self) -> bool: ...


class Endpoints(Protocol):
    rings: dict[str, Ring]
    broadcasts: dict[str, Broadcast]
    admission: Admission
    results: Any
    stop: Any

    def definitions(self, group: str) -> Any: ...
    def wait_any(self, group: str, timeout: float) -> None: ...
    def detach(self) -> None: ...


class Wiring(Protocol):
    def attach(self) -> Endpoints: ...
    def release(self) -> None: ...


class Backend(Protocol):
    name: str

    def wire(self, lowered: Any) -> Wiring: ...
    def start(self, target: Any, args: tuple[Any, ...], name: str) -> Any: ...


def get(name: str, address: str | None = None) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}", fix=did_you_mean(name, BACKENDS))
    module = importlib.import_module(BACKENDS[name])
    available = getattr(module, "available", None)
    if available is not None:   # (what the backend needs, Ray, missing: refused before anything runs)
        available()
    backend: Backend = module.BACKEND
    if hasattr(backend, "address"):   # (this run's: not an earlier run's in this process)
        backend.address = address
    elif address is not None:
        raise ConfigError(f"backend {name!r} takes no address", fix="--address is for --backend ray")
    return backend
