"""Shared-memory segments and the fixed layouts that map array pytrees onto them.

Every segment fragflow creates is named ``fragflow_<pid>_<n>``, created by the driver, which
alone unlinks it; workers only attach. A run leaves nothing in ``/dev/shm``.

>>> layout = Layout.of([TensorSpec((2, 3), "float32", "numpy"), TensorSpec((), "float", "python")])
>>> seg = Segment.create(layout.nbytes)
>>> layout.write(seg.buf, 0, [np.ones((2, 3), np.float32), 0.5])
>>> [getattr(x, "shape", x) for x in layout.read(seg.buf, 0)]
[(2, 3), 0.5]
>>> seg.close(); seg.unlink()
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from fragflow.compiler.pytree import TensorSpec, bfloat16, from_numpy, to_numpy
from fragflow.errors import SpecChangedError

PREFIX = "fragflow_"
ALIGN = 64
_counter = itertools.count()


def sweep_dead(root: str = "/dev/shm") -> list[str]:
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
        try:
            return Segment(shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1)), owner=True)
        except BaseException:   # made but not sized (a size that is not an integer): not left behind
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
            raise

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
