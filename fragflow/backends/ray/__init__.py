"""The Ray backend: every group replica a Ray actor, the channels in one hub actor per run.

``fragflow run ... --backend ray [--address ADDR]`` runs the same lowered program as the local
backend: the driver stays where the command runs; each service group and each loop replica is a
Ray actor (scheduled ``SPREAD`` over the cluster's nodes) that receives a small spec (its role,
index and a reference to the program in Ray's object store) and runs the same worker entry point
as a local process. Rings, broadcasts, admission and the queues are the methods of
:class:`~.hub.Hub`; numpy arrays travel through Ray's object store. Versions, tags, tickets,
staleness bounds, disciplines and channel metrics are the local backend's, so ``max_lag=0``
reproduces ``single_process`` here too.

Without ``--address`` (and no ``RAY_ADDRESS``) a local Ray instance of the run's own is started
(never a cluster ``ray start`` runs or left behind on the machine), dashboard off. Every actor the
run started is killed when it ends.

What Ray costs: each channel operation is a remote call (about a millisecond on a small machine,
against a few microseconds in shared memory), so a program that crosses processes at every env
step pays for it; one that crosses once per update (``actor_learner``) pays little. See the README
for the measured figures.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fragflow.backends import Stopped, WorkerDied
from fragflow.backends.local.shm import Layout
from fragflow.compiler.pytree import from_numpy, to_numpy
from fragflow.errors import ConfigError

from .hub import CLOSED, STOPPED, Hub

__all__ = ["BACKEND", "RayBackend"]


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

    def __init__(self, hub: Any, name: str, layout: Layout) -> None:
        self.hub, self.name, self.layout = hub, name, layout
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


class RayStop:
    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self._set = False

    def set(self) -> None:
        self._set = True
        try:
            _ray().get(self.hub.stop.remote(), timeout=10)
        except Exception:   # the hub is gone: nothing is left to stop
            pass

    def is_set(self) -> bool:
        if self._set:
            return True
        self._set = bool(_ray().get(self.hub.is_stopped.remote()))
        return self._set


@dataclass
class RayWiring:
    """What a worker needs to reach the run's hub (picklable: an actor handle and the layouts)."""

    hub: Any
    rings: dict[str, Layout]
    broadcasts: dict[str, Layout]
    groups: list[str]
    watch_parent: bool = False       # Ray ends a run's actors itself when the driver goes
    actors: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.results = RayQueue(self.hub, "results")
        self.stop = RayStop(self.hub)

    def __getstate__(self) -> dict[str, Any]:
        return {"hub": self.hub, "rings": self.rings, "broadcasts": self.broadcasts, "groups": self.groups}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.watch_parent = False
        self.actors = []
        self.__post_init__()

    def attach(self) -> RayEndpoints:
        return RayEndpoints(self)

    def release(self) -> None:
        ray = _ray()
        for actor in [*self.actors, self.hub]:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors.clear()


class RayEndpoints:
    def __init__(self, wiring: RayWiring) -> None:
        hub = wiring.hub
        self.wiring = wiring
        self.stop = wiring.stop
        self.results = wiring.results
        self.rings: dict[str, Any] = {n: RayRing(hub, n, layout) for n, layout in wiring.rings.items()}
        self.broadcasts: dict[str, Any] = {n: RayBroadcast(hub, n, layout) for n, layout in wiring.broadcasts.items()}
        self.admission = RayAdmission(hub)
        self._defs = {g: RayQueue(hub, f"definitions:{g}") for g in wiring.groups}

    def definitions(self, group: str) -> Any:
        return self._defs[group]

    def wait_any(self, group: str, timeout: float) -> None:
        _get(self.wiring.hub.wait_any.remote(group, timeout))

    def detach(self) -> None:
        for b in self.broadcasts.values():
            b.detach()


