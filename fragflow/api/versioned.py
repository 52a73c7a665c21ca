"""Versioned state: values one learner writes and other fragments read.

``ff.versioned(x)`` marks ``x`` (a pytree of arrays: parameters, optimizer state) as shared
state. Every learner call that writes it produces the next version. Fragments receive it as an
argument, whole or as a view (``state["params"]``), and the runtime hands them the value of the
version their placement allows: under ``single_process`` the latest, on a distributed policy the
newest one broadcast to that process. The loop itself reads a versioned value only under
``single_process`` (as eagerly); a placement over several processes refuses such a read.

>>> v = Versioned("state", 0, {"params": {"w": 1.0}}, None)
>>> v["params"].resolve(v.value)
{'w': 1.0}
"""

from __future__ import annotations

import copy
import functools
import operator
from typing import Any

from fragflow import context
from fragflow.errors import MissingOutputIndexError, MissingOutputKeyError, TraceError, VersionedStateError
from fragflow.source import SourceLoc, user_callsite


def _misuse(what: str) -> VersionedStateError:
    return VersionedStateError(
        f"versioned state was {what} in the training loop",
        where=user_callsite(2),
        fix="pass the versioned state (or a view of it such as state['params']) to a fragment "
            "and compute with it there; the loop only moves it between fragments",
    )


def _loop_value(x: Any, what: str | None) -> Any:
    """The value a read of versioned state in the loop sees where the interpreter allows it: one
    process running the loop and every learner (``single_process``, as eagerly; the trace, which
    notes the read so that a placement over several processes refuses it before running); the
    read is refused everywhere else. A view reads what it named when it was made, as eagerly
    ``state["w"][0]`` is that element then, whatever the learner writes later. ``what`` None:
    printed (not a read); returns ``_UNSEEN`` where it may not be read."""
    read = getattr(context.current(), "read_state", None)
    found, value = (False, None) if read is None or not isinstance(x, (Versioned, VersionedView)) else read(x, what)
    if not found:
        if what is None:
            return _UNSEEN
        if isinstance(x, Pending):   # (a learner's output, not versioned state: f"{m['loss']:.4f}", -m['loss'])
            raise _pending_misuse(x, what)
        raise _misuse(what)
    return x.seen if isinstance(x, VersionedView) and x.seen is not _UNSEEN else value


_UNSEEN: Any = object()


def _index(value: Any, key: Any) -> Any:
    """``value[key]`` where it can be taken (what a view names when made), else ``_UNSEEN``."""
    if value is None or value is _UNSEEN:
        return _UNSEEN
    try:
        return value[key]
    except Exception:
        return _UNSEEN


def own_value(x: Versioned | VersionedView) -> Any:
    """The value a handle holds, or a view names in its handle's value (no version chosen)."""
    return x.value if isinstance(x, Versioned) else x.resolve(x.handle.value)


