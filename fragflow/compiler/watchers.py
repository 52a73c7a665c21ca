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
import os
import random as _pyrandom
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

from fragflow.compiler.reach import users_code
from fragflow.source import SourceLoc, display_path, user_callsite


def torch_threads(n: Any) -> int:
    """A count given to ``torch.set_num_threads`` as a number (0 where it is not one: torch refuses it)."""
    try:
        return int(n)
    except (TypeError, ValueError):
        return 0


class ThreadsSet:
    """``torch.set_num_threads`` while the program is traced: it notes that the program set them."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.original = torch.set_num_threads
        self.called = False
        self.most = 0   # the most threads it set

    def __call__(self, n: int) -> None:
        self.called = True
        self.original(n)
        self.most = max(self.most, torch_threads(n))

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


def torch_mode() -> str | None:
    """torch's mode a call from the loop runs in, where not the default: the context that set it
    (``torch.no_grad()``, ``torch.inference_mode()``, an autocast), as the user would write it;
    None: gradients on and no autocast, or no torch imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    modes = []
    if torch.is_inference_mode_enabled():
        modes.append("torch.inference_mode()")
    elif not torch.is_grad_enabled():
        modes.append("torch.no_grad()")
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
            modes.append(f"torch.autocast({device!r}, dtype=torch.{dtype})")
    return " and ".join(modes) or None


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


