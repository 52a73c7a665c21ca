"""Lowering: a placed graph becomes one program per process group (see :mod:`.program`)."""

from fragflow.lowering.program import (
    Broadcast,
    Logged,
    LoopProgram,
    Lowered,
    Remote,
    Ring,
    ServiceProgram,
    lower,
)

__all__ = ["Broadcast", "Logged", "LoopProgram", "Lowered", "Remote", "Ring", "ServiceProgram", "lower"]
