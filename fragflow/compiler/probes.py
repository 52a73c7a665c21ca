"""Probes: learner outputs that note, while the loop is traced, where the loop itself reads them.

Under a policy that runs a learner in another process the loop holds ``Pending`` references to
its outputs, so ``if metrics["loss"] < 0.01: break`` cannot run there. To refuse such a program
at placement (the user's line, exit 2, nothing started) rather than at its first update, the
tracer hands the loop each learner output leaf as a probe: a subclass of the leaf's own type
(``float``, ``int``, ``numpy.ndarray``, ``torch.Tensor``) that behaves exactly like it and, when
the loop (not a fragment) tests, converts, compares or computes with it, records the first such
use. Passing a probe on to a fragment or ``ff.log`` is not a read. Probes exist only during the
trace: a run that follows it starts afresh with plain values, and one that takes the loop over
from the trace (``single_process``) gets plain values from its learners from then on.

>>> reads = []
>>> with recording(reads):
...     x = probe(0.5, "learn", "[1]['loss']")
...     bool(x > 0.1)
True
>>> [(r.fragment, r.path, r.what) for r in reads]
[('learn', "[1]['loss']", 'compared with >')]
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from fragflow.compiler.ir import LoopRead
from fragflow.compiler.reach import users_code
from fragflow.source import is_internal, user_callsite

_sink: list[LoopRead] | None = None     # where reads go while the loop (not a fragment) runs

# what Pending raises on, named as its error names them
_USES = {
    "__bool__": "tested for truth", "__iter__": "iterated", "__len__": "asked for its length",
    "__float__": "converted to a number", "__int__": "converted to an int", "__index__": "used as an index",
    "__eq__": "compared with ==", "__ne__": "compared with !=", "__lt__": "compared with <",
    "__le__": "compared with <=", "__gt__": "compared with >", "__ge__": "compared with >=",
    "__add__": "used in arithmetic", "__radd__": "used in arithmetic", "__sub__": "used in arithmetic",
    "__rsub__": "used in arithmetic", "__mul__": "used in arithmetic", "__rmul__": "used in arithmetic",
    "__truediv__": "used in arithmetic", "__rtruediv__": "used in arithmetic", "__neg__": "used in arithmetic",
    "__abs__": "used in arithmetic", "__round__": "rounded",
}
# printing a learner output is not a read (the loop prints a placeholder where it runs apart), but a
# format spec (f"{loss:.3f}") needs the number
_FORMATTED = "formatted with a spec (an f-string such as {x:.3f}, format())"


_PICKLED = "pickled (torch.save, pickle.dump)"


def by_user() -> bool:
    """Whether what asks a probe for its pickling (torch.save(m), pickle.dumps(m)) or its text
    (print) is the user's code: the innermost frame that is neither a library's nor Python's is the
    user's, not fragflow's own."""
    from fragflow.compiler import watchers

    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        # (the probes' own frames, and the trace's torch mode, which passes the call on)
        if is_internal(filename) and filename not in (__file__, watchers.__file__):
            return False
        if users_code(filename):
            return True
        frame = frame.f_back   # type: ignore[assignment]
    return False


def swap_sink(into: list[LoopRead] | None) -> list[LoopRead] | None:
    """Reads of probes go to ``into`` (None: nowhere) until the next swap; returns where they went.
    :func:`recording` without a context manager's cost, for a block that records nothing (each
    fragment call the tracer runs)."""
    global _sink
    saved, _sink = _sink, into
    return saved


@contextlib.contextmanager
def recording(into: list[LoopRead] | None) -> Iterator[None]:
    """Reads of probes in this block go to ``into`` (None: not the loop, nothing is recorded)."""
    global _sink
    saved, _sink = _sink, into
    patched = into is not None and saved is None
    if patched:   # (numpy converts an array subclass without asking it: the loop's np.asarray(td) is watched)
        for name, _ in _CONVERSIONS:
            setattr(np, name, _watched(name))
    try:
        yield
    finally:
        _sink = saved
        if patched:
            unwatch()


def unwatch() -> None:
    """numpy's conversions as they were (the trace hands over: the run goes on without probes)."""
    for name, original in _CONVERSIONS:
        setattr(np, name, original)


