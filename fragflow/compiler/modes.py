"""The training mode of the versioned state's modules while tracing (``.train()`` / ``.eval()``): a
version carries tensors, not modes, so where an actor runs apart from the learner, a mode one side
sets is not the other's, as it is eagerly. Only modules whose mode changes what they compute count
(dropout, batch and instance norms, a module of the user's whose forward reads ``self.training``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
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


class ModeBook:
    """What the trace saw of the state's modules' training modes, module by module (a learner's
    ``target.eval()`` says nothing of the ``q`` an actor acts with): which a learner or an acting
    fragment sets itself, which a learner leaves in another mode, which an acting fragment sets and
    which it acts with."""

    def __init__(self) -> None:
        self._actor_changes: dict[str, tuple[str, set[int]]] = {}   # acting fragment -> (what, modules) it set
        self._learner_sets: set[int] = set()   # modules whose mode a learner sets itself
        self._actor_sets: set[int] = set()     # ... an acting fragment sets itself
        self._learner_changes: dict[int, str] = {}   # module -> the learner that left it in another mode
        self._readers: dict[str, tuple[str, str, set[int]]] = {}   # acting fragment -> (state, argument, modules)

    @contextmanager
    def call(self, name: str, role: str, state_args: list[tuple[str, str]], arguments: dict[str, Any],
             read: list[tuple[str, str, Any]]) -> Iterator[None]:
        """Around a traced call of fragment ``name``: ``state_args`` its (argument, state) pairs,
        ``read`` the (argument, state, value) an acting fragment reads (empty: not watched)."""
        before = [moded(value) for _, _, value in read]
        # a learner that sets its modules' mode itself (.train() at its start) acts alike wherever an
        # actor's .eval() left the mode; one that does not learns in the mode an actor set, as eagerly
        watching = ModeSet() if state_args and (role == "learner" or read) else None
        entered = [moded(arguments[pname]) for pname, _ in state_args] if role == "learner" else []
        with watching if watching is not None else nullcontext():
            yield
        if watching is not None and watching.ids:
            for pname, _ in state_args:
                (self._learner_sets if role == "learner" else self._actor_sets).update(
                    id(m) for m in module_list(arguments[pname]) if id(m) in watching.ids)
        for was in entered:
            for m in changed(was):   # (a learner's .eval() at its end: eagerly actors act so)
                self._learner_changes.setdefault(id(m), name)
        for pname, state, value in read:
            found = module_list(value)
            if found:
                self._readers.setdefault(name, (state, pname, set()))[2].update(id(m) for m in found)
        for (pname, state, _), was in zip(read, before):
            flipped = changed(was)
            if flipped:
                self._actor_changes.setdefault(name, (f"'{state}' (argument '{pname}': the training mode of its "
                                                      "modules, set by .eval() or .train())", set()))[1] \
                    .update(id(m) for m in flipped)

    def actor_mode(self, name: str) -> str:
        """The state whose modules' training mode fragment ``name`` (not a learner) sets, where no learner
        sets it itself: eagerly the learner then learns in the mode the actor left (dropout off after an
        actor's .eval()), apart its own copy keeps its mode."""
        change = self._actor_changes.get(name)
        return change[0] if change is not None and not change[1] <= self._learner_sets else ""

    def learner_mode(self, name: str) -> str:
        """The state (argument) whose modules acting fragment ``name`` runs in the training mode a learner
        leaves them in (``q.eval()`` at its end) without setting the mode itself: eagerly it acts in the
        learner's mode, apart its copy keeps its own (a version carries tensors, not modes)."""
        reads = self._readers.get(name)
        if reads is None:
            return ""
        left = sorted((reads[2] & self._learner_changes.keys()) - self._actor_sets)
        if not left:
            return ""
        return f"'{reads[0]}' (argument '{reads[1]}'), whose modules' mode learner '{self._learner_changes[left[0]]}' " \
               "changes"