class RayProcess:
    """A worker actor seen as a process: ``exitcode``, ``join``, ``is_alive``, ``terminate``, ``kill``, ``pid``."""

    def __init__(self, actor: Any, ref: Any, name: str) -> None:
        self.actor, self.ref, self.name = actor, ref, name
        self._code: int | None = None
        self._pid: int | None = None
        self.failure: str | None = None   # what it raised before it could report (a module its program needs)

    @property
    def exitcode(self) -> int | None:
        if self._code is None:
            ray = _ray()
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self._code = int(ray.get(self.ref))
                except ray.exceptions.RayTaskError as exc:   # it raised: its process is alive, its run is not
                    cause = getattr(exc, "cause", None)
                    self.failure = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else \
                        str(exc).strip().splitlines()[-1]
                    self._code = 1
                except Exception:   # the actor died (killed, or crashed in native code)
                    self._code = -signal.SIGKILL
        return self._code

    def join(self, timeout: float | None = None) -> None:
        _ray().wait([self.ref], timeout=timeout)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        try:
            _ray().kill(self.actor)
        except Exception:
            pass

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = int(_ray().get(self.actor.pid.remote(), timeout=30))
        return self._pid


class _Worker:
    """The Ray actor that runs one group replica: the worker entry point, with its exit code returned."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, target: Any, args: tuple[Any, ...], folders: tuple[str, ...] = ()) -> int:
        for folder in reversed(folders):   # the algorithm file's folder: its sibling modules import here too
            if folder not in sys.path:
                sys.path.insert(0, folder)
        ray = _ray()
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        try:
            target(*args)
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else 1
        return 0


def connect(address: str | None = None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local instance of the run's own."""
    ray = _ray()
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    # Ray's core worker puts a native handler of its own on SIGTERM (it aborts the process): the
    # run's handler, which stops the workers and writes summary.json, is put back after it
    main = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main else None
    if address:
        reachable(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:   # ("local": never a cluster `ray start` left on this machine, live or stale)
            # (_node_ip_address: Ray 2.60 still names the node after the machine's address)
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        token = "" if "RAY_AUTH_MODE" in os.environ else (
            "; a cluster whose `ray start` said \"Token authentication is enabled\" also needs RAY_AUTH_MODE=token "
            "in this shell")
        raise ConfigError(f"cannot join a Ray cluster at {address}: {text}" if address else
                          f"cannot start a local Ray instance: {text}",
                          fix=f"give the address `ray start --head` printed (host:port){token}" if address else
                              "run with --backend local") from None
    finally:
        if main and term is not None:
            signal.signal(signal.SIGTERM, term)


def reachable(address: str, timeout: float = 10.0) -> None:
    """A cluster address must name a Ray cluster that answers (Ray's own connection retries for
    minutes, in silence): ``host:port`` of its head (or ``ray://host:port``), or ``auto``, the
    cluster ``ray start`` runs on this machine."""
    fix = "give the address `ray start --head` printed (host:port, e.g. 10.0.0.5:6379)"
    if address == "local" or ("://" in address and not address.startswith("ray://")):
        return   # (a new local instance; another scheme's address is Ray's, or its plugin's, to resolve)
    if address == "auto":
        found = _current_cluster()
        if found is None:
            raise ConfigError("--address auto: no Ray cluster was started on this machine",
                              fix="start one with `ray start --head`, or leave --address out: the run then "
                                  "starts a Ray instance of its own")
        address = found
    plain = address.split("://", 1)[1] if "://" in address else address
    host, colon, port = plain.rpartition(":")
    if not colon or not host:
        raise ConfigError(f"--address {address}: no port", fix=fix)
    if not port.isdigit():
        raise ConfigError(f"--address {address}: the port is not a number", fix=fix)
    import socket

    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            # Ray's control store (GCS) speaks gRPC: HTTP/2 answers its preface with a SETTINGS frame
            # (another server on the port, an HTTP/1 one, does not; Ray would retry it for minutes)
            answer = b"" if "://" in address or os.environ.get("RAY_USE_TLS") else _http2_answer(conn, timeout)
    except OSError as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {address}: {exc}",
                          fix="start one with `ray start --head` and pass its address (ray start prints it)") from None
    if answer and not (len(answer) >= 4 and answer[3] == 0x04):
        raise ConfigError(f"{address} answers, but not as a Ray cluster's head (its GCS port)", fix=fix)


