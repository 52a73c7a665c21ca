"""What a fragment's code reaches besides its arguments, and pictures of that data to see whether the
loop changed it since (:func:`snapshot`, :func:`changed_part`).

A fragment sees versioned state only through its arguments: that is how a placement hands it the
version it may act with. The tracer asks, on a fragment's first call, what its closure and the
globals its code names hold (a ``Versioned`` handle, or an object a versioned state holds, such as
its ``nn.Module``), and which data its code reads there, two calls deep (:func:`reached_data`).
A fragment that reaches a handle that way runs in the loop's own process with the handle's value in
its place (:func:`handles_as_values`), as it does eagerly; placements over several processes refuse it.
Whether a fragment changed what it was given in place, and whether a learner's new state is shaped
like the one it was given, are checked in :mod:`fragflow.compiler.statecheck`.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import sys
import sysconfig
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler.statecheck import fingerprint
from fragflow.source import is_internal


def objects_of(value: Any) -> list[Any]:
    """The objects a versioned value holds that code could keep a reference to: its containers,
    modules (and their submodules and parameters), optimizers, tensors and arrays."""
    out: list[Any] = []
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, (str, bytes, int, float, bool)) or x is None:
            continue
        out.append(x)
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "modules") and hasattr(x, "parameters"):   # an nn.Module
            out.extend(m for m in x.modules() if m is not x)
            out.extend(x.parameters())
    return out


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Globals a function's code (and the functions and comprehensions nested in it) looks up or
    binds: its LOAD/STORE_GLOBAL (and LOAD_NAME) names, not attribute names (``np.log`` is no
    global ``log``)."""
    names = [ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_OPS]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME"})


@functools.lru_cache(maxsize=1024)
def _bound_globals(code: types.CodeType) -> frozenset[str]:
    """Globals a function's code (or code nested in it) binds itself (``global n; n += 1``)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _bound_globals(const)
    return frozenset(names)


def _holders(fn: Any) -> Iterator[tuple[str, str, Any, Any]]:
    """(``"closure variable"`` or ``"global"``, name, value, holder) for what ``fn``'s code can
    reach without its arguments: its closure's cells and the globals its code names; the holder
    (a cell, or the globals dict) is where the value can be swapped."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            yield "closure variable", name, cell.cell_contents, cell
        except ValueError:   # not assigned yet
            continue
    scope = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        if name in scope:
            yield "global", name, scope[name], scope


def _own_loads(code: types.CodeType, ops: frozenset[str]) -> set[str]:
    """Names ``code`` loads with ``ops``, its comprehensions' included, not those of the functions
    defined in it (a learner defined in the training function reads on its own account)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ops}
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and const.co_name.startswith("<") and const.co_name != "<lambda>":
            names |= _own_loads(const, ops)
    return names


def attributes_read(code: types.CodeType) -> set[str]:
    """The attribute and method names ``code`` reads (``env.single_action_space.sample()``), its
    comprehensions' included."""
    return _own_loads(code, frozenset({"LOAD_ATTR", "LOAD_METHOD"}))


def bound_globals(fn: Any) -> list[tuple[dict[str, Any], str]]:
    """The globals ``fn``'s own code rebinds (``global SHIFT; SHIFT = SHIFT + 1``): (its module's
    globals, name) each; whether a call did, the caller sees by what the name holds after it."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", None)
    if code is None or not isinstance(scope, dict):
        return []
    return [(scope, name) for name in sorted(_bound_globals(code))]


def function_loads_global(fn: Any, scope: dict[str, Any], name: str) -> bool:
    """Whether ``fn``'s own code (the training loop's) reads the global ``name`` of the module
    whose globals are ``scope``."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return code is not None and getattr(fn, "__globals__", None) is scope and \
        name in _own_loads(code, frozenset({"LOAD_GLOBAL", "LOAD_NAME"}))


