"""The torch optimizers a learner's state holds, the learning-rate schedulers the training function
holds for them, and their hyper-parameters (what a schedule changes)."""

from __future__ import annotations

import sys
from typing import Any

from fragflow.compiler.reach import objects_of
from fragflow.source import is_internal


def optimizers_of(value: Any) -> list[Any]:
    """The torch optimizers a learner's state holds."""
    return [x for x in objects_of(value) if hasattr(x, "param_groups") and hasattr(x, "step")
            and type(x).__module__.startswith("torch.optim")] if "torch" in sys.modules else []


def schedulers_of(optimizers: list[Any]) -> list[Any]:
    """Learning-rate schedulers of ``optimizers`` that the training function (a frame up the
    stack from the learner's call) holds in its variables."""
    ids = {id(o) for o in optimizers}
    found: dict[int, Any] = {}
    frame = sys._getframe(2)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            for v in list(frame.f_locals.values()):
                try:
                    held = object.__getattribute__(v, "__dict__").get("optimizer")
                except (AttributeError, TypeError):
                    continue
                if id(held) in ids and isinstance(getattr(v, "last_epoch", None), int):
                    found[id(v)] = v
        frame = frame.f_back   # type: ignore[assignment]
    return list(found.values())


def hyper_of(opt: Any) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """An optimizer's hyper-parameters (learning rate, betas...): what a schedule changes."""
    return tuple(tuple(sorted((k, v) for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple))))
                 for g in opt.param_groups)


def hyper_change(before: Any, after: Any) -> str:
    for i, (b, a) in enumerate(zip(before, after)):
        for (k, v0), (_, v1) in zip(b, a):
            if v0 != v1:
                return f"param_groups[{i}]['{k}'] {v0!r} -> {v1!r}"
    return "its param_groups"


def track_scheduled_steps(state: Any) -> None:
    """Wrap again the ``step`` of every optimizer a learning-rate scheduler in ``state`` steps, as
    the scheduler did when it was made: an optimizer is sent without its instance attributes, and
    its scheduler's first step then warned that ``optimizer.step()`` had been overridden."""
    import functools
    import weakref

    from fragflow.compiler.pytree import is_scheduler

    for sched in (x for x in objects_of(state) if is_scheduler(x)):
        opt = getattr(sched, "optimizer", None)
        if opt is None or hasattr(opt.step, "_wrapped_by_lr_sched"):
            continue
        step, ref = type(opt).step, weakref.ref(opt)

        def wrapper(*args: Any, _step: Any = step, _ref: Any = ref, **kwargs: Any) -> Any:
            held = _ref()
            held._opt_called = True
            return _step(held, *args, **kwargs)

        wrapper = functools.wraps(step)(wrapper)
        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = wrapper