_CONVERSIONS = tuple((name, getattr(np, name)) for name in ("asarray", "array", "ascontiguousarray"))


def _watched(name: str) -> Any:
    original = dict(_CONVERSIONS)[name]

    def convert(a: Any, *args: Any, **kwargs: Any) -> Any:
        if (type(a) is ProbeArray or isinstance(a, _SCALAR_PROBES)) and users_code(sys._getframe(1).f_code.co_filename):
            _note(a, f"converted with np.{name}()")
        return original(a, *args, **kwargs)
    convert.__name__ = convert.__qualname__ = name
    convert.__doc__ = original.__doc__
    return convert


def _note(x: Any, what: str) -> None:
    if _sink is not None and not any(r.fragment == x._ff_fragment and r.path == x._ff_path and r.what != PRINTED
                                     for r in _sink):
        _sink.append(LoopRead(x._ff_fragment, x._ff_path, what, user_callsite(3)))


PRINTED = "printed"   # a LoopRead's what for a print of the value (no read: where it runs apart, said)


def _printed(x: Any) -> None:
    """The user's code made the text of ``x`` (print, str, an f-string without a spec): where its
    fragment runs apart the loop prints a placeholder instead, which the run says (see driver)."""
    if _sink is not None and by_user() and not any(
            r.fragment == x._ff_fragment and r.path == x._ff_path and r.what == PRINTED for r in _sink):
        _sink.append(LoopRead(x._ff_fragment, x._ff_path, PRINTED, user_callsite(2)))


# operators on a scalar probe are those of its plain value, so that an operand of another type (a
# numpy array) sees a Python number: a float32 array times a probe is float32, as eagerly (NumPy
# treats a float subclass as a float64, not as a Python number, which changed what the trace computed)
_OPERATORS = {"__eq__": operator.eq, "__ne__": operator.ne, "__lt__": operator.lt, "__le__": operator.le,
              "__gt__": operator.gt, "__ge__": operator.ge, "__add__": operator.add, "__sub__": operator.sub,
              "__mul__": operator.mul, "__truediv__": operator.truediv}
_REFLECTED = {"__radd__": operator.add, "__rsub__": operator.sub, "__rmul__": operator.mul,
              "__rtruediv__": operator.truediv}


def _scalar_probe(base: type) -> type:
    def method(name: str, what: str) -> Any:
        plain = getattr(base, name)
        op = _OPERATORS.get(name)
        reflected = _REFLECTED.get(name)

        def use(self: Any, *args: Any) -> Any:
            _note(self, what)
            if op is not None:
                return op(self._ff_value, *args)
            if reflected is not None:
                return reflected(args[0], self._ff_value)
            return plain(self._ff_value, *args)
        use.__name__ = name
        return use

    ns: dict[str, Any] = {name: method(name, what) for name, what in _USES.items() if hasattr(base, name)}

    def array_ufunc(self: Any, ufunc: Any, how: str, *inputs: Any, **kwargs: Any) -> Any:
        _note(self, _UFUNC_USES.get(ufunc.__name__, "used in arithmetic"))
        return getattr(ufunc, how)(*(_plain(x) for x in inputs), **{k: _plain(v) for k, v in kwargs.items()})
    ns["__array_ufunc__"] = array_ufunc

    def formatted(self: Any, spec: str) -> str:
        if spec:
            _note(self, _FORMATTED)
        else:
            _printed(self)
        return format(self._ff_value, spec)
    ns["__format__"] = formatted

    def text(self: Any) -> str:
        _printed(self)
        return repr(self._ff_value)

    def shown(self: Any) -> str:
        _printed(self)
        return str(self._ff_value)
    ns["__repr__"], ns["__str__"] = text, shown
    ns["__hash__"] = base.__hash__
    def reduce(self: Any) -> Any:
        if _sink is not None and by_user():
            _note(self, _PICKLED)
        return base, (self._ff_value,)
    ns["__reduce__"] = reduce
    # named as its base (Python's errors name an object's type by it: range() of a probe says
    # 'numpy.float64' object cannot be interpreted as an integer, as eagerly), its qualified name a probe's
    ns["__qualname__"] = f"Probe{base.__name__.title()}"
    return type(base.__name__ if base.__module__ == "builtins" else f"{base.__module__}.{base.__name__}", (base,), ns)


