"""Configuration: ``--set key=value`` overrides applied to an algorithm's frozen ``Args`` dataclass.

All problems are reported at once, with the offending values.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Args:
...     num_envs: int = 4
...     lr: float = 2.5e-4
>>> apply_overrides(Args, ["num_envs=8"])
Args(num_envs=8, lr=0.00025)
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import pathlib
import types
import typing
from typing import Any

from fragflow.errors import ConfigError, did_you_mean
from fragflow.source import SourceLoc

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Unresolved(str):
    """A field's annotation that names what the module does not define at run time (a type
    imported under ``if TYPE_CHECKING:``): the field keeps its default, and cannot be ``--set``."""


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields (string annotations included; one that cannot
    be resolved is :class:`Unresolved`, the rest still resolved)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:   # one field's name is not there at run time: the others still resolve
        import sys

        module = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
        hints = {}
        for f in dataclasses.fields(cls):
            if not isinstance(f.type, str):
                hints[f.name] = f.type
                continue
            try:
                hints[f.name] = eval(f.type, dict(module))   # the program's own annotation, in its module
            except Exception:
                hints[f.name] = Unresolved(f.type)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def coerce(raw: Any, annotation: Any) -> Any:
    """Convert a command-line string to ``annotation`` (int, float, bool, str, Optional[...])."""
    if not isinstance(raw, str):
        return raw
    if isinstance(annotation, Unresolved):
        raise ValueError(f"its annotation {str(annotation)!r} names something the module does not define when it "
                         "runs (imported under `if TYPE_CHECKING:`?): import it at the top of the file to set it")
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        for choice in choices:
            if raw == str(choice):
                return choice
        raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {raw!r}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and raw.lower() in ("none", "null", ""):
            return None
        problems = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(raw, option)
            except ValueError as exc:
                problems.append(str(exc))
        raise ValueError("; ".join(problems))
    if annotation is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"expected true or false, got {raw!r}")
    if annotation is int:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if annotation is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if annotation in (str, Any):
        return raw
    if origin in (tuple, list) or annotation in (tuple, list):
        return _sequence(raw, annotation, origin or annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        for member in annotation:
            if raw in (member.name, str(member.value)):
                return member
        raise ValueError(f"expected one of {', '.join(m.name for m in annotation)}, got {raw!r}")
    if isinstance(annotation, type) and issubclass(annotation, pathlib.PurePath):
        return annotation(raw)
    shown = annotation.__qualname__ if isinstance(annotation, type) else annotation
    raise ValueError(f"cannot set a field of type {shown} from the command line (--set takes bool, int, float, "
                     "str, Literal, Optional, Enum, Path, and tuples and lists of those): set it in the program")


def _of_sequences(annotation: Any) -> bool:
    """Whether a tuple's or list's items are tuples or lists themselves (``tuple[tuple[int, float], ...]``)."""
    return any(typing.get_origin(a) in (tuple, list) or a in (tuple, list) for a in typing.get_args(annotation))


def _from_literal(value: Any, annotation: Any, raw: str) -> Any:
    """A Python literal's ``value`` as ``annotation`` says, item by item."""
    origin = typing.get_origin(annotation) or annotation
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"expected a {origin.__name__} in {raw!r}, got {value!r}")
        args = typing.get_args(annotation)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ValueError(f"expected {len(args)} values in {value!r} (of {raw!r})")
            items = [_from_literal(v, a, raw) for v, a in zip(value, args)]
        else:
            items = [_from_literal(v, args[0] if args else Any, raw) for v in value]
        return tuple(items) if origin is tuple else items
    return coerce(value if isinstance(value, str) else repr(value), annotation)