def function_reads(fn: Any, label: str, value_id: int) -> bool:
    """Whether ``fn``'s own code (the training loop's) reads the data :func:`mutable_data` labels
    ``label`` (``"global 'LOSSES'"``, ``"closure variable 'losses'"``) whose ``id`` is ``value_id``:
    a global it names (that same object, in its own module), or a variable of its own that a
    function defined in it holds in its closure."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    kind, _, quoted = label.partition(" '")
    name = quoted.rstrip("'")
    if code is None or not name:
        return False
    if kind == "global":
        return id(getattr(fn, "__globals__", {}).get(name)) == value_id and \
            name in _own_loads(code, frozenset({"LOAD_GLOBAL", "LOAD_NAME"}))
    return (name in code.co_cellvars or name in code.co_freevars) and \
        name in _own_loads(code, frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"}))


def mutable_data(fn: Any) -> list[tuple[str, Any]]:
    """(``"global 'NAME'"`` or ``"closure variable 'NAME'"``, value) for the arrays, tensors, lists
    and dicts a fragment's code reaches without its arguments: data it could change in place, or
    read after another fragment changed it (versioned state and its objects are checked apart)."""
    out = []
    for kind, name, value, _ in _holders(fn):
        if isinstance(value, (Versioned, VersionedView)) or _handles(value):
            continue
        if isinstance(value, np.ndarray) or type(value).__name__ == "Tensor" or \
                (type(value) in (list, dict) and len(value) <= 4096):
            out.append((f"{kind} '{name}'", value))
    return out


def reached_data(fn: Any) -> list[tuple[str, Any, str, Any, Any]]:
    """(label, holder, name, value, snapshot) for what a fragment's code reaches without its
    arguments and could see changed by the loop between its calls: the globals and closure
    variables it names, the attributes of its own object (``self.epsilon``) and of the user's
    modules (``cfg.EPS``) it names, and what the user's helper functions it calls reach in turn;
    but for modules, functions, classes, versioned state and what its code binds itself
    (``global n; n += 1``, ``self.n += 1``: its own)."""
    out = []
    for label, holder, name, value, parts in _reached_holders(fn, 0, set()):
        if isinstance(value, (Versioned, VersionedView, types.ModuleType, type)) or _handles(value) or \
                (callable(value) and not isinstance(value, (np.ndarray, dict, list)) and not _is_module(value)) or \
                name.startswith("__"):
            continue
        if label.startswith("attribute") and isinstance(value, np.ndarray) and value.size > ATTRIBUTE_ARRAY_MAX:
            continue   # (an object's storage, a buffer's: fingerprinting it at every check costs too much)
        out.append((label, holder, name, value, Parts(value, parts) if parts is not None else snapshot(value)))
    return out


class Parts:
    """A snapshot of only the keys of a dict (or attributes of a namespace) a fragment's code reads
    by name (``CFG["gamma"]``, ``CFG.get("gamma")``, ``NS.gamma``): the loop changing another key
    changes nothing it sees."""

    __slots__ = ("parts", "picture")

    def __init__(self, value: Any, parts: frozenset[tuple[str, Any]]) -> None:
        self.parts = parts
        self.picture = parts_picture(value, sorted(parts, key=repr))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Parts) and other.picture == self.picture

    __hash__ = None   # type: ignore[assignment]


class Reached:
    """What a fragment served in another process reaches of the loop's module data (``labels``, as
    :func:`reached_data` names them), as it was when the fragment was sent there (its copy): whether
    the loop changed it since. An entry holding more than ``EVERY_CALL_MAX`` array elements (a
    whole array, a module's tensors) is checked only at the calls ``due`` says (a checksum of a
    DQN-sized network is some 40 us, a call's worth); the others at every call (a dict's key read by
    name, a number: a microsecond or two)."""

    def __init__(self, fn: Any, labels: tuple[str, ...]) -> None:
        self.entries = [(label, holder, name, before, sorted(before.parts, key=repr) if isinstance(before, Parts)
                         else None, _elements(value, before) > EVERY_CALL_MAX)
                        for label, holder, name, value, before in reached_data(fn) if label in labels]

    def changed(self, due: bool) -> str:
        """The first entry the loop changed (its label and the changed key), or ""."""
        for label, holder, name, before, named, heavy in self.entries:
            if heavy and not due:
                continue
            now = reached_now(holder, name)
            if named is not None and parts_picture(now, named) == before.picture:
                continue
            after = again(now, before)
            if after != before:
                return label + changed_part(before, after)
        return ""


def _elements(value: Any, before: Any = None, depth: int = 0) -> int:
    """How many array elements a snapshot of ``value`` (``before``: of its parts) takes a checksum of."""
    if isinstance(before, Parts):
        attrs = value if isinstance(value, dict) else _instance_dict(value)
        return sum(_elements(attrs.get(k)) for _, k in before.parts)
    if isinstance(value, np.ndarray) or type(value).__name__ == "Tensor":
        return int(value.size if isinstance(value, np.ndarray) else value.numel())
    if _is_module(value):
        return sum(int(t.numel()) for t in (*value.parameters(), *value.buffers()))
    if depth < 3 and isinstance(value, types.SimpleNamespace):
        value = vars(value)
    if depth < 3 and isinstance(value, dict) and len(value) <= 4096:
        return sum(_elements(v, None, depth + 1) for v in value.values())
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= 4096:
        return sum(_elements(v, None, depth + 1) for v in value)
    return 0


def parts_picture(value: Any, named: list[tuple[str, Any]]) -> Any:
    """A snapshot of the keys (or attributes) ``named`` of ``value`` (see :class:`Parts`)."""
    if isinstance(value, dict):
        seen = {k: value.get(k, _GONE) for kind, k in named if kind == "key"}
    else:
        attrs = _instance_dict(value)
        seen = {k: attrs.get(k, _GONE) for kind, k in named if kind == "attr"}
    return snapshot(seen)


def again(value: Any, before: Any) -> Any:
    """A snapshot of ``value`` now, of the same parts as ``before``."""
    return Parts(value, before.parts) if isinstance(before, Parts) else snapshot(value)


ATTRIBUTE_ARRAY_MAX = 1 << 16
EVERY_CALL_MAX = 1 << 10
HELPER_DEPTH = 2


def _reached_holders(fn: Any, depth: int, seen: set[int], theirs: Theirs | None = None
                     ) -> Iterator[tuple[str, Any, str, Any, frozenset[tuple[str, Any]] | None]]:
    """(label, holder, name, value, parts): ``_holders`` of ``fn``, but for the globals its code
    binds itself, and, in the user's code, the attributes of a method's own object, of a user
    module and of a user class (a config namespace) that its code names, and what is reached in
    turn (``HELPER_DEPTH`` deep) through the user's functions it names, the methods and properties
    of its own object, and a user module's functions; ``parts``: the keys or attributes of it the
    code reads by name, where that is all it does with it (None: the whole of it). ``theirs``:
    attributes of its object that the object's fragments change themselves."""
    f = getattr(fn, "__func__", fn)
    code = getattr(f, "__code__", None)
    if code is None or id(code) in seen:
        return
    seen.add(id(code))
    via = f" (through '{f.__name__}')" if depth else ""
    pairs, stored = _attribute_names(code)
    deeper = depth < HELPER_DEPTH
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, (types.ModuleType, type)) and code.co_argcount \
            and users_code(code.co_filename):
        me = code.co_varnames[0]
        attrs = _instance_dict(owner)
        if theirs is None:
            theirs = _theirs(type(owner), code, [name for var, name in pairs if var == me])
        for var, name in pairs:
            if var != me:
                continue
            if name in attrs:
                held = attrs[name]
                if name not in stored and name not in theirs.stored and not (name in theirs.named and _mutable(held)):
                    yield f"attribute '{me}.{name}'{via}", attrs, name, held, None
                continue
            member = _class_member(type(owner), name)
            if deeper and isinstance(member, property) and isinstance(member.fget, types.FunctionType):
                yield from _reached_holders(types.MethodType(member.fget, owner), depth + 1, seen, theirs)
            elif deeper and isinstance(member, types.FunctionType) and users_code(member.__code__.co_filename):
                yield from _reached_holders(types.MethodType(member, owner), depth + 1, seen, theirs)
    own = _bound_globals(code)
    named = _parts_read(code)
    for kind, name, value, holder in _holders(fn):
        if kind == "global" and name in own:
            continue
        parts = named.get(name)
        if parts is not None and not (isinstance(value, dict) and all(kind == "key" for kind, _ in parts) or
                                      isinstance(value, types.SimpleNamespace) and all(kind == "attr" for kind, _ in parts)):
            parts = None   # (a dict's method, a namespace subscripted, another object: the whole of it)
        yield f"{kind} '{name}'{via}", holder, name, value, parts
        if kind != "global":
            continue
        space: Mapping[str, Any]
        if isinstance(value, types.ModuleType) and users_code(getattr(value, "__file__", None) or "<>"):
            space = vars(value)
        elif isinstance(value, type) and users_code(getattr(sys.modules.get(value.__module__), "__file__", None) or "<>"):
            space = value.__dict__   # (a class used as a namespace of settings: Config.epsilon)
        elif isinstance(value, types.FunctionType) and users_code(value.__code__.co_filename):
            if deeper:
                yield from _reached_holders(value, depth + 1, seen)
            continue
        else:
            continue
        for var, attr in pairs:
            if var != name or attr not in space or attr in stored:
                continue
            held = space[attr]
            if isinstance(held, types.FunctionType):
                if deeper and users_code(held.__code__.co_filename):
                    yield from _reached_holders(held, depth + 1, seen)
            elif not isinstance(held, (classmethod, staticmethod, property)):
                yield f"attribute '{name}.{attr}'{via}", space, attr, held, None


