"""What the trace changes in the driver's process while it runs the user's loop, and puts back.

The trace runs the loop in the driver, so what the loop does there to process-wide state is
watched or undone: ``torch.set_num_threads`` (did the program set its own thread count? it then
keeps it in the run), ``gymnasium.make`` and ``make_vec`` (an environment the user's code made
and steps itself, which no placement can split or count), and the global random generators
(``random``, numpy's, torch's), put back as they were before the trace so that a run following it
begins where an eager call would.
"""

from __future__ import annotations

import functools
import random as _pyrandom
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from fragflow.compiler.reach import users_code
from fragflow.source import SourceLoc, display_path


class ThreadsSet:
    """``torch.set_num_threads`` while the program is traced: it notes that the program set them."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.original = torch.set_num_threads
        self.called = False

    def __call__(self, n: int) -> None:
        self.called = True
        self.original(n)

    def __reduce__(self) -> tuple[Any, ...]:
        # the program is pickled for its workers while the trace holds this in the user's module (from
        # torch import set_num_threads) and in torch: the workers get torch's own, by name
        return getattr, (self.torch, "set_num_threads")

    def rebind(self) -> list[tuple[dict[str, Any], str]]:
        """Put itself where the user's modules hold the function by name (``from torch import
        set_num_threads``); the (globals, name) it replaced, to put back."""
        out = []
        for module in list(sys.modules.values()):
            scope = getattr(module, "__dict__", None)
            if not isinstance(scope, dict) or not users_code(getattr(module, "__file__", None) or "<>"):
                continue
            for name, value in list(scope.items()):
                if value is self.original:
                    scope[name] = self
                    out.append((scope, name))
        return out


def watch_env_makers(into: set[tuple[SourceLoc, int | None]],
                     line_now: Callable[[], int | None] = lambda: None) -> Callable[[], None]:
    """Note in ``into`` where the user's code made an environment it then steps, with
    ``gymnasium.make`` or ``make_vec`` itself (not through ff.envs.make): one fragflow cannot split
    or count; beside it, the training function's line at the step (``line_now``), by which the
    trace tells the training loop's steps from a dataset's made before it. Returns the undo."""
    import gymnasium

    saved = {name: getattr(gymnasium, name) for name in ("make", "make_vec") if hasattr(gymnasium, name)}

    def watched(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def make(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            env = original(*args, **kwargs)
            if users_code(caller.f_code.co_filename) and not within_env_make(caller):
                made_at = SourceLoc(display_path(caller.f_code.co_filename), caller.f_lineno)
                step = env.step

                def stepped(*a: Any, **k: Any) -> Any:   # (one made only to look at its spaces is not noted)
                    if len(into) < 64:
                        into.add((made_at, line_now()))
                    return step(*a, **k)
                try:
                    env.step = stepped
                except AttributeError:
                    pass
            return env
        return make

    for name, original in saved.items():
        setattr(gymnasium, name, watched(original))

    def undo() -> None:
        for name, original in saved.items():
            setattr(gymnasium, name, original)
    return undo


def within_env_make(frame: Any) -> bool:
    """Whether ``frame`` runs inside ff.envs.make (a factory the user gave it, making its env)."""
    from fragflow.api import envs

    here = envs.__file__
    while frame is not None:
        if frame.f_code.co_filename == here:
            return True
        frame = frame.f_back
    return False


def rng_state() -> tuple[Any, ...]:
    import torch

    return _pyrandom.getstate(), np.random.get_state(), torch.random.get_rng_state()


def set_rng_state(state: tuple[Any, ...]) -> None:
    import torch

    _pyrandom.setstate(state[0])
    np.random.set_state(state[1])
    torch.random.set_rng_state(state[2])
