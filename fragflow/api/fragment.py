"""Fragments: the functions a distribution policy places.

A fragment is a plain function over array pytrees, marked with its role::

    @ff.fragment("actor")
    def act(params, obs, key):
        ...
        return action, logprob, value

Roles:

=========  ==================================================================================
env        steps environments (``ff.envs.make`` builds one; users may write their own)
actor      inference on the acting side: reads versioned parameters, never writes them
buffer     gathers per-step data into batches (``ff.RolloutBuffer``)
learner    consumes batches; with ``writes=`` it returns the next version of a versioned state
logger     a sink for scalars (``ff.log``), placed beside whatever produces them
=========  ==================================================================================

Without an active interpreter (see :mod:`fragflow.context`) a fragment is called directly, so an
algorithm file runs eagerly without fragflow's runtime.

Built-in fragments *declare* what the compiler and runtime need to know about them, instead of
being recognised by type:

==========  =====================================================================================
axes        ``axes(path) -> (name, axis) | None``: the named batch axis of an output leaf (``env``,
            ``time``, ``sample``, ``agent``); a policy that splits a batch across replicas splits and
            merges along it
in_axes     the same for argument leaves (``"obs['x']"``), where the loop made them: a buffer's
            ``add`` takes rows, one per environment, however the loop computed them
events      ``events(output) -> (env_steps, [(return, length), ...])``: what one call stepped; any env
            fragment emits these (a user's own env gets a counter for gymnasium's step signature)
evaluation  an env whose episodes are evaluation, counted and reported apart from training
==========  =====================================================================================
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

from fragflow import context
from fragflow.errors import TraceError
from fragflow.runtime import kernels, signals
from fragflow.source import SourceLoc, definition_of, user_callsite

ROLES = ("env", "actor", "buffer", "learner", "logger")
ACTING_ROLES = frozenset({"env", "actor", "buffer"})

_FIRST_PARAM = object()
_calling = threading.local()   # .fragment: the one the loop is calling (one fragment calling another runs it inline)


def running() -> Fragment | None:
    """The fragment whose call the loop is in, if any (in this thread)."""
    return getattr(_calling, "fragment", None)


def rows(path: str) -> tuple[str, int]:
    """Every leaf is rows, one per environment, on axis 0: the ``axes`` of an env's outputs and the
    ``in_axes`` of a buffer's ``add`` or an env's ``step``."""
    return ("env", 0)


_bound: weakref.WeakKeyDictionary[object, dict[int, Fragment]] = weakref.WeakKeyDictionary()


def _bound_on(obj: object) -> dict[int, Fragment]:
    """The fragments bound to ``obj`` (one per method, made once so its identity is stable)."""
    try:
        return _bound.setdefault(obj, {})
    except TypeError:   # unhashable (a dataclass) or not weak-referenceable: keep them on the object
        try:
            return vars(obj).setdefault("_fragflow_bound", {})
        except TypeError:
            raise TraceError(f"cannot bind a fragment method to a {type(obj).__qualname__}: it has no __dict__",
                             where=user_callsite(), fix="add '__weakref__' to its __slots__, or make the "
                                                        "fragments in __init__: self.step = ff.fragment('env')(self._step)") from None


class Fragment:
    """A callable marked with a role. Calls go to the active interpreter, or run eagerly."""

    __slots__ = ("name", "role", "fn", "writes", "defined_at", "instance", "signature", "axes", "in_axes",
                 "events", "evaluation", "_written_at", "__dict__")

    def __init__(self, fn: Callable[..., Any], role: str, *, name: str | None = None,
                 writes: str | None = None, defined_at: SourceLoc | None = None,
                 instance: object | None = None, axes: Callable[[str], tuple[str, int] | None] | None = None,
                 events: Callable[[Any], tuple[int, list[tuple[float, int]]]] | None = None,
                 evaluation: bool = False, in_axes: Callable[[str], tuple[str, int] | None] | None = None) -> None:
        self.fn = fn
        self.role = role
        self.name = name or fn.__name__
        self.writes = writes
        self.defined_at = defined_at or definition_of(fn)
        # Built-in fragments (env.step, buffer.add) belong to an object; policies keep an
        # instance's fragments together because they share its internal state.
        self.instance = instance
        self.axes = axes
        self.in_axes = in_axes
        self.events = events
        self.evaluation = evaluation
        self.signature = inspect.signature(fn)
        self._written_at = _position(self.signature, writes)
        functools.update_wrapper(self, fn)

    def __get__(self, obj: object | None, objtype: type | None = None) -> Fragment:
        """A fragment defined as a method binds to its object like a method does: ``env.step`` is a
        fragment of that object (its own node, kept with the object's other fragments)."""
        if obj is None or self.instance is not None:
            return self
        bound = _bound_on(obj)
        frag = bound.get(id(self))
        if frag is None:
            owner = getattr(obj, "name", None) or type(obj).__name__
            frag = bound[id(self)] = Fragment(self.fn.__get__(obj, objtype), self.role,
                                              name=f"{owner}.{self.name}" if self.name == self.fn.__name__ else self.name,
                                              writes=self.writes, defined_at=self.defined_at, instance=obj,
                                              axes=self.axes, events=self.events, evaluation=self.evaluation,
                                              in_axes=self.in_axes)
        return frag

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        interp = context.current()
        if interp is None:
            with kernels.in_fragment:
                return self.fn(*args, **kwargs)
        if signals.dropped:   # a Ctrl-C dropped in a finalizer (see keeps_interrupts) stops the loop here
            signals.check()
        outer = getattr(_calling, "fragment", None)
        if outer is not None:   # called by a fragment: part of its work, wherever that runs
            if self.role == "logger":
                raise TraceError(f"ff.log was called inside fragment '{outer.name}': it logs what the loop "
                                 "hands it, and a fragment may run in another process",
                                 where=user_callsite(),
                                 fix=f"return the values from '{outer.name}' and ff.log them in the loop")
            nested = getattr(interp, "nested", None)
            if nested is not None and self.role == "learner":
                nested(self, outer)
            return self.fn(*args, **kwargs)
        _calling.fragment = self
        try:
            return interp.call(self, args, kwargs)
        finally:
            _calling.fragment = None

    def written(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value a call passes as the argument this learner writes (``writes``)."""
        assert self.writes is not None
        if self.writes in kwargs:
            return kwargs[self.writes]
        if 0 <= self._written_at < len(args):
            return args[self._written_at]
        return self.signature.bind(*args, **kwargs).arguments.get(self.writes)

    def __repr__(self) -> str:
        return f"<fragment {self.name} role={self.role} at {self.defined_at}>"


def calling() -> Fragment | None:
    """The fragment this thread is running, called from the loop (None: the loop's own code runs)."""
    return getattr(_calling, "fragment", None)


def _position(signature: inspect.Signature, name: str | None) -> int:
    """Where parameter ``name`` is passed positionally, when every parameter before it can be (else -1)."""
    for i, p in enumerate(signature.parameters.values()):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return -1
        if p.name == name:
            return i
    return -1


def fragment(role: str, *, name: str | None = None, writes: Any = _FIRST_PARAM) -> Callable[[Callable[..., Any]], Fragment]:
    """Mark a function as a fragment with a role.

    ``writes`` (learners only) names the argument holding the versioned state the learner
    updates; the fragment's first output is that state's next version. It defaults to the
    learner's first parameter; pass ``writes=None`` for a learner that updates no shared state.

    >>> import numpy as np
    >>> @fragment("actor")
    ... def double(x):
    ...     return x * 2
    >>> double(np.ones(2))      # no interpreter active: a plain call
    array([2., 2.])
    """
    where = user_callsite()
    if callable(role):   # @ff.fragment with no role, on a function
        name = getattr(role, "__name__", "the function")
        raise TraceError(f"@ff.fragment on '{name}' has no role", where=where,
                         fix=f"give it its role: @ff.fragment(\"actor\") (one of: {', '.join(ROLES)})")
    if role not in ROLES:
        raise TraceError(f"unknown fragment role {role!r}", where=where,
                         fix=f"use one of: {', '.join(ROLES)}")
    # (a name of another type failed as a TypeError joining names, at no line, once the run had
    # begun; writes=["state"] as an unhashable list)
    if name is not None and not isinstance(name, str):
        raise TraceError(f"@ff.fragment got name={name!r:.60}, where it takes the fragment's name, a string",
                         where=where, fix=f'write @ff.fragment("{role}", name="..."), or leave name out (the '
                                          "function's own name)")
    if writes is not _FIRST_PARAM and writes is not None and not isinstance(writes, str):
        raise TraceError(f"@ff.fragment got writes={writes!r:.60}, where it takes the name of the one parameter "
                         "holding the versioned state the learner writes", where=where,
                         fix="write writes=\"state\" (a learner writes one state: give another state a learner of its "
                             "own, or keep both in one ff.versioned dict), or writes=None")

    def wrap(fn: Callable[..., Any]) -> Fragment:
        w: str | None
        if isinstance(fn, Fragment) and role == fn.role and name in (None, fn.name) and \
                (writes is _FIRST_PARAM or writes == fn.writes):
            return fn   # the same mark twice: the one fragment (eagerly it runs as once)
        if isinstance(fn, Fragment):   # (a second decorator took the first's Fragment for the user's function)
            again = f'@ff.fragment("{role}")' + ("" if role == fn.role else f' over @ff.fragment("{fn.role}")')
            raise TraceError(f"fragment '{fn.name}' is marked twice ({again}): a function has one role",
                             where=fn.defined_at,
                             fix=f"keep one decorator: @ff.fragment(\"{fn.role}\") or @ff.fragment(\"{role}\")")
        if not isinstance(getattr(fn, "__name__", None), str) or not hasattr(fn, "__qualname__"):
            # (a functools.partial, a callable object: it failed as an AttributeError from fragflow's code)
            got = (f"functools.partial({getattr(fn.func, '__name__', '...')}"
                   f"{''.join(f', {a!r:.20}' for a in fn.args)}"
                   f"{''.join(f', {k}={v!r:.20}' for k, v in fn.keywords.items())})"
                   if isinstance(fn, functools.partial) else f"a {type(fn).__name__} object")
            raise TraceError(f"@ff.fragment got {got}, not a function defined with def or lambda", where=where,
                             fix=f'define a function that calls it and mark that one: @ff.fragment("{role}") '
                                 "def act(state, obs): return f(state, obs) (a partial's bound values as "
                                 "arguments at the call, or as its defaults); for an object, mark its method in its class: "
                                 f'@ff.fragment("{role}") def __call__(self, ...)')
        if role != "learner":
            if writes is not _FIRST_PARAM and writes is not None:
                raise TraceError(f"fragment '{fn.__name__}' has role {role!r} but declares writes={writes!r}",
                                 where=definition_of(fn), fix="only a 'learner' fragment writes versioned state")
            w = None
        elif writes is _FIRST_PARAM:
            params = list(inspect.signature(fn).parameters)
            owner = fn.__qualname__.rsplit(".", 2)[-2] if "." in fn.__qualname__ else "<locals>"
            if params and params[0] == "self" and owner != "<locals>":   # a method: its state comes after self
                params = params[1:]
            if not params:
                raise TraceError(f"learner '{fn.__name__}' takes no arguments", where=definition_of(fn),
                                 fix="a learner takes its state as first argument, or declare writes=None")
            w = params[0]
        else:
            w = writes if isinstance(writes, str) else None   # (anything else is refused above)
            if w is not None and w not in inspect.signature(fn).parameters:
                raise TraceError(f"learner '{fn.__name__}' declares writes={w!r} but has no such parameter",
                                 where=definition_of(fn), fix="name one of its parameters, or writes=None")
        return Fragment(fn, role, name=name, writes=w)

    return wrap
