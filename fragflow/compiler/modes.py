"""The training mode of the versioned state's modules while tracing (``.train()`` / ``.eval()``): a
version carries tensors, not modes, so where an actor runs apart from the learner, a mode one side
sets is not the other's, as it is eagerly. Only modules whose mode changes what they compute count
(dropout, batch and instance norms, a module of the user's whose forward reads ``self.training``)."""

from __future__ import annotations

from typing import Any


def module_list(value: Any) -> list[Any]:
    """The torch modules (and their submodules) a state value holds whose training mode changes what
    they compute (dropout, batch and instance norms, a module of the user's whose forward reads
    ``self.training``), in order: a plain MLP's mode changes nothing, wherever it is set."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    out: list[Any] = []
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.nn.Module):
            out.extend(m for m in x.modules() if depends_on_mode(torch.nn, m))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(list(x)))
    return out


def depends_on_mode(nn: Any, module: Any) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0   # (Dropout(0.0), as a Transformer made with dropout=0.0 holds, drops nothing)
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return module.running_mean is not None   # (without running statistics, as InstanceNorm's default, the batch's in both modes)
    if isinstance(module, (nn.RNNBase, nn.MultiheadAttention)):
        return bool(module.dropout)
    cls = type(module)
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and not cls.__module__.startswith("torch.") and "training" in code.co_names


def modes(value: Any) -> list[bool]:
    """The training mode of each module a state value holds (a version carries tensors, not modes)."""
    return [m.training for m in module_list(value)]


def moded(value: Any) -> list[tuple[Any, bool]]:
    """Each module a state value holds whose mode matters, with its training mode now."""
    return [(m, m.training) for m in module_list(value)]


def changed(was: list[tuple[Any, bool]]) -> list[Any]:
    """The modules of ``moded``'s list whose training mode has changed since."""
    return [m for m, training in was if m.training != training]


class ModeSet:
    """While a learner is traced: the modules it calls ``.train()``/``.eval()`` on (with their submodules)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self._original: Any = None

    def __enter__(self) -> ModeSet:
        import sys
        torch = sys.modules.get("torch")
        if torch is not None:
            self._original = original = torch.nn.Module.train
            ids = self.ids

            def train(module: Any, mode: bool = True) -> Any:
                ids.update(id(m) for m in module.modules())
                return original(module, mode)

            torch.nn.Module.train = train
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._original is not None:
            import sys
            sys.modules["torch"].nn.Module.train = self._original