class StateUse:
    """The loop's own torch operations, while traced, on the tensors versioned state holds (a
    module's parameters and buffers, a tensor in the state) through a reference of its own, not
    the state handle: ``q.fc.weight.data *= 0.999``, ``q(obs)`` to log a value. Eagerly that is the
    state itself; where a learner runs in another process the loop's object is a copy of its own,
    which the learner never sees changed and whose values are not the learner's newest. ``first``:
    the first change (any time after the state was made) or read (once a learner has written the
    state), as (``"changed"`` or ``"read"``, state, the tensor's label, the operation, the user's
    line). Printing a tensor is not a read (as printing the handle is not). Active only while the
    loop's own code runs (``on``): a fragment's operations are its own."""

    def __init__(self) -> None:
        self.on = False
        self.loop_code: Any = None   # the training function's code: its line is the one named
        self.first: tuple[str, str, str, str, SourceLoc | None] | None = None
        self.written: set[str] = set()                          # states a learner has written
        self._tensors: dict[int, tuple[Any, str, str]] = {}     # id -> (tensor, state, label)
        # a tensor's storage -> the byte ranges of the state's tensors in it: (start, end, state, label)
        self._storages: dict[int, list[tuple[int, int, str, str]]] = {}
        self._versions: dict[int, int | None] = {}   # id -> its version counter when first watched
        self._groups: list[tuple[list[Any], int, dict[str, Any]]] = []   # (param_groups, index, the group as made)

    def watch(self, states: dict[str, Any]) -> None:
        """The tensors the states' newest values hold (a learner may return new ones), and the
        settings of the optimizers they hold (see _Group)."""
        import torch

        from fragflow.compiler.reach import objects_of

        for state, value in states.items():
            for i, opt in enumerate(o for o in objects_of(value) if isinstance(o, torch.optim.Optimizer)):
                groups = opt.param_groups
                for j, group in enumerate(groups):
                    if type(group) is dict:
                        groups[j] = _Group(group, self, state, f"{state}'s optimizer{f' {i}' if i else ''} "
                                                                f"param_groups[{j}]")
                        self._groups.append((groups, j, group))
        tensors: dict[int, tuple[Any, str, str]] = {}
        storages: dict[int, list[tuple[int, int, str, str]]] = {}
        for state, value in states.items():
            for tensor, label in _state_tensors(value, f"{state}", torch, 0):
                tensors.setdefault(id(tensor), (tensor, state, label))
                if id(tensor) not in self._versions:
                    self._versions[id(tensor)] = _version(tensor)
                at = _extent(tensor)
                if at is not None:
                    storages.setdefault(at[0], []).append((at[1], at[2], state, label))
        self._tensors, self._storages = tensors, storages

    def mode(self) -> Any:
        """A torch function mode that sends each operation to ``seen`` while ``on``."""
        import torch
        from torch.overrides import TorchFunctionMode

        use = self

        class _Watched(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                kwargs = kwargs or {}
                if torch.compiler.is_compiling():   # (torch.compile tracing a module: its own graph, nothing to watch)
                    return func(*args, **kwargs)
                if use.on and (use.first is None or use.first[0] == "read") and use._tensors:
                    use.seen(func, args, kwargs)
                shown = warnings.showwarning   # (torch's warnings name their caller, this frame: the loop's line instead)
                warnings.showwarning = _AtCaller(shown, sys._getframe(1))  # type: ignore[assignment]
                try:
                    return func(*args, **kwargs)
                finally:
                    warnings.showwarning = shown

        return _Watched()

    def seen(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(func, "__name__", "")
        attr = getattr(getattr(func, "__self__", None), "__name__", "") if name in ("__get__", "__set__") else ""
        if name in _PRINTED or name in _METADATA or (name == "__get__" and attr in _METADATA):
            return
        if attr in ("grad", "_grad", "grad_fn") or \
                (name == "__set__" and attr == "data" and len(args) > 1 and _same_memory(*args[:2])):
            return   # (a gradient is no value of the state; `p.data = p`, as module.to() does, changes nothing)
        if _in_module_apply(sys._getframe(1)):
            return   # (q.to("cpu"), q.float(): a module converting its tensors, the same values where no copy is made)
        augmented = _AUGMENTED.get(name)
        op = {"__get__": f".{attr}", "__set__": f".{attr} = ...", "__setitem__": "[...] = ..."}.get(
            name, augmented or f"{name}()")
        if name in ("__set__", "__setitem__") or augmented is not None or \
                (name.endswith("_") and not name.endswith("__")) or kwargs.get("out") is not None:
            for target in (*_flat(args[:1]), *_flat((kwargs.get("out"),))):
                hit = self._changes(target)
                if hit is not None:
                    where = self._where()
                    if self.first is None or self.first[4] == where:   # (w.data *= 2 reads .data first: a change)
                        self.first = ("changed", *hit, f"with {op}", where)
                    return
        if self.first is not None:
            return
        for x in (*_flat(args), *_flat(tuple(kwargs.values()))):
            held = self._tensors.get(id(x))
            # (a tensor no learner changed since the state was made, a constant mask or scale, is every
            # process's alike: reading it is as eagerly)
            if held is not None and held[0] is x and held[1] in self.written and \
                    (_version(x) is None or _version(x) != self._versions.get(id(x))):
                self.first = ("read", held[1], held[2], f"with {op}", self._where())
                return

    def unwatch(self) -> None:
        """The optimizers' own setting dicts back in place, as they stand now."""
        for groups, j, group in self._groups:
            watched = groups[j] if j < len(groups) else None
            if isinstance(watched, _Group):
                group.clear()
                group.update(dict.items(watched))
                groups[j] = group
        self._groups = []

    def read_setting(self, state: str, label: str, key: str) -> None:
        """The loop read setting ``key`` of an optimizer the state holds, changed since the state was
        made (a learner sets the rate each update): eagerly the learner's newest, apart the loop's copy's."""
        if self.on and self.first is None and state in self.written:
            self.first = ("read", state, label, f"with ['{key}']", self._where())

    def _where(self) -> SourceLoc | None:
        """The training function's line running now (a module's forward or a helper of the user's
        called from it is the loop's use at that line), else the user's innermost."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code is not self.loop_code:
            frame = frame.f_back
        return user_callsite() if frame is None else SourceLoc.of(frame.f_code.co_filename, frame.f_lineno)

    def _changes(self, target: Any) -> tuple[str, str] | None:
        """(state, label) of the state's tensor an in-place operation on ``target`` changes: the
        tensor itself, or another tensor on its memory (``.data``, ``.detach()``, a view)."""
        held = self._tensors.get(id(target))
        if held is not None and held[0] is target:
            return held[1], held[2]
        at = _extent(target)
        if at is None:
            return None
        return next(((state, label) for lo, hi, state, label in self._storages.get(at[0], ())
                     if lo < at[2] and at[1] < hi), None)   # (another view of the same storage that overlaps it)


# what an operation that only looks at a tensor's kind reads (it is the same in every version), and
# printing (shown, not used: as the handle, printed in the loop, is not read)
_METADATA = frozenset({
    "shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_leaf", "names", "is_sparse",
    "is_quantized", "is_meta", "itemsize", "size", "dim", "numel", "nelement", "element_size", "stride",
    "storage_offset", "is_contiguous", "get_device", "data_ptr", "is_floating_point", "is_complex", "__len__",
    "__hash__", "untyped_storage", "nbytes", "is_cpu", "is_signed", "is_mps", "is_inference"})
_PRINTED = frozenset({"__repr__", "__str__", "__format__"})
_AUGMENTED = {f"__i{k}__": f"{v}=" for k, v in {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**", "matmul": "@",
    "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}.items()}


def _extent(t: Any) -> tuple[int, int, int] | None:
    """(its storage, the first byte, one past the last) a tensor's elements span; None for one with
    no storage to speak of (empty, sparse, a torch.func wrapper) or that is no tensor."""
    try:
        if not t.numel():
            return None
        storage = t.untyped_storage().data_ptr()
        start = t.data_ptr()
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return None
    return storage, start, start + span * t.element_size()


class _AtCaller:
    """``warnings.showwarning`` while the trace's mode runs one of the loop's torch operations: a
    warning torch gave there names the line of the loop that called it, not the mode's own."""

    def __init__(self, shown: Callable[..., Any], caller: FrameType) -> None:
        self.shown, self.caller = shown, caller

    def __call__(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> Any:
        if filename == __file__:
            filename, lineno = self.caller.f_code.co_filename, self.caller.f_lineno
            rest = rest[:1]   # (the line's text read again, for the new place)
        return self.shown(message, category, filename, lineno, *rest)


def _in_module_apply(frame: FrameType | None, depth: int = 6) -> bool:
    """Whether torch's ``Module._apply`` (``to``, ``float``, ``cpu``: a conversion of every tensor)
    is among the few callers of an operation."""
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "_apply" and frame.f_code.co_filename.endswith(_MODULE_FILE):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two tensors are one array of memory (``p.data = p``, ``p.data = p.detach()``)."""
    x, y = _extent(a), _extent(b)
    return x is not None and x == y


def _version(t: Any) -> int | None:
    """A tensor's version counter (None where it keeps none: made under inference_mode)."""
    try:
        return None if t.is_inference() else int(t._version)
    except (AttributeError, RuntimeError):
        return None


def _flat(values: tuple[Any, ...]) -> list[Any]:
    """The values, and what a list or tuple among them holds (``torch.cat([w, b])``, foreach ops)."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(v)
        elif v is not None:
            out.append(v)
    return out


class _Group(dict):
    """An optimizer's setting dict (``param_groups[j]``) while the loop is traced: a setting the loop
    reads (``optimizer.param_groups[0]["lr"]``, CleanRL's logged rate) through the optimizer's own
    variable that differs from the state as made is a read of the state through a variable of its own
    (see StateUse); its learner's reads and writes are its own (the watch is off in fragments)."""

    def __init__(self, group: dict[str, Any], use: StateUse, state: str, label: str) -> None:
        super().__init__(group)
        self._use, self._state, self._label = use, state, label
        self._made = {k: v for k, v in group.items() if k != "params" and isinstance(v, (bool, int, float, str))}

    def _seen(self, key: Any) -> None:
        use = self._use
        if use.on and key in self._made and dict.get(self, key) != self._made[key]:
            use.read_setting(self._state, self._label, key)

    def __getitem__(self, key: Any) -> Any:
        self._seen(key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._seen(key)
        return dict.get(self, key, default)


def _state_tensors(value: Any, label: str, torch: Any, depth: int) -> list[tuple[Any, str]]:
    """(tensor, label) for the tensors a versioned value holds: in its containers, and a module's
    parameters and buffers (``state['q'].network.0.weight``); not an optimizer's (its own)."""
    if depth > 8:
        return []
    if isinstance(value, torch.Tensor):
        return [(value, label)]
    if isinstance(value, torch.nn.Module):
        return [(t, f"{label}.{n}") for n, t in (*value.named_parameters(), *value.named_buffers())]
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_state_tensors(v, f"{label}[{k!r}]", torch, depth + 1))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.extend(_state_tensors(v, f"{label}[{i}]", torch, depth + 1))
    return out