ProbeFloat = _scalar_probe(float)
ProbeInt = _scalar_probe(int)
# numpy's scalars (what its reductions return: batch["obs"].std()), and the conversions they have
_NUMPY_PROBES: dict[type, type] = {t: _scalar_probe(t) for t in (np.float64, np.float32, np.int64, np.int32)}
for _probe_type in _NUMPY_PROBES.values():
    for _name, _what in (("item", "converted to a number"), ("tolist", "converted with .tolist()"),
                         ("astype", "converted with .astype()"), ("copy", "copied with .copy()")):
        def _use(self: Any, *args: Any, _name: str = _name, _what: str = _what, **kwargs: Any) -> Any:
            _note(self, _what)
            return getattr(self._ff_value, _name)(*args, **kwargs)
        setattr(_probe_type, _name, _use)
_SCALAR_PROBES = (ProbeFloat, ProbeInt, *_NUMPY_PROBES.values())


def _plain(x: Any) -> Any:
    """``x`` with the probes in it as plain numbers, arrays and tensors."""
    if isinstance(x, _SCALAR_PROBES):
        return getattr(x, "_ff_value")   # noqa: B009 - the scalar probes' classes are made at run time
    if isinstance(x, ProbeArray):
        return x.view(np.ndarray)
    if _tensor_probe is not None and isinstance(x, _tensor_probe):
        return x.as_subclass(_tensor_probe.__mro__[1])
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


