"""The cyclic garbage collector during a run.

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
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

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
    """This process is a worker of a run: it freezes its objects now and at :func:`settle`. A worker
    forked from the driver inherits the driver's frozen objects and its ``_managing`` (and so settles
    as the driver does); one spawned or started by a fork server freezes here."""
    global _worker
    _worker = gc.isenabled() and not gc.get_freeze_count()
    if _worker:
        gc.freeze()
