"""Ctrl-C and SIGTERM around the driver's steps that must not be cut in half."""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a run: handled like Ctrl-C (stop, clean up, write the summary)."""


@contextmanager
def handling(handlers: dict[int, Any]) -> Iterator[None]:
    """These signal handlers for the block, the previous ones after (in the main thread only: signals
    are left alone elsewhere)."""
    try:
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def shielded() -> Any:
    """SIGINT and SIGTERM ignored for the block: the run is stopping either way (its processes being
    joined, its outputs closed), and a second signal must not leave that half done."""
    return handling({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN})


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held until the block ends, then delivered: shared memory made but not yet
    recorded for release, or a process being forked (whose fork handlers drop the exception a signal
    raises there, so the run went on), are never cut in half, and the signal still stops the run."""
    got: list[int] = []
    with handling({signal.SIGINT: lambda s, f: got.append(s), signal.SIGTERM: lambda s, f: got.append(s)}):
        yield
    if got:
        signal.raise_signal(got[0])


dropped: list[type[BaseException]] = []   # a Ctrl-C (SIGTERM) raised where Python drops exceptions


def keeps_interrupts(fn: F) -> F:
    """Around a run: a Ctrl-C or SIGTERM whose exception was raised where Python drops exceptions
    (in a finalizer or a weakref callback running at that moment, which only print "Exception
    ignored in ...") is kept, and raised again at the run's next :func:`check`; the run went on as
    if no signal had come (seen with a loaded machine: a run of a million updates that two Ctrl-C
    did not stop)."""
    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
                dropped.append(unraisable.exc_type)
                return
            previous(unraisable)

        dropped.clear()
        sys.unraisablehook = hook
        try:
            return fn(*args, **kwargs)
        finally:
            sys.unraisablehook = previous
            dropped.clear()
    return kept  # type: ignore[return-value]


def check() -> None:
    """Raise, once, a Ctrl-C or SIGTERM that was dropped (see :func:`keeps_interrupts`)."""
    if dropped:
        kind = dropped[0]
        dropped.clear()
        raise kind()
