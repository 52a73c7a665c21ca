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
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from fragflow.backends.local.shm import Layout
from fragflow.errors import ConfigError

from .endpoints import RayAdmission, RayBroadcast, RayQueue, RayRing, _get, _ray
from .hub import Hub

__all__ = ["BACKEND", "RayBackend", "available"]


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
    capacities: dict[str, int] = field(default_factory=dict)   # each ring's slots (taken pieces hold theirs)

    def __post_init__(self) -> None:
        self.results = RayQueue(self.hub, "results")
        self.stop = RayStop(self.hub)

    def __getstate__(self) -> dict[str, Any]:
        return {"hub": self.hub, "rings": self.rings, "broadcasts": self.broadcasts, "groups": self.groups,
                "capacities": self.capacities}

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
        self.rings: dict[str, Any] = {n: RayRing(hub, n, layout, wiring.capacities.get(n))
                                      for n, layout in wiring.rings.items()}
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
        self.died: str | None = None      # how it ended, where Ray cannot tell (see ``exitcode``)

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
                except Exception:   # the actor died: Ray says so, not how (a signal, a crash, os._exit)
                    self._code = -signal.SIGKILL   # (counted as a death by signal: a peer's failure follows from it)
                    self.died = "died (its Ray actor: killed, crashed or exited; Ray does not say which)"
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


def available() -> None:
    """Ray is importable, else the ConfigError that says how to install it (asked by ``backends.get``,
    before the program is traced or its run directory written)."""
    _ray()


def connect(address: str | None = None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local instance of the run's own."""
    ray = _ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address == "local":   # (Ray's name for a new instance of this run's own: started as without an address)
        address = None
    if ray.is_initialized():   # (an earlier run's instance, or the program's own ray.init: the one it joined)
        if address:
            _joined(ray, address)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
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


def _joined(ray: Any, address: str) -> None:
    """This process is connected to Ray already (it joins one cluster): refuse an address of another
    one. Told apart by the port of its control store (the same cluster is named by several hosts:
    127.0.0.1, the machine's address or name); a Ray Client connection, or an address of another
    scheme, is not compared."""
    if address == "local" or "://" in address:
        return
    given = _current_cluster() if address == "auto" else address
    try:
        current = str(ray.get_runtime_context().gcs_address)
    except Exception:   # (a Ray Client connection has none to compare)
        return
    if not given or not current:
        return
    port, now = given.rpartition(":")[2], current.rpartition(":")[2]
    if port.isdigit() and now.isdigit() and int(port) != int(now):
        raise ConfigError(f"this process is already connected to the Ray cluster at {current}, not {address}: "
                          "a process joins one Ray cluster",
                          fix="run on the cluster it is connected to (leave the address out), or call "
                              "ray.shutdown() first")


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
        wiring = RayWiring(hub, layouts, blayouts, groups, capacities={n: cap for n, (cap, _) in rings.items()})
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