def _sequence(raw: str, annotation: Any, kind: type) -> Any:
    """``64,64`` (or ``(64, 64)``, ``[64, 64]``; ``64,`` is a tuple of one) as a tuple or list of the
    annotation's items; of tuples or lists, a Python literal: ``((0, 1e-3), (6, 1e-4))``."""
    if _of_sequences(annotation):
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"a {kind.__name__} of {kind.__name__}s is given as a Python literal, such as "
                             f"'((0, 1e-3), (6, 1e-4))' (quoted for the shell); got {raw!r}") from None
        return _from_literal(value if isinstance(value, (tuple, list)) else (value,), annotation, raw)
    text = raw.strip()
    if text[:1] + text[-1:] in ("()", "[]"):
        text = text[1:-1]
    items = [t.strip() for t in text.split(",")] if text.strip() else []
    if items and items[-1] == "":
        items.pop()
    args = typing.get_args(annotation)
    if kind is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(items) != len(args):
            raise ValueError(f"expected {len(args)} comma-separated values, got {raw!r}")
        return tuple(coerce(item, a) for item, a in zip(items, args))
    if not args:   # (a bare tuple or list: of what, its annotation does not say)
        raise ValueError(f"its annotation {annotation} does not say the type of its items: annotate it as "
                         f"{'tuple[int, ...]' if kind is tuple else 'list[int]'} (or the like) to set it")
    values = [coerce(item, args[0]) for item in items]
    return tuple(values) if kind is tuple else values


def apply_overrides(args_cls: type, sets: list[str], where: SourceLoc | None = None, base: Any = None,
                    train_params: tuple[str, ...] = ()) -> Any:
    """An ``args_cls`` instance (``base`` or the defaults) with ``key=value`` overrides; every
    problem reported in one error. A field holding a dataclass is set field by field with a dotted
    key (``opt.lr=0.01``), as tyro writes it (``train_params``: the training function's other
    parameters, named where a key is one of them)."""
    problems: list[str] = []
    values = _overrides(args_cls, sets, base, "", problems, train_params)
    where = _defined_at(args_cls) or where   # (what --set sets: the Args class, not the training function)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), where=where,
                          fix=f"the fields of {args_cls.__name__} --set takes are: {', '.join(_settable(args_cls))}")
    try:
        return _built(args_cls, values, base)
    except (ValueError, TypeError) as exc:
        missing = [f.name for f in dataclasses.fields(args_cls) if f.name not in values and
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        fix = (f"give {', '.join(missing)} with --set (e.g. --set {missing[0]}=...), or a default in "
               f"{args_cls.__name__}" if missing and base is None else "change the values given with --set")
        raise ConfigError(f"invalid configuration: {exc}", where=where, fix=fix) from None


def _defined_at(cls: type) -> SourceLoc | None:
    """Where the user's class is defined (its ``class`` line), where its source can be found."""
    import inspect

    try:
        lines, first = inspect.getsourcelines(cls)
        file = inspect.getsourcefile(cls) or ""
    except (OSError, TypeError):
        return None
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("class ")), 0)   # (below its decorators)
    return SourceLoc.of(file, first + at)