class _NoLoopUse:
    """Refuse every way plain loop code could read a versioned value (but see ``_loop_value``)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return bool(_loop_value(self, "tested for truth"))

    def __iter__(self) -> Any:
        return iter(_loop_value(self, "iterated"))

    def __len__(self) -> int:
        return len(_loop_value(self, "asked for its length"))

    def __array__(self, *a: Any, **k: Any) -> Any:
        import numpy as np

        return np.asarray(_loop_value(self, "converted to an array"), *a, **k)

    def __float__(self) -> float:
        return float(_loop_value(self, "converted to a number"))

    def __format__(self, spec: str) -> str:
        if not spec:   # printed: the value where the loop may read it, else the placeholder (see __repr__)
            return str(self)
        return format(_loop_value(self, "formatted with a spec (an f-string such as {x:.3f}, format())"), spec)

    def __str__(self) -> str:
        value = _loop_value(self, None)
        return repr(self) if value is _UNSEEN else str(value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:   # a module the state holds, called in the loop
        return _loop_value(self, "called")(*args, **kwargs)

    def __copy__(self) -> Any:   # a copy of the value, as eagerly (not of the handle)
        return copy.copy(_loop_value(self, "copied"))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:   # copy.deepcopy(state["q"]): a target network
        return copy.deepcopy(_loop_value(self, "copied (copy.deepcopy)"), memo)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        # a NamedTuple state's field (state.w) is its entry, a view as state[0] is: what the loop passes on
        held = self.value if isinstance(self, Versioned) else self.seen if isinstance(self, VersionedView) else None
        fields = getattr(type(held), "_fields", None) if isinstance(held, tuple) else None
        if fields is not None and name in fields:
            return self[fields.index(name)]   # type: ignore[index]
        return getattr(_loop_value(self, f"read as attribute '.{name}'"), name)

    __hash__ = object.__hash__


def _read(what: str, op: Any, reflected: bool = False) -> Any:
    def method(self: Any, *args: Any) -> Any:
        value = _loop_value(self, what)
        return op(args[0], value) if reflected else op(value, *args)
    return method


# Comparisons and arithmetic would otherwise fall back to identity (``state["n"] == 1`` is silently
# False) or raise Python's own TypeError far from the cause.
for _dunder, _what, _op, _reflected in (
        ("__eq__", "compared with ==", operator.eq, False), ("__ne__", "compared with !=", operator.ne, False),
        ("__lt__", "compared with <", operator.lt, False), ("__le__", "compared with <=", operator.le, False),
        ("__gt__", "compared with >", operator.gt, False), ("__ge__", "compared with >=", operator.ge, False),
        ("__int__", "converted to an int", int, False), ("__index__", "used as an index", operator.index, False),
        ("__add__", "used in arithmetic", operator.add, False), ("__radd__", "used in arithmetic", operator.add, True),
        ("__sub__", "used in arithmetic", operator.sub, False), ("__rsub__", "used in arithmetic", operator.sub, True),
        ("__mul__", "used in arithmetic", operator.mul, False), ("__rmul__", "used in arithmetic", operator.mul, True),
        ("__truediv__", "used in arithmetic", operator.truediv, False),
        ("__rtruediv__", "used in arithmetic", operator.truediv, True),
        ("__mod__", "used in arithmetic", operator.mod, False), ("__neg__", "used in arithmetic", operator.neg, False)):
    setattr(_NoLoopUse, _dunder, _read(_what, _op, _reflected))


class Versioned(_NoLoopUse):
    """One version of a shared state. ``value`` is None where this process holds no copy."""

    __slots__ = ("name", "version", "value", "created_at")

    def __init__(self, name: str, version: int, value: Any, created_at: SourceLoc | None) -> None:
        self.name = name
        self.version = version
        self.value = value
        self.created_at = created_at

    def __getitem__(self, key: Any) -> VersionedView:
        return VersionedView(self, (key,), _index(self.value, key))

    def __repr__(self) -> str:
        return f"Versioned({self.name!r}, v{self.version})"


class VersionedView(_NoLoopUse):
    """A sub-tree of a versioned state (``state["params"]``): what an actor usually reads."""

    __slots__ = ("handle", "path", "seen")

    def __init__(self, handle: Versioned, path: tuple[Any, ...], seen: Any = _UNSEEN) -> None:
        self.handle = handle
        self.path = path
        self.seen = seen   # what it named when made (see _loop_value), if its handle held a value

    def __getitem__(self, key: Any) -> VersionedView:
        return VersionedView(self.handle, self.path + (key,), _index(self.seen, key))

    @property
    def path_str(self) -> str:
        try:
            return _path_str(self.path)
        except TypeError:   # (an unhashable key)
            return "".join(f"[{k!r}]" for k in self.path)

    def resolve(self, value: Any) -> Any:
        for k in self.path:
            value = value[k]
        return value

    def __repr__(self) -> str:
        return f"{self.handle!r}{self.path_str}"


def versioned(value: Any, name: str = "state") -> Any:
    """Mark ``value`` as state one learner writes and other fragments read.

    Eagerly (no interpreter active) the value is returned unchanged.

    >>> versioned({"w": 1.0})
    {'w': 1.0}
    """
    if not isinstance(name, str):   # (name=["s"] failed as "unhashable type: 'list'"; name=5 ran on, unnamed)
        raise TraceError(f"ff.versioned got name={name!r:.60}, where it takes the state's name, a string",
                         where=user_callsite(), fix='write ff.versioned(value, name="target"), or leave name out '
                                                    '("state")')
    interp = context.current()
    if interp is None:
        return value
    return interp.versioned(value, name, user_callsite())


class Pending(_NoLoopUse):
    """The output of a fragment that runs in another process, seen from the loop.

    It may be passed on, to ``ff.log`` or to another fragment of that process (``learn(state,
    batch)`` with ``batch`` from a replay buffer's ``sample`` on the learner), which resolves it
    there; any read in the loop raises, naming the fragment and the way out. ``index`` is the
    output's place in a tuple output (-1: the whole output), ``path_keys`` the path into it, ``call``
    which of the fragment's calls in this loop made it (-1: unknown).
    """

    __slots__ = ("fragment", "index", "path_keys", "call", "skel", "trip", "spread", "enumerated")

    def __init__(self, fragment: str, index: int, keys: tuple[Any, ...] = (), call: int = -1,
                 skel: Any = None, trip: int = -1, spread: Pending | None = None) -> None:
        self.fragment = fragment
        self.index = index
        self.path_keys = keys
        self.call = call
        self.skel = skel   # its value as traced, without leaves (see pytree.skeleton_of), where known
        self.trip = trip   # the trip of the loop's top-level loop it was made in (-1: unknown)
        # the dict it is an entry of, where taken as that dict was spread or walked whole ({**metrics},
        # metrics.items()): a dict of every such entry is logged as the dict, with the keys its later
        # calls add (see LoopLogs)
        self.spread = spread
        self.enumerated = 0   # (its keys were asked for: as many entries taken next are spread)

    # Its containers are those of its traced value (``skel``): a dict's keys, a list's or a tuple's
    # length are known here, their leaves are outputs of their own (``{**metrics, "eps": eps}``,
    # ``for k, v in metrics.items()``); a key the traced value lacks fails as eagerly, with the reason.
    def __getitem__(self, key: Any) -> Pending:
        skel = self.skel
        sub = None
        if isinstance(skel, (list, tuple)) and isinstance(key, slice):   # (entries of their own, as eagerly a list or tuple)
            part = [self[i] for i in range(len(skel))[key]]
            return part if isinstance(skel, list) else tuple(part)   # type: ignore[return-value]
        if isinstance(skel, (list, tuple)) and type(key) is int and -len(skel) <= key < 0:
            key += len(skel)   # (the part's entries are reported by their places)
        if isinstance(skel, (dict, list, tuple)):
            try:
                sub = skel[key]
            except KeyError:
                raise self._missing(key, MissingOutputKeyError, f"has no key {key!r}") from None
            except IndexError:
                raise self._missing(key, MissingOutputIndexError, f"has no index {key!r}") from None
            except TypeError:   # (a key of another kind: a field's name of a namedtuple, found by name)
                sub = None
        spread = self if self.enumerated > 0 else None
        if spread is not None:
            self.enumerated -= 1
        if isinstance(key, tuple) and not isinstance(skel, (dict, list, tuple)):
            from fragflow.compiler.probes import element_keys

            keys = element_keys(key)
            if keys:   # an array's element by one key per axis (v[0, 3]): v[0][3], as traced
                return Pending(self.fragment, self.index, self.path_keys + keys, self.call, None, self.trip)
        return Pending(self.fragment, self.index, self.path_keys + (key,), self.call, sub, self.trip, spread)

    def _missing(self, key: Any, kind: type[VersionedStateError], what: str) -> VersionedStateError:
        skel = self.skel
        held = f"keys {sorted(map(str, skel))}" if isinstance(skel, dict) else f"{len(skel)} entries"
        return kind(f"output {'' if self.index < 0 else f'[{self.index}]'}{self.path} of fragment '{self.fragment}' "
                    f"{what}: as traced it is a {type(skel).__name__} with {held} (that fragment runs in another "
                    "process under this policy; the loop indexes its value as traced)", where=user_callsite(2),
                    fix="index it by the keys it returns (those of its first calls: return every key from the first "
                        "call on, a value that is not ready yet as NaN), or run with --policy single_process")

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The traced value's container type where it is one (``isinstance(metrics, dict)`` holds as it does
        eagerly: a loop that logs only a dict logged nothing apart); ``type()`` still says Pending."""
        skel = self.skel
        return type(skel) if isinstance(skel, (dict, list, tuple)) else Pending

    def __iter__(self) -> Any:
        """A tuple or list of known length (``state, (loss, info) = learn(...)``) unpacks into its
        parts, each passed on as an output of its own, and a dict into its keys, as traced; anything
        else cannot be iterated here."""
        if isinstance(self.skel, (list, tuple)):
            return iter([self[i] for i in range(len(self.skel))])
        if isinstance(self.skel, dict):
            self.enumerated = len(self.skel)
            return iter(list(self.skel))
        raise _pending_misuse(self, "iterated")

    def __len__(self) -> int:
        if isinstance(self.skel, (list, tuple, dict)):
            return len(self.skel)
        raise _pending_misuse(self, "asked for its length")

    def __getattr__(self, name: str) -> Any:   # (a learner's output, not versioned state: td.tolist())
        if name.startswith("__"):
            raise AttributeError(name)
        fields = getattr(type(self.skel), "_fields", None) if isinstance(self.skel, tuple) else None
        if fields is not None:   # a namedtuple's field (metrics.loss): its entry, an output of its own
            if name in fields:
                return self[fields.index(name)]
            if name == "_asdict":
                return lambda: {f: self[i] for i, f in enumerate(fields)}
        raise _pending_misuse(self, f"read as attribute '.{name}'")

    def keys(self) -> Any:
        """A dict's keys as traced (``{**metrics, "x": x}`` unpacks it into its entries)."""
        if isinstance(self.skel, dict):
            self.enumerated = len(self.skel)
            return list(self.skel)
        raise VersionedStateError(
            f"output {'' if self.index < 0 else f'[{self.index}]'}{self.path} of fragment '{self.fragment}' was "
            "unpacked (**) or asked for its keys in the loop, but that fragment runs in another process under this "
            "policy, and its traced value is not a dict", where=user_callsite(2),
            fix="log it as it is returned and the loop's values in a call of their own: ff.log(metrics); "
                "ff.log({'x': x}) (or run with --policy single_process)")

    def items(self) -> Any:
        """A dict's entries as traced, each value an output of its own."""
        if isinstance(self.skel, dict):
            self.enumerated = len(self.skel)
            return [(k, self[k]) for k in self.skel]
        raise _pending_misuse(self, "read as attribute '.items'")

    def values(self) -> Any:
        if isinstance(self.skel, dict):
            self.enumerated = len(self.skel)
            return [self[k] for k in self.skel]
        raise _pending_misuse(self, "read as attribute '.values'")

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(self.skel, dict):
            return self[key] if key in self.skel else default
        raise _pending_misuse(self, "read as attribute '.get'")

    def copy(self) -> Any:
        """A dict's copy: a dict of its entries, each an output of its own."""
        if isinstance(self.skel, dict):
            return dict(self.items())
        raise _pending_misuse(self, "read as attribute '.copy'")

    def __or__(self, other: Any) -> Any:   # (metrics | {"eps": eps})
        if isinstance(self.skel, dict) and isinstance(other, dict):
            return {**dict(self.items()), **other}
        raise _pending_misuse(self, "used with |")

    def __ror__(self, other: Any) -> Any:
        if isinstance(self.skel, dict) and isinstance(other, dict):
            return {**other, **dict(self.items())}
        raise _pending_misuse(self, "used with |")

    @property
    def path(self) -> str:
        return "".join(f"[{k!r}]" for k in self.path_keys)

    def resolve(self, out: Any) -> Any:
        """This output's value, given the whole output of its fragment's call."""
        value = out if self.index < 0 else out[self.index]
        for k in self.path_keys:
            value = value[k]
        return value

    def __repr__(self) -> str:
        where = "" if self.index < 0 else f"[{self.index}]"
        return f"Pending({self.fragment}{where}{self.path})"

    def __reduce_ex__(self, protocol: Any) -> Any:   # (torch.save(m), pickle.dumps(m) in the loop)
        raise _pending_misuse(self, "pickled (torch.save, pickle.dump)")


def _pending_misuse(self: Pending, what: str) -> VersionedStateError:
    return VersionedStateError(
        f"output {'' if self.index < 0 else f'[{self.index}]'}{self.path} of fragment '{self.fragment}' was {what} "
        "in the loop, but that fragment runs in another process under this policy",
        where=user_callsite(3),
        fix="send its outputs to ff.log or to fragments placed with it, or make what the loop needs part of the "
            "versioned state (or run with --policy single_process)")


for _name, _what in (("__bool__", "tested for truth"),
                     ("__array__", "converted to an array"), ("__float__", "converted to a number"),
                     ("__int__", "converted to an int"), ("__index__", "used as an index"),
                     ("__eq__", "compared with =="), ("__ne__", "compared with !="), ("__lt__", "compared with <"),
                     ("__le__", "compared with <="), ("__gt__", "compared with >"), ("__ge__", "compared with >="),
                     ("__add__", "used in arithmetic"), ("__radd__", "used in arithmetic"),
                     ("__sub__", "used in arithmetic"), ("__mul__", "used in arithmetic"),
                     ("__rmul__", "used in arithmetic"), ("__truediv__", "used in arithmetic"), ("__call__", "called")):
    def _raiser(self: Pending, *a: Any, _what: str = _what, **k: Any) -> Any:
        raise _pending_misuse(self, _what)
    setattr(Pending, _name, _raiser)


def pendings_in(x: Any, depth: int = 0) -> list[Pending]:
    """The references to outputs held elsewhere (``Pending``) in ``x``'s dicts, lists and tuples."""
    if isinstance(x, Pending):
        return [x]
    if depth > 8:
        return []
    if isinstance(x, dict):
        return [p for v in x.values() for p in pendings_in(v, depth + 1)]
    if isinstance(x, (list, tuple)):
        return [p for v in x for p in pendings_in(v, depth + 1)]
    return []


@functools.lru_cache(maxsize=256)
def _path_str(path: tuple[Any, ...]) -> str:
    """A view's path as its keys index it (``['q']``): a view is made at every step (``state["q"]``)."""
    return "".join(f"[{k!r}]" for k in path)
