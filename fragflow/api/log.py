"""``ff.log``: the built-in sink fragment for scalars.

>>> log({"loss": 0.5})      # eagerly (no runtime) it does nothing
"""

from __future__ import annotations

from typing import Any

from fragflow.api.fragment import Fragment


def _log(scalars: dict[str, Any]) -> None:
    """Record scalars (0-d arrays or numbers) at the current environment step."""
    return None


log = Fragment(_log, "logger", name="log")