def _nested(annotation: Any) -> type | None:
    """The dataclass a field holds (``OptCfg``, or ``Optional[OptCfg]``'s), or None."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    found = [a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return found[0] if len(found) == 1 else None


def _settable(cls: type, prefix: str = "", depth: int = 0) -> list[str]:
    """The keys --set takes for ``cls``: its fields, a nested dataclass's as ``field.sub`` (not a field
    of a type it cannot set, as a dict)."""
    out: list[str] = []
    made = {f.name for f in dataclasses.fields(cls) if not f.init}   # (what the class makes itself: no --set)
    for name, annotation in field_types(cls).items():
        if name in made:
            continue
        sub = _nested(annotation)
        if sub is not None and depth < 4:
            out.extend(_settable(sub, f"{prefix}{name}.", depth + 1))
        elif _takes(annotation):
            out.append(f"{prefix}{name}")
    return out


def _takes(annotation: Any) -> bool:
    """Whether --set can give a field of this type (what :func:`coerce` refuses of every value: no)."""
    if isinstance(annotation, Unresolved):
        return False
    origin = typing.get_origin(annotation)
    if origin is typing.Literal or annotation in (bool, int, float, str, Any, tuple, list):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_takes(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin in (tuple, list):
        return True
    return isinstance(annotation, type) and issubclass(annotation, (enum.Enum, pathlib.PurePath))


def _default(cls: type, name: str) -> Any:
    """The value ``cls`` gives field ``name`` where it is not given (dataclasses.MISSING: none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _built(cls: type, values: dict[str, Any], base: Any) -> Any:
    """``cls`` from ``values``, where a nested dataclass's entry is ``(sub_cls, its values, its base)``."""
    done = {k: _built(*v) if isinstance(v, _Sub) else v for k, v in values.items()}
    return dataclasses.replace(base, **done) if base is not None else cls(**done)


class _Sub(tuple):
    """A nested dataclass's overrides: (its class, its values, the instance they change or None)."""


def _overrides(args_cls: type, sets: list[str], base: Any, prefix: str, problems: list[str],
               train_params: tuple[str, ...] = ()) -> dict[str, Any]:
    types_ = field_types(args_cls)
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    nested: dict[str, list[str]] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            problems.append(f"--set {item!r}: expected key=value")
            continue
        head, dot, rest = key.partition(".")
        if dot and head in types_ and _nested(types_[head]) is not None:
            nested.setdefault(head, []).append(f"{rest}={raw}")
            continue
        plain = vars(args_cls).get(key)
        if key not in types_ and key in vars(args_cls) and not key.startswith("_") and not callable(plain) and \
                not isinstance(plain, (property, staticmethod, classmethod)):
            # `lr = 0.01` without a type: a class attribute the dataclass does not take as a field
            problems.append(f"--set {prefix}{key}: {args_cls.__name__}.{key} has no type annotation, so it is a "
                            f"class attribute, not a field (write it {key}: {type(vars(args_cls)[key]).__name__} = "
                            f"{vars(args_cls)[key]!r})")
            continue
        if key not in types_:
            if key in train_params:
                problems.append(f"--set {key}: '{key}' is a parameter of the training function, not a field of "
                                f"{args_cls.__name__}: fragflow run calls it with {args_cls.__name__} alone, so the "
                                f"parameter keeps its default (to set it from the command line, make it a field of "
                                f"{args_cls.__name__})")
            else:
                problems.append(f"--set {prefix}{key}: {args_cls.__name__} has no field '{key}'; "
                                f"{did_you_mean(key, _settable(args_cls))}")
            continue
        if not next(f for f in dataclasses.fields(args_cls) if f.name == key).init:
            problems.append(f"--set {prefix}{key}: {args_cls.__name__}.{key} is declared with field(init=False), so "
                            f"{args_cls.__name__} makes it itself (its default, or __post_init__) and takes no value for "
                            "it: set what it is made from, or drop init=False to set it")
            continue
        if key in given:
            problems.append(f"--set {prefix}{key} is given twice ({given[key]}, {raw.strip()}): give each field once")
            continue
        given[key] = raw.strip()
        sub = _nested(types_[key])
        if sub is not None and not (typing.get_origin(types_[key]) in (typing.Union, types.UnionType)
                                    and raw.strip().lower() in ("none", "null")):
            problems.append(f"--set {prefix}{key}={raw.strip()}: {key} holds the dataclass {sub.__name__}, whose fields "
                            f"are set one by one: " + ", ".join(f"--set {prefix}{k}=..." for k in _settable(sub, f"{key}.")))
            continue
        try:
            values[key] = None if sub is not None else coerce(raw.strip(), types_[key])
        except ValueError as exc:
            problems.append(f"--set {prefix}{key}={raw}: {exc}")
    for head, subsets in nested.items():
        if head in values:   # (extra=none beside extra.lr=...)
            problems.append(f"--set {prefix}{head}={given[head]} and --set {prefix}{head}.*: give one or the other")
            continue
        sub = _nested(types_[head])
        assert sub is not None
        inner = getattr(base, head) if base is not None else _default(args_cls, head)
        if inner is dataclasses.MISSING or inner is None:
            inner = None    # no instance to change: the nested dataclass is built from its own defaults
        elif not isinstance(inner, sub):
            problems.append(f"--set {prefix}{head}.*: {prefix}{head} holds {type(inner).__name__}, not a {sub.__name__}")
            continue
        values[head] = _Sub((sub, _overrides(sub, subsets, inner, f"{prefix}{head}.", problems), inner))
    return values
