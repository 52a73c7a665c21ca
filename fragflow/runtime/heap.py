"""The process's heap during a run: the cyclic garbage collector, and glibc's malloc.

A training loop allocates many short-lived objects (arrays, tensors, tuples of outputs), so the
collector runs often; each of its full collections walks every tracked object in the process, and
a process that has imported torch and gymnasium and built its networks holds hundreds of thousands
of them, none of which become garbage during the run. On DQN over CartPole the three full
collections of a 30k-step run took 0.35-0.4 s of its 4-5 s. A run moves the objects that exist as
its loop starts, and again once the program has made its state, into the collector's permanent
generation (``gc.freeze``), so that full collections walk only what the run itself allocates;
they are still freed by reference counting, and the run's end hands them back to the collector
(``gc.unfreeze``). A process whose collector is disabled, or that froze objects itself, is left
as it is.

glibc's malloc hands an allocation above its mmap threshold (128 KiB at first, raised as such
blocks are freed, to 32 MiB at most) its own pages from the system and returns them when it is
freed, and gives back the free memory at the top of its heap above its trim threshold: a learner
whose tensors are megabytes (a minibatch of 256 Atari frames in float32 is 29 MB, a convolution's
activations and their gradients several more) then takes each of them as fresh pages, zeroed by
the kernel a page fault at a time, at every minibatch. During a run every process of it keeps the
memory it frees for its next allocations instead (:func:`keep_freed`: allocations up to 256 MiB
come from the heap, 32 MiB under glibc before 2.35, and up to 64 MiB in a thread other than the
main one, whose arena's heaps hold 64 MiB at most; up to 1 GiB of free memory above what the
process uses stays there), as the allocators that PyTorch's CPU tuning guide suggests do (jemalloc,
TCMalloc): PPO on Breakout ran 1.06x faster in one process, 1.00-1.09x pipelined. After the run the driver's process is set to the
thresholds glibc's own rule reaches once a process has freed a big block (32 MiB, trim 64 MiB; fixed
values: glibc's rule stays off once a value is given) and returns its free memory (``malloc_trim``),
after the run's outputs are written.
``FRAGFLOW_MALLOC=system`` leaves malloc as it is, as does a process started with glibc's own
settings of these (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
``MALLOC_MMAP_MAX_``, or the same in ``GLIBC_TUNABLES``), and any C library but glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

_managing = False   # within frozen(): the run hands the frozen objects back at its end
_worker = False     # a worker process: frozen for good


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """For the block, the objects that exist are out of the collector's full walks (see the module)."""
    global _managing
    if _managing or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    _managing = True
    gc.freeze()
    try:
        yield
    finally:
        _managing = False
        gc.unfreeze()


def settle() -> None:
    """The program's objects made so far (networks, optimizers, buffers) join the frozen ones: called
    once the program has made its state (its first learner update), within :func:`frozen`, or in a
    worker process, which never hands them back (it ends with the run)."""
    if _managing or (_worker and gc.isenabled()):
        gc.freeze()


def in_worker() -> None:
    """This process is a worker of a run: it freezes its objects now and at :func:`settle`, and keeps
    the memory it frees (:func:`keep_freed`). A worker forked from the driver inherits the driver's
    frozen objects and its ``_managing`` (and so settles as the driver does); one spawned or started by
    a fork server freezes here."""
    global _worker
    _worker = gc.isenabled() and not gc.get_freeze_count()
    if _worker:
        gc.freeze()
    keep_freed()   # (for good: the process ends with the run)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt's parameters (malloc.h)
KEEP_BELOW = 256 << 20    # allocations up to this many bytes come from the heap (above: pages of their own)
KEEP_BELOW_OLD = 32 << 20   # glibc before 2.35 refuses a threshold above half its arenas' heap size (64 MiB)
KEEP_FREE = 1 << 30       # free bytes at the heap's top kept before the rest goes back to the system
# after a run, the driver's thresholds where glibc's own rule takes them once the process has freed a big
# block (the mmap threshold follows freed blocks up to 32 MiB, the trim threshold is twice it): a fixed
# value turns that rule off, and glibc's starting 128 KiB would give every later tensor above it pages of
# its own
GLIBC_MMAP_AFTER, GLIBC_TRIM_AFTER = 32 << 20, 64 << 20
MALLOC_SETTINGS = ("keep", "system")
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_USERS_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                   "glibc.malloc.mmap_max")

_keeping = False   # within malloc_kept(): the driver's process is set to GLIBC_*_AFTER at its end


def malloc_setting() -> str:
    """``FRAGFLOW_MALLOC``: ``keep`` (the default) or ``system``; a run checks it before it starts."""
    raw = os.environ.get("FRAGFLOW_MALLOC", "").strip()
    if raw.lower() in ("", *MALLOC_SETTINGS):
        return raw.lower() or "keep"
    from fragflow.errors import ConfigError

    raise ConfigError(f"FRAGFLOW_MALLOC={raw!r} is not one of {', '.join(MALLOC_SETTINGS)}",
                      fix="unset it (each process of a run keeps the memory it frees for its next allocations) "
                          "or set FRAGFLOW_MALLOC=system (malloc as the process has it)")


def _glibc() -> Any:
    """The process's C library where it is glibc (its ``mallopt``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None   # (glibc's own: musl has no mallopt to tune)


def keep_freed() -> bool:
    """This process keeps the memory it frees for its next allocations (see the module); False where
    malloc is left as it is."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if malloc_setting() == "system" or any(k in os.environ for k in _USERS_OWN) or \
            any(t in tunables for t in _USERS_TUNABLES):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # (a threshold refused changes nothing: the trim threshold is set, which turns glibc's own rule off,
    # only once the process has one)
    if not (libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) or libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_OLD)):
        return False
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE)
    return True


@contextlib.contextmanager
def malloc_kept() -> Iterator[None]:
    """For the block, this process keeps the memory it frees (:func:`keep_freed`); after it, the
    thresholds where glibc's own rule takes them, and the free memory returned to the system."""
    global _keeping
    if _keeping or not keep_freed():
        yield
        return
    _keeping = True
    try:
        yield
    finally:
        _keeping = False
        libc = _glibc()
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_AFTER)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_AFTER)
        libc.malloc_trim(0)
