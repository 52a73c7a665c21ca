"""The ``Args`` a checkpoint's manifest recorded, read back into the dataclass: each value in its
field's type (a tuple saved as a list, a nested dataclass as a dict, a path or an enum as text),
and a value that no longer fits refused (:class:`~fragflow.runtime.snapshot.CheckpointError`)."""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import types
import typing
from typing import Any

from fragflow.runtime.snapshot import CheckpointError

__all__ = ["args_from"]


def args_from(cls: type | None, data: dict[str, Any] | None) -> Any:
    """The Args dataclass a manifest recorded, each value back in its field's type (a list back to a
    tuple where the annotation or the default is one); one that does not fit is refused."""
    if cls is None or data is None:
        return None
    from fragflow.config import field_types

    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:   # (a field renamed or removed since: its saved value would be dropped without a word)
        raise CheckpointError(f"the checkpoint's args hold {', '.join(map(repr, unknown))}, which {cls.__name__} has no "
                              f"field for (its fields: {', '.join(fields)})",
                              fix="resume with the algorithm file that wrote the checkpoint (or give the field its "
                                  "old name back)")
    types = field_types(cls)
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue   # (a field added since: its default)
        v = _rebuilt(data[name], types.get(name))
        if isinstance(v, list) and isinstance(f.default, tuple):
            v = tuple(v)
        if not _fits(v, types.get(name)):
            raise CheckpointError(f"the checkpoint's args hold {name}={v!r}, which does not fit {cls.__name__}.{name}: "
                                  f"{getattr(types.get(name), '__name__', types.get(name))}",
                                  fix="resume with the algorithm file that wrote the checkpoint, or repair the "
                                      "manifest's args")
        values[name] = v
    try:
        return cls(**values)
    except TypeError as exc:
        raise CheckpointError(f"the checkpoint's args do not fit {cls.__name__}: {exc}",
                              fix="resume with the algorithm file that wrote the checkpoint") from None


def _rebuilt(value: Any, annotation: Any) -> Any:
    """A value as JSON saved it, back in the field's type where the annotation says (a tuple saved
    as a list, a nested dataclass as a dict, a path or an enum as text)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            rebuilt = _rebuilt(value, option)
            if _fits(rebuilt, option) and option is not type(None):
                return rebuilt
        return value
    if isinstance(value, list) and (annotation is tuple or origin is tuple):
        return tuple(value)
    if isinstance(annotation, type):
        if dataclasses.is_dataclass(annotation) and isinstance(value, dict):
            return args_from(annotation, value)
        if issubclass(annotation, pathlib.PurePath) and isinstance(value, str):
            return annotation(value)
        if issubclass(annotation, enum.Enum) and not isinstance(value, annotation):
            try:
                return annotation[str(value).rsplit(".", 1)[-1]]
            except KeyError:
                try:
                    return annotation(value)
                except ValueError:
                    return value
    return value


def _fits(value: Any, annotation: Any) -> bool:
    """Whether a saved value can be the field's (the simple annotations checked; any other passes)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is tuple or origin is tuple:
        return isinstance(value, tuple)
    if isinstance(annotation, type) and (dataclasses.is_dataclass(annotation) or
                                         issubclass(annotation, (pathlib.PurePath, enum.Enum))):
        return isinstance(value, annotation)
    return True
