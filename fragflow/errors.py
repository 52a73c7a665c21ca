"""User-facing errors: one class per kind of mistake.

Every message says *what* went wrong, *where* in the user's code (``file:line``) and *how to
fix it*. The CLI prints them without an internal traceback and exits with code 2
(``FRAGFLOW_DEBUG=1`` or ``--debug`` shows the traceback).

>>> err = ConfigError("unknown key 'num_env'", where=None, fix="did you mean 'num_envs'?")
>>> print(err)
unknown key 'num_env'
  fix: did you mean 'num_envs'?
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from fragflow.source import SourceLoc


class FragflowError(Exception):
    """Base class of every error fragflow raises about the user's program or command line."""

    exit_code = 2

    def __init__(self, what: str, *, where: SourceLoc | None = None, fix: str | None = None,
                 detail: str | None = None) -> None:
        self.what = what
        self.where = where
        self.fix = fix
        self.detail = detail
        super().__init__(self._format())

    def restate(self, *, what: str | None = None, fix: str | None = None) -> None:
        """Change the message or the fix where the cause is better known than where it was raised
        (its text is its args: what crosses a process boundary and what ``str`` shows)."""
        self.what = self.what if what is None else what
        self.fix = self.fix if fix is None else fix
        self.args = (self._format(),)

    def _format(self) -> str:
        lines = [self.what]
        if self.where is not None:
            lines.append(f"  at {self.where}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.detail:
            lines.append(self.detail.rstrip())
        return "\n".join(lines)


class UnknownFileError(FragflowError):
    """The algorithm file given on the command line does not exist or defines no training loop."""


class UnknownPolicyError(FragflowError):
    """The distribution policy named by ``--policy`` or ``@ff.distribute`` is not registered."""


class ConfigError(FragflowError):
    """A ``--set key=value`` or a policy option names an unknown key or has a value of the wrong type."""


class UnknownEnvError(FragflowError):
    """``ff.envs.make`` was given an environment id gymnasium does not know."""


class TraceError(FragflowError):
    """The training loop cannot be turned into a fragmented dataflow graph."""


class NoFragmentError(TraceError):
    """The training loop ran to its end without calling a single fragment."""


class NotArrayPytreeError(TraceError):
    """A fragment took or returned something that is not a pytree of arrays."""


class ShapeChangedError(TraceError):
    """A fragment's output pytree, shape or dtype changed from one call to the next."""


class VersionedStateError(TraceError):
    """A versioned value was used in a way its version cannot follow."""


class MissingOutputKeyError(VersionedStateError, KeyError):
    """The loop indexed another process's output by a key (an index) its traced value does not have:
    a ``KeyError`` (``IndexError``) as eagerly, with where and why."""

    __str__ = BaseException.__str__   # (KeyError's would quote the message)


class MissingOutputIndexError(VersionedStateError, IndexError):
    __doc__ = MissingOutputKeyError.__doc__


class GraphError(FragflowError):
    """``Graph.verify()`` or ``PlacedGraph.verify()`` found an inconsistent graph."""


class PlacementError(FragflowError):
    """A distribution policy cannot place this program: the message says why and which policy can."""


class LearnerOutputOnActingSideError(PlacementError):
    """A learner's output is used as plain data on the acting side, where a policy that runs the
    learner in another process cannot deliver it (``single_process`` runs such a loop as written)."""


class SharedMemoryError(FragflowError):
    """This machine's shared memory (``/dev/shm``) cannot hold the channels a placement needs: the
    run is refused before any worker starts (a process touching a page past a full ``/dev/shm``
    would be killed by SIGBUS instead)."""


class SpecChangedError(FragflowError):
    """A fragment's input, output or state no longer matches the specs traced for it."""


class NonFiniteError(FragflowError):
    """A learner produced NaN or infinity (``FRAGFLOW_ALLOW_NONFINITE=1`` keeps going)."""

    exit_code = 1


class UntracedFragmentError(FragflowError):
    """The loop called a fragment the tracer never saw, so no placement knows where it runs."""


class FragmentFailed(Exception):
    """A fragment raised while the runtime executed it.

    The message names the fragment and where the user's code called it; the user's own
    exception is chained as ``__cause__`` so its traceback is shown in full.
    """

    def __init__(self, fragment: str, where: SourceLoc | None, cause: BaseException) -> None:
        self.fragment = fragment
        self.where = where
        loc = f" (called at {where})" if where else ""
        super().__init__(f"while executing fragment '{fragment}'{loc}: {type(cause).__name__}: {cause}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A 'did you mean ...?' hint, or a list of the valid choices when nothing is close."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"choose one of: {shown}"