class ProbeArray(np.ndarray):
    """A numpy array that notes the loop's reads (ufuncs, array functions, truth, conversions)."""

    _ff_fragment = ""
    _ff_path = ""
    _ff_element = False

    def __array_finalize__(self, obj: Any) -> None:
        self._ff_fragment = getattr(obj, "_ff_fragment", "")
        self._ff_path = getattr(obj, "_ff_path", "")
        self._ff_element = False

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _note(self, _UFUNC_USES.get(ufunc.__name__, "used in arithmetic"))
        kwargs = {k: _plain(v) for k, v in kwargs.items()}
        return getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        _note(self, f"passed to numpy.{func.__name__}")
        return func(*_plain(tuple(args)), **{k: _plain(v) for k, v in kwargs.items()})

    def __bool__(self) -> bool:
        _note(self, "tested for truth")
        return bool(self.view(np.ndarray))

    def __float__(self) -> float:
        _note(self, "converted to a number")
        return float(self.view(np.ndarray))

    def __int__(self) -> int:
        _note(self, "converted to an int")
        return int(self.view(np.ndarray))

    def __index__(self) -> int:
        _note(self, "used as an index")
        return self.view(np.ndarray).__index__()

    def __iter__(self) -> Any:
        _note(self, "iterated")
        return iter(self.view(np.ndarray))

    def __len__(self) -> int:
        _note(self, "asked for its length")
        return len(self.view(np.ndarray))

    def item(self, *args: Any) -> Any:
        _note(self, "converted to a number")
        return self.view(np.ndarray).item(*args)

    def __format__(self, spec: str) -> str:
        if spec:
            _note(self, _FORMATTED)
        else:
            _printed(self)
        return format(self.view(np.ndarray), spec)

    def tolist(self) -> Any:
        _note(self, "converted with .tolist()")
        return self.view(np.ndarray).tolist()

    def tobytes(self, *args: Any, **kwargs: Any) -> bytes:
        _note(self, "converted with .tobytes()")
        return self.view(np.ndarray).tobytes(*args, **kwargs)

    def copy(self, *args: Any, **kwargs: Any) -> Any:   # (a copy the loop keeps is data it holds)
        _note(self, "copied with .copy()")
        return self.view(np.ndarray).copy(*args, **kwargs)

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        _note(self, "converted with .astype()")
        return self.view(np.ndarray).astype(*args, **kwargs)

    def __repr__(self) -> str:   # as the plain value prints (printing is not a read)
        _printed(self)
        plain = self.view(np.ndarray)
        return repr(plain[()] if self._ff_element and plain.ndim == 0 else plain)

    def __hash__(self) -> int:  # type: ignore[override]  # an element is a numpy scalar eagerly: a dict key
        plain = self.view(np.ndarray)
        if plain.ndim:
            raise TypeError("unhashable type: 'numpy.ndarray'")
        _note(self, "used as a dict key")
        return hash(plain[()])

    def __getitem__(self, key: Any) -> Any:
        if _sink is not None and users_code(sys._getframe(1).f_code.co_filename):   # (not numpy's own, printing it)
            if element_keys(key):   # the loop takes an element: a probe of its own
                return element(np.asarray(self.view(np.ndarray)[key]), self._ff_fragment, self._ff_path + _keyed(key))
            _note(self, f"indexed with {index_text(key)}")   # (a part of it: not an output the graph can carry)
        return super().__getitem__(key)

    def __str__(self) -> str:   # as the plain value prints (printing is not a read)
        _printed(self)
        plain = self.view(np.ndarray)
        return str(plain[()] if self._ff_element and plain.ndim == 0 else plain)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if _sink is not None and by_user():
            _note(self, _PICKLED)
        return self.view(np.ndarray).__reduce_ex__(protocol)   # (a plain array, as unpickled eagerly)


def element_keys(key: Any) -> tuple[int, ...]:
    """The indices an element's key takes, one per axis (``v[0]``, ``v[np.int64(1)]``, ``v[0, 3]``
    as ``v[0][3]``): what ``Pending`` follows too, a key at a time; () for any other key."""
    keys = key if isinstance(key, tuple) else (key,)
    if keys and all(isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)) for k in keys):
        return tuple(int(k) for k in keys)
    return ()


def index_text(key: Any) -> str:
    """``key`` as the user wrote it in brackets: ``[:, 0]``, ``[1:2, ...]``."""
    def one(k: Any) -> str:
        if isinstance(k, slice):
            text = f"{'' if k.start is None else k.start}:{'' if k.stop is None else k.stop}"
            return text if k.step is None else f"{text}:{k.step}"
        return "..." if k is Ellipsis else repr(k)
    return f"[{', '.join(one(k) for k in key) if isinstance(key, tuple) else one(key)}]"


def _keyed(key: Any) -> str:
    return "".join(f"[{k!r}]" for k in element_keys(key))


_UFUNC_USES = {"greater": "compared with >", "less": "compared with <", "greater_equal": "compared with >=",
               "less_equal": "compared with <=", "equal": "compared with ==", "not_equal": "compared with !="}

_TENSOR_FREE = frozenset({"__getitem__", "__repr__", "__str__", "__reduce_ex__", "__deepcopy__"})
_tensor_probe: Any = None   # the tensor probe class, once torch is used


