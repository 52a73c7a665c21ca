"""``ff.log``: the built-in sink fragment for scalars.

>>> log({"loss": 0.5})      # eagerly (no runtime) it does nothing
"""

from __future__ import annotations

from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.errors import TraceError
from fragflow.source import user_callsite


def _log(scalars: dict[str, Any]) -> None:
    """Record scalars (0-d arrays or numbers) at the current environment step."""
    return None


class _Log(Fragment):
    """``ff.log``: one dict of scalars. A call in another logger's style (``ff.log(loss=x)``,
    ``ff.log(metrics, step=n)``, ``ff.log("loss", x)``) failed as a TypeError naming ``_log``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) + len(kwargs) != 1 or (kwargs and "scalars" not in kwargs):
            if "step" in kwargs:
                raise TraceError("ff.log takes no step: each row is logged at the run's own counters (env_steps, "
                                 "updates, wall_seconds)", where=user_callsite(),
                                 fix="leave step out: ff.log(metrics); to log a number of your own, put it in the "
                                     "dict under a name of its own ({'iteration': n})")
            named = ", ".join(f"{k!r}: {k}" for k in kwargs) or "'loss': loss"
            raise TraceError(f"ff.log takes one dict of scalars, but was given "
                             f"{len(args)} positional argument{'s' * (len(args) != 1)}"
                             + (f" and keyword arguments {', '.join(kwargs)}" if kwargs else ""),
                             where=user_callsite(), fix=f"log a dict: ff.log({{{named}}})")
        return super().__call__(*args, **kwargs)


log = _Log(_log, "logger", name="log")