def _class_member(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


class Theirs(NamedTuple):
    """Attributes of an object that a fragment method (``code``) does not see the loop change:
    ``stored``, those the object's fragment methods, or the methods this one calls, set; ``named``,
    those another of its fragment methods names, which it may change in place where mutable (a
    buffer's storage its ``add`` fills)."""

    stored: frozenset[str]
    named: frozenset[str]


def _theirs(cls: type, code: types.CodeType, names: list[str]) -> Theirs:
    stored: set[str] = set()
    named: set[str] = set()
    for klass in cls.__mro__:   # the fragment methods of the class and its bases
        for value in vars(klass).values():
            other = getattr(getattr(value, "fn", None), "__code__", None)
            if other is not None and getattr(value, "role", None) is not None:
                read, written = _attribute_names(other)
                stored |= written
                if other is not code:
                    named |= {n for _, n in read}
    for name in names:   # (what the methods it calls on its object set is its own too: self._decay())
        member = _class_member(cls, name)
        if isinstance(member, types.FunctionType):
            stored |= _attribute_names(member.__code__)[1]
    return Theirs(frozenset(stored), frozenset(named))


def _is_module(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _mutable(value: Any) -> bool:
    return not isinstance(value, (bool, int, float, complex, str, bytes, type(None), np.generic, tuple, frozenset))


@functools.lru_cache(maxsize=1024)
def _attribute_names(code: types.CodeType) -> tuple[tuple[tuple[str, str], ...], frozenset[str]]:
    """(variable, attribute) for each attribute a function's code (and code nested in it) reads
    straight off a variable (``self.epsilon``, ``cfg.EPS``), and the attribute names it sets or
    deletes anywhere (``self.n = ...``: its own)."""
    read: list[tuple[str, str]] = []
    stored: set[str] = set()
    base = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and base is not None and isinstance(ins.argval, str):
            read.append((base, ins.argval))
        elif ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
            stored.add(ins.argval)
        base = ins.argval if ins.opname in _VARIABLE_LOADS and isinstance(ins.argval, str) else None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            more, also = _attribute_names(const)
            read.extend(more)
            stored |= also
    return tuple(dict.fromkeys(read)), frozenset(stored)


@functools.lru_cache(maxsize=1024)
def _parts_read(code: types.CodeType) -> dict[str, frozenset[tuple[str, Any]] | None]:
    """For each global or closure variable a function's code (and code nested in it) loads, the
    parts of it read by name: ``("key", k)`` for ``X[k]`` or ``X.get(k...)`` with a constant ``k``,
    ``("attr", a)`` for ``X.a``; None where the code does anything else with it (the whole)."""
    out: dict[str, frozenset[tuple[str, Any]] | None] = {}

    def note(name: str, part: tuple[str, Any] | None) -> None:
        if name in out and out[name] is None:
            return
        out[name] = None if part is None else (out.get(name) or frozenset()) | {part}

    ins = list(dis.get_instructions(code))
    for i, x in enumerate(ins):
        if x.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME") or not isinstance(x.argval, str):
            continue
        a = ins[i + 1] if i + 1 < len(ins) else None
        b = ins[i + 2] if i + 2 < len(ins) else None
        part: tuple[str, Any] | None = None
        if a is not None and b is not None and a.opname == "LOAD_CONST" and b.opname == "BINARY_SUBSCR" \
                and isinstance(a.argval, (str, int)):
            part = ("key", a.argval)
        elif a is not None and b is not None and a.opname in ("LOAD_METHOD", "LOAD_ATTR") and a.argval == "get" \
                and b.opname == "LOAD_CONST" and isinstance(b.argval, (str, int)):
            part = ("key", b.argval)
        elif a is not None and a.opname == "LOAD_ATTR" and isinstance(a.argval, str) and a.argval != "get":
            part = ("attr", a.argval)
        note(x.argval, part)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            for name, parts in _parts_read(const).items():
                for part in (parts or (None,)):
                    note(name, part)
    return out


_VARIABLE_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CLOSURE", "LOAD_FAST_CHECK"})


def _instance_dict(obj: Any) -> dict[str, Any]:
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return {}
    return attrs if isinstance(attrs, dict) else {}


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Where Python's own modules and installed libraries are (``sysconfig`` works them out anew at
    each call: thousands of calls cost most of a small program's trace)."""
    paths = sysconfig.get_paths()
    return tuple({os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                  if paths.get(k)})


@functools.lru_cache(maxsize=8192)   # (every loaded module's file is asked about at each trace)
def users_code(filename: str) -> bool:
    """Whether code from ``filename`` is the user's own: not fragflow's, not Python's, not an
    installed library's."""
    if filename.startswith("<") or is_internal(filename):
        return False
    return not os.path.abspath(filename).startswith(_library_dirs())


def snapshot(value: Any, depth: int = 0) -> Any:
    """A comparable picture of a value's contents, to see whether it changed: numbers and strings as
    they are, arrays by checksum, containers (dicts, lists, tuples, their subclasses, namespaces)
    item by item; other objects by identity."""
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) or type(value).__name__ == "Tensor":
        return ("array", tuple(fingerprint(value)))
    if _is_module(value):   # (a global target network the loop syncs in place: its tensors, and which object)
        return ("module", id(value), tuple(fingerprint(value)))
    if depth < 3 and isinstance(value, types.SimpleNamespace):
        value = vars(value)
    if depth < 3 and isinstance(value, dict) and len(value) <= 4096:
        return ("dict", tuple((k, snapshot(v, depth + 1)) for k, v in value.items()))
    if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= 4096:
        return ("list", tuple(snapshot(v, depth + 1) for v in value))
    return ("object", id(value))


def changed_part(before: Any, after: Any) -> str:
    """Which key of a dict (or item of a list) differs between two snapshots ("" where not one)."""
    if isinstance(before, Parts) and isinstance(after, Parts):
        before, after = before.picture, after.picture
    if isinstance(before, tuple) and isinstance(after, tuple) and before[:1] == after[:1] == ("dict",):
        old, new = dict(before[1]), dict(after[1])
        keys = [k for k in {**old, **new} if old.get(k, _GONE) != new.get(k, _GONE)]
        return f" (its key {keys[0]!r})" if keys else ""
    return ""


_GONE = object()


def reached_now(holder: Any, name: str) -> Any:
    """What ``name`` holds now in ``holder`` (a globals or attributes dict, a class's, or a closure cell)."""
    if isinstance(holder, (dict, types.MappingProxyType)):
        return holder.get(name, _GONE)
    try:
        return holder.cell_contents
    except ValueError:
        return _GONE


def _handles(value: Any) -> list[Versioned]:
    """The handles a value is or holds directly (a handle, a view, or a dict/list/tuple of them)."""
    if isinstance(value, Versioned):
        return [value]
    if isinstance(value, VersionedView):
        return [value.handle]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [h for x in items if isinstance(x, (Versioned, VersionedView)) for h in _handles(x)]


def _as_value(x: Any) -> Any:
    """What a handle, or a dict/list/tuple of handles, holds: the handle's own value, as the
    variable would hold it had ``ff.versioned`` returned its argument (as it does eagerly)."""
    if isinstance(x, Versioned):
        return x.value
    if isinstance(x, VersionedView):
        return x.resolve(x.handle.value)
    if isinstance(x, dict):
        return {k: _as_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_as_value(v) for v in x)
    return x


@contextlib.contextmanager
def handles_as_values(fn: Any) -> Iterator[None]:
    """While a fragment runs in the loop's own process, the closure cells and globals its code
    reaches that hold versioned state hold the state's value instead, as they do when the program
    runs eagerly; restored afterwards (the loop still moves the handles)."""
    swapped: list[tuple[Any, str, Any]] = []   # (cell or globals dict, name, handle)
    try:
        for _, name, held, holder in _holders(fn):
            if _handles(held):
                swapped.append((holder, name, held))
                if isinstance(holder, dict):
                    holder[name] = _as_value(held)
                else:
                    holder.cell_contents = _as_value(held)
        yield
    finally:
        for where, name, held in reversed(swapped):
            if isinstance(where, dict):
                where[name] = held
            else:
                where.cell_contents = held


def captured_state(fn: Any) -> tuple[str, str, str] | None:
    """Versioned state a fragment's code reaches without being passed it, through a closure or a
    global: (kind, the variable, the state's name); None when there is none."""
    for kind, name, value, _ in _holders(fn):
        handles = _handles(value)
        if handles:
            return kind, name, handles[0].name
    return None


def captured_objects(fn: Any, objects: dict[int, tuple[str, Any]]) -> tuple[str, str, str] | None:
    """An object versioned state holds (``objects``: id -> (state, object)) that a fragment's code
    reaches through a closure or a global: (kind, variable, state); None when there is none."""
    if not objects:
        return None
    def owner(value: Any) -> str | None:
        try:   # (a learning-rate scheduler of the state's optimizer; read past any __getattr__ of the object)
            attrs = object.__getattribute__(value, "__dict__")
            held = attrs.get("optimizer") if isinstance(attrs.get("last_epoch"), int) else None
        except (AttributeError, TypeError):
            attrs, held = {}, None
        for x in (value, held):
            hit = objects.get(id(x)) if x is not None else None
            if hit is not None and hit[1] is x:
                return hit[0]
        # an optimizer of the program's own (not the state's) over the state's parameters: it steps them
        groups = attrs.get("param_groups") if isinstance(attrs, dict) else None
        if isinstance(groups, list):
            for group in groups[:64]:
                for p in (group.get("params", ()) if isinstance(group, dict) else ())[:4096]:
                    hit = objects.get(id(p))
                    if hit is not None and hit[1] is p:
                        return hit[0]
        return None

    for kind, name, value, _ in _holders(fn):
        inside = list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) else []
        for x in [value, *inside[:64]]:   # the variable, or what a list or dict it names holds
            state = owner(x)
            if state is not None:
                return kind, name, state
    return None
