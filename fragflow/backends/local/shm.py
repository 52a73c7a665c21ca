"""Shared-memory segments and the fixed layouts that map array pytrees onto them.

Every segment fragflow creates is named ``fragflow_<pid>_<n>``, created by the driver, which
alone unlinks it; workers only attach. A run leaves nothing in ``/dev/shm``.

``/dev/shm`` is a tmpfs of limited size (Docker's default is 64 MB): a process that touches a page
of a segment past the limit is killed by SIGBUS, whichever process it is and whenever it first
touches the page. So a run first checks that its segments fit (:func:`check_room`), and every
segment's pages are reserved as it is made (``posix_fallocate``), where running out is an error.

>>> layout = Layout.of([TensorSpec((2, 3), "float32", "numpy"), TensorSpec((), "float", "python")])
>>> seg = Segment.create(layout.nbytes)
>>> layout.write(seg.buf, 0, [np.ones((2, 3), np.float32), 0.5])
>>> [getattr(x, "shape", x) for x in layout.read(seg.buf, 0)]
[(2, 3), 0.5]
>>> seg.close(); seg.unlink()
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from fragflow.compiler.pytree import TensorSpec, bfloat16, from_numpy, to_numpy
from fragflow.errors import SharedMemoryError, SpecChangedError

PREFIX = "fragflow_"
ALIGN = 64
ROOT = "/dev/shm"
MB = 1 << 20   # (Docker's unit: --shm-size=64m is 64 MiB)
_counter = itertools.count()


def free_bytes(root: str = ROOT) -> int | None:
    """The space left in ``root`` for an unprivileged process, or None where it has no limit to
    read (no ``/dev/shm``, as on macOS; a tmpfs mounted without a size)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def in_pages(nbytes: int) -> int:
    """What a segment of ``nbytes`` takes in a tmpfs: whole pages."""
    return -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def check_room(sizes: list[tuple[str, int]], extra: int = 0, root: str = ROOT) -> None:
    """Refuse a run whose segments (``(what, bytes)`` each), and ``extra`` bytes besides, do not fit
    in what ``root`` has free."""
    free = free_bytes(root)
    if free is None:
        return
    needed = sum(in_pages(n) for _, n in sizes) + extra
    if needed <= free:
        return
    largest = sorted(sizes, key=lambda s: -s[1])[:3]
    suggest = -(-needed // (64 * MB)) * 64 + 64
    raise SharedMemoryError(
        f"this placement's channels need {needed / MB:.1f} MB of shared memory and {root} has "
        f"{free / MB:.1f} MB free: a process touching a page past that would be killed by SIGBUS, so the run "
        "is refused before any worker starts",
        fix=f"give {root} more room (Docker: docker run --shm-size={suggest}m ...; its default is 64m), or make the "
            "channels smaller: fewer environments or a shorter rollout per actor (num_envs, num_steps), "
            "a smaller max_lag, or a smaller state",
        detail="  largest: " + "; ".join(f"{what} {_size(n)}" for what, n in largest))


def _size(nbytes: int) -> str:
    return f"{nbytes / MB:.1f} MB" if nbytes >= MB else f"{-(-nbytes // 1024)} KB"


def sweep_dead(root: str = ROOT) -> list[str]:
    """Unlink the segments of drivers that no longer run (a SIGKILL sent to a run's whole process
    group kills the resource tracker too, which would have unlinked them): their names carry the
    driver's pid. Segments of a live process, or of another user, are left alone."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(root, name))
            removed.append(name)
        except OSError:   # (another user's, or gone meanwhile)
            pass
    return removed


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Take every page of a new segment now: a full ``/dev/shm`` is then an error here, not a SIGBUS
    in whichever process first writes to a page the tmpfs has no room for."""
    fd = getattr(shm, "_fd", -1)   # (POSIX: the descriptor shm_open gave)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:   # (a filesystem that cannot: its pages come as they are touched)
            return
        free = free_bytes()
        left = "" if free is None else f" ({free / MB:.1f} MB free)"
        raise SharedMemoryError(
            f"a shared-memory segment of {size / MB:.1f} MB could not be made: {ROOT} is full{left}",
            fix=f"give {ROOT} more room (Docker: docker run --shm-size=...; its default is 64m), or make the "
                "channels smaller (num_envs, num_steps, max_lag)") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # (another user's process)
        return True
    return True


class Segment:
    """A named shared-memory block. ``create`` in the driver; ``attach`` in workers."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.shm = shm
        self.owner = owner
        self.name = shm.name
        assert shm.buf is not None
        self.mem: memoryview = shm.buf
        self.buf = np.frombuffer(self.mem, dtype=np.uint8)

    @staticmethod
    def create(nbytes: int) -> Segment:
        name = f"{PREFIX}{os.getpid()}_{next(_counter)}"
        size = max(nbytes, 1)
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except BaseException:   # made but not sized (a size that is not an integer): not left behind
            try:
                os.unlink(os.path.join(ROOT, name))
            except OSError:
                pass
            raise
        try:
            _reserve(shm, size)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        return Segment(shm, owner=True)

    @staticmethod
    def attach(name: str) -> Segment:
        # Workers are spawned by the driver and share its resource tracker, so attaching registers
        # nothing new; the tracker unlinks a segment only if the driver dies without doing so.
        return Segment(shared_memory.SharedMemory(name=name), owner=False)

    def close(self) -> None:
        self.buf = np.empty(0, np.uint8)
        self.mem = memoryview(b"")
        try:
            self.shm.close()
        except BufferError:
            # A consumer still holds a zero-copy view: the mapping is released with the last view.
            # Keep SharedMemory.__del__ from retrying the close and warning about it.
            self.shm.close = lambda: None  # type: ignore[method-assign]

    def unlink(self) -> None:
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _np_dtype(spec: TensorSpec) -> np.dtype:
    if spec.backend == "python":
        return np.dtype({"float": np.float64, "int": np.int64, "bool": np.bool_}[spec.dtype])
    return bfloat16() if spec.dtype == "bfloat16" else np.dtype(spec.dtype)


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a fixed pytree lives in a byte buffer (64-byte aligned)."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    dtypes: tuple[np.dtype, ...]
    counts: tuple[int, ...]
    nbytes: int

    @staticmethod
    def of(specs: list[TensorSpec] | tuple[TensorSpec, ...]) -> Layout:
        offsets, dtypes, counts, pos = [], [], [], 0
        for spec in specs:
            dtype = _np_dtype(spec)
            count = int(np.prod(spec.shape)) if spec.shape else 1
            offsets.append(pos)
            dtypes.append(dtype)
            counts.append(count)
            pos += -(-count * dtype.itemsize // ALIGN) * ALIGN
        return Layout(tuple(specs), tuple(offsets), tuple(dtypes), tuple(counts), max(pos, ALIGN))

    def views(self, buf: np.ndarray, base: int) -> list[np.ndarray]:
        """numpy views of every leaf's place in ``buf`` at ``base`` (cache them: they do not change)."""
        return [np.frombuffer(buf, dtype=dtype, count=count, offset=base + off).reshape(spec.shape)
                for spec, off, dtype, count in zip(self.specs, self.offsets, self.dtypes, self.counts)]

    def write(self, buf: np.ndarray, base: int, leaves: list[Any]) -> None:
        self.write_views(self.views(buf, base), leaves)

    def write_views(self, views: list[np.ndarray], leaves: list[Any]) -> None:
        if len(leaves) != len(self.specs):
            raise SpecChangedError(f"{len(leaves)} arrays were sent through a channel sized for {len(self.specs)}",
                                   fix="keep the structure of what a fragment takes and returns fixed across calls")
        for view, leaf, spec in zip(views, leaves, self.specs):
            if spec.backend == "python":
                view[...] = leaf
            else:
                arr = to_numpy(leaf)
                if arr.shape != view.shape:   # copyto would broadcast a smaller array silently
                    raise SpecChangedError(f"an array of shape {arr.shape} was sent through a channel sized for "
                                           f"{spec.short()}", fix="keep every array's shape fixed across calls")
                np.copyto(view, arr, casting="no")

    def read(self, buf: np.ndarray, base: int, copy: bool = False) -> list[Any]:
        """Leaves as views into ``buf`` (or copies), converted back to their traced backend."""
        return self.read_views(self.views(buf, base), copy)

    def read_views(self, views: list[np.ndarray], copy: bool = False) -> list[Any]:
        out: list[Any] = []
        for view, spec in zip(views, self.specs):
            if spec.backend == "python":
                out.append(view.item())
                continue
            out.append(from_numpy(view.copy() if copy else view, spec.backend, spec.device))
        return out
