"""The training mode of the versioned state's modules while tracing (``.train()`` / ``.eval()``): a
version carries tensors, not modes, so where an actor runs apart from the learner, a mode one side
sets is not the other's, as it is eagerly. Only modules whose mode changes what they compute count
(dropout, batch and instance norms, a module of the user's whose forward reads ``self.training``)."""

from __future__ import annotations

import sys
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


def plain_attributes(value: Any, state: str) -> list[tuple[str, Any, Any]]:
    """(where, module, name) of each plain attribute (``self.epsilon = 1.0``: not a parameter, buffer or
    submodule) of each torch module a state value holds, with what it holds now: a version carries a
    module's parameters and buffers, not these, so an actor apart never sees a learner change them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    out: list[tuple[str, Any, Any]] = []
    stack: list[tuple[str, Any]] = [(f"{state}", value)]
    seen: set[int] = set()
    while stack:
        path, x = stack.pop()
        if isinstance(x, torch.nn.Module):
            for name, m in x.named_modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                if type(m).get_extra_state is not torch.nn.Module.get_extra_state:
                    continue   # (its extra state travels with each version: what it holds is the module's to say)
                where = f"{path}{'.' + name if name else ''}"
                for k, v in vars(m).items():
                    if not k.startswith("_") and k != "training" and _plain(torch, v):
                        out.append((f"{where}.{k}", m, (k, _held(torch, v))))
        elif isinstance(x, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x))))
    return out


def _plain(torch: Any, v: Any) -> bool:
    return isinstance(v, (int, float, complex, torch.Tensor)) or (type(v).__module__ == "numpy" and hasattr(v, "shape"))


def _held(torch: Any, v: Any) -> Any:
    """What an attribute holds, to compare after a call (a tensor's or array's values, copied)."""
    if isinstance(v, torch.Tensor):
        return (id(v), v.detach().clone() if v.numel() <= 1 << 16 else None)
    if hasattr(v, "copy") and hasattr(v, "shape"):
        return (id(v), v.copy() if v.size <= 1 << 16 else None)
    return (id(v), v)


def _same(torch: Any, before: Any, now: Any) -> bool:
    (i, a), (j, b) = before, now
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return i == j and (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import numpy as np

        return i == j and np.array_equal(a, b)
    return type(a) is type(b) and (a == b or (a != a and b != b))


def changed_attributes(before: list[tuple[str, Any, Any]]) -> list[tuple[str, str, type]]:
    """The plain attributes of ``plain_attributes``' list that a call changed: (where, with its type;
    its name; its module's class) of each."""
    torch = sys.modules.get("torch")
    out = []
    for where, m, (k, held) in before:
        now = vars(m).get(k)
        if now is None or not _same(torch, held, _held(torch, now)):
            kind = type(now if now is not None else held[1]).__name__
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            out.append((f"{where} ({article} {kind} attribute of {type(m).__name__})", k, type(m)))
    return out


def names_read(fn: Any, cls: type) -> set[str]:
    """The attribute names an acting fragment ``fn`` may read of a module of class ``cls``: those its
    code loads (``x.name``; a string constant, as ``getattr(x, "name")`` takes), its nested functions'
    and the module-level functions it calls', and those ``cls``'s methods that run read: its
    ``forward`` and the methods that code names, torch's own modules' too (``Dropout.forward`` reads
    ``p``), and what they name in turn. A store (``__init__``'s ``self.name = ...``) or a method only
    the learner calls (a counter's ``bump``) is no read."""
    import dis
    import types

    methods: dict[str, Any] = {}
    for klass in reversed(getattr(cls, "__mro__", ())):
        if klass is object or (klass.__module__ == "torch.nn.modules.module" and klass.__name__ == "Module"):
            continue   # (Module's own machinery: __call__, state_dict, ...)
        for k, v in vars(klass).items():
            code = getattr(getattr(v, "__func__", v), "__code__", None)
            if code is not None:
                methods[k] = code
    names: set[str] = set()
    done: set[Any] = set()
    fn = getattr(fn, "__func__", fn)
    codes: list[tuple[Any, dict[str, Any]]] = [(getattr(fn, "__code__", None), getattr(fn, "__globals__", {}))]
    codes.append((methods.get("forward"), {}))
    while codes:
        code, scope = codes.pop()
        if code is None or code in done:
            continue
        done.add(code)
        for i in dis.get_instructions(code):
            if i.opname in ("LOAD_ATTR", "LOAD_METHOD") or (i.opname == "LOAD_CONST" and isinstance(i.argval, str)):
                name = str(i.argval)
                names.add(name)
                if name in methods:
                    codes.append((methods[name], {}))
            elif i.opname == "LOAD_GLOBAL":   # (a helper function of the module the fragment calls)
                helper = scope.get(str(i.argval))
                if isinstance(helper, types.FunctionType):
                    codes.append((helper.__code__, helper.__globals__))
        codes.extend((c, scope) for c in code.co_consts if hasattr(c, "co_names"))
    return names


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
        self._loop_sets: set[int] = set()   # modules whose mode the loop's own code sets (.eval() before acting)
        # learner -> (the state, a plain attribute of one of its modules the learner changed: where; its name; the class)
        self.attributes: dict[str, list[tuple[str, str, str, type]]] = {}

    @contextmanager
    def watching_loop(self) -> Iterator[None]:
        """While the loop runs: the modules whose ``.train()``/``.eval()`` its own code calls (outside any
        fragment): where the loop sets the mode an actor acts in, it does so wherever the loop runs."""
        torch = sys.modules.get("torch")
        if torch is None:
            yield
            return
        from fragflow.api.fragment import calling

        original = torch.nn.Module.train
        loop_sets = self._loop_sets

        def train(module: Any, mode: bool = True) -> Any:
            if calling() is None:
                loop_sets.update(id(m) for m in module.modules())
            return original(module, mode)

        torch.nn.Module.train = train
        try:
            yield
        finally:
            if torch.nn.Module.train is train:
                torch.nn.Module.train = original

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
        attributes = [plain_attributes(arguments[pname], state) for pname, state in state_args] \
            if role == "learner" and name not in self.attributes else []
        with watching if watching is not None else nullcontext():
            yield
        changes = [(state, *change) for held, (_, state) in zip(attributes, state_args)
                   for change in changed_attributes(held)]
        if changes:
            self.attributes[name] = changes
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
        left = sorted((reads[2] & self._learner_changes.keys()) - self._actor_sets - self._loop_sets)
        if not left:
            return ""
        return f"'{reads[0]}' (argument '{reads[1]}'), whose modules' mode learner '{self._learner_changes[left[0]]}' " \
               "changes"
