"""fragflow: write an RL algorithm as plain Python; trace it into a fragmented dataflow graph;
place it with a distribution policy; run it.

>>> import fragflow as ff
>>> "single_process" in ff.policies() and "pipelined" in ff.policies()
True
"""

from __future__ import annotations

__version__ = "0.1.0"

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fragflow.api import random
from fragflow.api.buffer import RolloutBuffer
from fragflow.api.fragment import fragment
from fragflow.api.inference import numpy_forward
from fragflow.api.log import log
from fragflow.api.replay import ReplayBuffer
from fragflow.api.versioned import versioned
from fragflow.placement.registry import distribute

if TYPE_CHECKING:
    from fragflow.api import envs
    from fragflow.compiler.ir import Graph
    from fragflow.driver import RunResult


def __getattr__(name: str) -> Any:
    # ``ff.envs`` imports gymnasium, which commands such as ``fragflow policies`` never need
    if name == "envs":
        from fragflow.api import envs

        return envs
    raise AttributeError(f"module 'fragflow' has no attribute {name!r}")


def delivered() -> list[tuple[int, int]]:
    """Inside a fragment: ``(version, lag)`` of each piece its call was assembled from, in merge
    order. A channel with ``overflow=deliver`` consumes pieces beyond its staleness bound, and this
    is how the algorithm sees by how much (an importance correction, V-trace). Run in one process
    the call is the loop's own: one piece, lag 0.

    >>> delivered()
    [(0, 0)]
    """
    from fragflow import context

    interp = context.current()
    pieces = getattr(interp, "delivered", None)
    return list(pieces) if pieces else [(0, 0)]


def learners() -> int:
    """Inside a learner fragment: how many learners make each of its updates together, each on its
    share of the batch (``multi_learner``'s ``learners``, whose process group is then
    ``torch.distributed``'s default group); 1 anywhere else, whatever process group the program
    initialised itself. A statistic of the whole batch is the learners' all-reduced sums:
    ``if ff.learners() > 1: torch.distributed.all_reduce(sums)``.

    >>> learners()
    1
    """
    from fragflow import context

    reducer = getattr(context.current(), "reducer", None)
    return int(reducer.world) if reducer is not None else 1


def policies() -> dict[str, str]:
    """Registered distribution policies and the system each mirrors."""
    from fragflow.placement.registry import available

    return {name: spec.mirrors for name, spec in available().items()}


def trace(train: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Trace a training loop into its fragmented dataflow graph (see :func:`fragflow.compiler.tracing.trace`)."""
    from fragflow.compiler.tracing import trace as _trace

    return _trace(train, *args, **kwargs)


def run(train: Callable[..., Any], args: Any = None, **kwargs: Any) -> RunResult:
    """Compile and run a training loop (see :func:`fragflow.driver.run`)."""
    import random
    import sys

    drawn = random.getstate()   # importing the runtime (rich) draws from Python's random: not the program's numbers
    from fragflow.driver import run as _run

    random.setstate(drawn)
    # torch's thread count as the caller had it, put back after the run (which sets the placement's
    # for the loop run here: later torch work in this process ran on one thread)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        return _run(train, args, **kwargs)
    finally:
        if torch is not None and threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


__all__ = ["ReplayBuffer", "RolloutBuffer", "delivered", "distribute", "envs", "fragment", "learners", "log", "numpy_forward", "policies", "random", "run", "trace",
           "versioned", "__version__"]