def _torch_probe() -> type:
    """The tensor probe, made on first use (torch is imported only by programs that use it)."""
    global _tensor_probe
    if _tensor_probe is None:
        import torch

        class ProbeTensor(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = getattr(func, "__name__", "")
                if name == "__getitem__" and _sink is not None and len(args) == 2 and isinstance(args[0], cls) \
                        and users_code(_past_watchers(sys._getframe(1)).f_code.co_filename):   # (not torch's printing)
                    if element_keys(args[1]):   # the loop takes an element: a probe of its own (ff.log of it is logged as such)
                        taken: Any = args[0]
                        return element(func(*_plain(tuple(args))), taken._ff_fragment, taken._ff_path + _keyed(args[1]))
                    _note(args[0], f"indexed with {index_text(args[1])}")   # (a part of it, as a numpy probe's)
                elif name in ("__format__", "__repr__", "__str__") and not (len(args) > 1 and args[1]):
                    if _sink is not None and args and isinstance(args[0], cls):
                        _printed(args[0])   # printed, no spec: not a read
                elif name == "__reduce_ex__" and _sink is not None and args and isinstance(args[0], cls):
                    if by_user():
                        _note(args[0], _PICKLED)
                elif name not in _TENSOR_FREE and not name.startswith("__get__") and not name.startswith("__set__"):
                    # (a list of them too: torch.stack(losses), torch.cat)
                    for a in (x for arg in args for x in (arg if isinstance(arg, (list, tuple)) else (arg,))):
                        if isinstance(a, cls):
                            op = name.strip("_")
                            _note(a, _FORMATTED if name == "__format__" else
                                  _USES.get(name) or _USES.get(f"__{op}__") or f"used in a torch operation ({op})")
                            break
                return func(*_plain(tuple(args)), **{k: _plain(v) for k, v in (kwargs or {}).items()})

        _tensor_probe = ProbeTensor
    return _tensor_probe


def _past_watchers(frame: Any) -> Any:
    """The frame that called torch, past the trace's function mode (see watchers.StateUse.mode)."""
    from fragflow.compiler import watchers

    while frame.f_back is not None and frame.f_code.co_filename == watchers.__file__:
        frame = frame.f_back
    return frame


def probe(leaf: Any, fragment: str, path: str) -> Any:
    """``leaf`` as a probe (the same value and type), or ``leaf`` itself where none applies."""
    if type(leaf) is float:   # exact types: bool (an int) and numpy's float64 (a float) stay as they are
        out: Any = ProbeFloat(leaf)
        out._ff_value = leaf
    elif type(leaf) is int:
        out = ProbeInt(leaf)
        out._ff_value = leaf
    elif type(leaf) in _NUMPY_PROBES:
        out = _NUMPY_PROBES[type(leaf)](leaf)
        out._ff_value = leaf
    elif isinstance(leaf, np.ndarray) and type(leaf) is np.ndarray:
        out = leaf.view(ProbeArray)
    elif type(leaf).__name__ == "Tensor" and type(leaf).__module__.startswith("torch"):
        out = leaf.as_subclass(_torch_probe())
    else:
        return leaf
    out._ff_fragment, out._ff_path = fragment, path
    return out


def element(leaf: Any, fragment: str, path: str) -> Any:
    """An element the loop took out of a learner output (``metrics["v"][0]``): a probe whose path
    goes on into the output, so that the tracer knows where it came from (see Recording._origin)."""
    out = probe(leaf, fragment, path)
    if out is not leaf:
        out._ff_element = True
    return out


def probed(out: Any, fragment: str, path: str = "") -> Any:
    """A fragment output with every leaf a probe; dicts and lists are filled in place (a container
    the loop passes on whole keeps its identity), tuples are rebuilt."""
    if isinstance(out, dict):
        for k in list(out):
            out[k] = probed(out[k], fragment, f"{path}[{k!r}]")
        return out
    if isinstance(out, list):
        for i, v in enumerate(out):
            out[i] = probed(v, fragment, f"{path}[{i}]")
        return out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(probed(v, fragment, f"{path}[{i}]") for i, v in enumerate(out))
    return probe(out, fragment, path)

