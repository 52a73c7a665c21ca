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
    raise ValueError(f"cannot set a field of type {annotation} from the command line (--set takes bool, int, float, "
                     "str, Literal, Optional, Enum, Path, and tuples and lists of those): set it in the program")


def _sequence(raw: str, annotation: Any, kind: type) -> Any:
    """``64,64`` (or ``(64, 64)``, ``[64, 64]``; ``64,`` is a tuple of one) as a tuple or list of the
    annotation's items."""
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


def apply_overrides(args_cls: type, sets: list[str], where: SourceLoc | None = None, base: Any = None) -> Any:
    """An ``args_cls`` instance (``base`` or the defaults) with ``key=value`` overrides; every
    problem reported in one error."""
    types_ = field_types(args_cls)
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    problems: list[str] = []
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            problems.append(f"--set {item!r}: expected key=value")
            continue
        plain = vars(args_cls).get(key)
        if key not in types_ and key in vars(args_cls) and not key.startswith("_") and not callable(plain) and \
                not isinstance(plain, (property, staticmethod, classmethod)):
            # `lr = 0.01` without a type: a class attribute the dataclass does not take as a field
            problems.append(f"--set {key}: {args_cls.__name__}.{key} has no type annotation, so it is a class "
                            f"attribute, not a field (write it {key}: {type(vars(args_cls)[key]).__name__} = "
                            f"{vars(args_cls)[key]!r})")
            continue
        if key not in types_:
            problems.append(f"--set {key}: {args_cls.__name__} has no field '{key}'; {did_you_mean(key, types_)}")
            continue
        if key in given:
            problems.append(f"--set {key} is given twice ({given[key]}, {raw.strip()}): give each field once")
            continue
        given[key] = raw.strip()
        try:
            values[key] = coerce(raw.strip(), types_[key])
        except ValueError as exc:
            problems.append(f"--set {key}={raw}: {exc}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), where=where,
                          fix=f"the fields of {args_cls.__name__} are: {', '.join(types_)}")
    try:
        return dataclasses.replace(base, **values) if base is not None else args_cls(**values)
    except (ValueError, TypeError) as exc:
        missing = [f.name for f in dataclasses.fields(args_cls) if f.name not in values and
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        fix = (f"give {', '.join(missing)} with --set (e.g. --set {missing[0]}=...), or a default in "
               f"{args_cls.__name__}" if missing and base is None else "change the values given with --set")
        raise ConfigError(f"invalid configuration: {exc}", where=where, fix=fix) from None
