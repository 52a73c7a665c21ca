"""A fragment call's arguments by parameter name, as the tracer reads them: bound cheaply where every
argument is passed by position, versioned state passed through ``*args``/``**kwargs`` resolved, and
one jax key given for all the environments recognised."""

from __future__ import annotations

from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView, own_value


def one_jax_key(value: Any) -> bool:
    """A jax.random.PRNGKey (two uint32 words): one key, not one per environment."""
    return type(value).__module__.startswith("jax") and str(getattr(value, "dtype", "")) == "uint32" and \
        tuple(getattr(value, "shape", ())) == (2,)


def star_state(frag: Fragment, pname: str, value: Any) -> Any:
    """The value of a ``*args`` or ``**kwargs`` parameter with the versioned state in it resolved,
    where it holds some (None where it holds none, or is another parameter)."""
    param = frag.signature.parameters.get(pname)
    if param is None or param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return None
    items = list(value) if isinstance(value, tuple) else list(value.values()) if isinstance(value, dict) else []
    if not any(isinstance(v, (Versioned, VersionedView)) for v in items):
        return None

    def plain(v: Any) -> Any:
        return own_value(v) if isinstance(v, (Versioned, VersionedView)) else v
    return tuple(plain(v) for v in value) if isinstance(value, tuple) else {k: plain(v) for k, v in value.items()}


class _Positional:
    """What ``Signature.bind`` gives for a call passing every parameter by position (most calls),
    without its cost (a tenth of a traced call's)."""

    __slots__ = ("arguments",)
    kwargs: dict[str, Any] = {}

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(self.arguments.values())


class _Keywords:
    """What ``Signature.bind`` gives for a call of a function whose one parameter is ``**kwargs``."""

    __slots__ = ("arguments",)
    args: tuple[Any, ...] = ()

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    @property
    def kwargs(self) -> dict[str, Any]:
        return next(iter(self.arguments.values()))


def bind(frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = frag.__dict__.get("_ff_positional", False)
    if names is False:   # the parameter names, where every parameter may be passed by position
        params = frag.signature.parameters.values()
        names = frag.__dict__["_ff_positional"] = tuple(p.name for p in params) if all(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) else None
    if names is not None and not kwargs and len(args) == len(names):
        return _Positional(dict(zip(names, args)))
    var = frag.__dict__.get("_ff_var_keyword", False)
    if var is False:   # the parameter's name, where the only one takes keywords (a buffer's add(**step))
        only = list(frag.signature.parameters.values())
        var = frag.__dict__["_ff_var_keyword"] = only[0].name if len(only) == 1 and \
            only[0].kind == only[0].VAR_KEYWORD else None
    if var is not None and not args:
        return _Keywords({var: kwargs})
    return frag.signature.bind(*args, **kwargs)