def _http2_answer(conn: Any, timeout: float) -> bytes:
    """The first frame header a server sends after HTTP/2's client preface and an empty SETTINGS."""
    conn.settimeout(min(timeout, 5.0))
    conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    try:
        return conn.recv(9) or b"\x00"   # (closed at once: not HTTP/2)
    except TimeoutError:
        return b"\x00"


def _current_cluster() -> str | None:
    """The address of the cluster `ray start` runs on this machine, as Ray finds it for ``auto``
    (its address file, else a running control store), or None."""
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:   # (Ray's own lookup moved: its address file, where Ray writes it by default)
        import tempfile
        from pathlib import Path

        try:
            text = (Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" /
                    "ray_current_cluster").read_text().strip()
        except OSError:
            return None
        return text or None
    try:
        return str(canonicalize_bootstrap_address_or_die("auto"))
    except ConnectionError:
        return None


_SERIAL = itertools.count()


class RayBackend:
    name = "ray"
    shares_files = False   # actors may run on other machines: checkpoint parts travel through the hub

    def __init__(self) -> None:
        self.address: str | None = None
        self._program: tuple[bytes, Any] | None = None   # the program, put in the object store once

    def rendezvous_host(self) -> str:
        """The address replicated learners reach the driver's TCP store at: this node's."""
        connect(self.address)
        return str(_ray().util.get_node_ip_address())

    def wire(self, lowered: Any) -> RayWiring:
        ray = _ray()
        connect(self.address)
        rings: dict[str, tuple[int, str | None]] = {}
        layouts: dict[str, Layout] = {}
        broadcasts: dict[str, int] = {}
        blayouts: dict[str, Layout] = {}
        clock_rings: list[str] = []
        clock_state: str | None = None
        for service in lowered.services:
            for ring in service.rings:
                rings[ring.name] = (ring.capacity, service.group)
                layouts[ring.name] = Layout.of(list(ring.specs))
                if ring.fragment == service.clock:
                    clock_rings.append(ring.name)
            for ring in service.replies:
                rings[ring.name] = (ring.capacity, None)
                layouts[ring.name] = Layout.of(list(ring.specs))
            for b in service.publish:
                broadcasts[b.state] = b.depth
                blayouts[b.state] = Layout.of(list(b.specs))
                clock_state = clock_state or b.state
        groups = [s.group for s in lowered.services]
        queues = ["results", *(f"definitions:{g}" for g in groups)]
        hub_cls = ray.remote(num_cpus=0, max_concurrency=1000)(Hub)
        hub = hub_cls.remote(rings, broadcasts, clock_rings, clock_state, queues, lowered.loop.replicas)
        wiring = RayWiring(hub, layouts, blayouts, groups)
        wiring.watch_parent = False
        return wiring

    def start(self, target: Any, args: tuple[Any, ...], name: str) -> RayProcess:
        ray = _ray()
        # two threads: run() holds one for the whole run, pid() may be asked meanwhile
        worker_cls = ray.remote(num_cpus=0, scheduling_strategy="SPREAD", max_restarts=0, max_concurrency=2)(_Worker)
        # named (``fragflow-actor-1.<run>``) so `ray list actors` and the tests can tell them apart
        actor = worker_cls.options(name=f"{name}.{os.getpid()}.{next(_SERIAL)}").remote()
        # (role, index, parent, program, wiring, ...): the program goes by reference, put once
        blob = args[3]
        if isinstance(blob, bytes):
            if self._program is None or self._program[0] is not blob:
                self._program = (blob, ray.put(blob))
            args = (*args[:3], self._program[1], *args[4:])
        from fragflow.program import USER_FOLDERS

        ref = actor.run.remote(target, args, tuple(USER_FOLDERS))
        wiring_arg = next((a for a in args if isinstance(a, RayWiring)), None)
        if wiring_arg is not None:
            wiring_arg.actors.append(actor)
        return RayProcess(actor, ref, name)


BACKEND = RayBackend()
