"""Distribution policies: registry, options and the ``@ff.distribute`` decorator.

A policy is one module in ``fragflow.distribution_policies`` (the ``distribution_policies/``
folder) that defines ``POLICY = PolicySpec(...)``: a name, the system it mirrors, a one-line
summary, a frozen dataclass of options and ``place(graph, options) -> PlacedGraph``, a pure pass.

The policy for a run comes from, in order: ``--policy`` on the command line, the decorator on the
training function, then :func:`default_policy` (``pipelined`` with two or more cores).

>>> parse_policy("actor_learner(actors=4, max_lag=1)")
('actor_learner', {'actors': '4', 'max_lag': '1'})
"""

from __future__ import annotations

import enum
import importlib
import math
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fragflow.compiler.ir import Graph
from fragflow.config import coerce, field_types
from fragflow.errors import ConfigError, FragflowError, UnknownPolicyError, did_you_mean
from fragflow.placement.placed import PlacedGraph
from fragflow.source import user_callsite

MAX_LAG = 256   # a staleness bound past this is refused: the rings and broadcasts hold max_lag + 2 or 3 copies


def default_policy() -> str:
    """The policy a run gets when none is chosen: the fastest correct one for this machine.

    With two or more cores, ``pipelined`` (one actor process acting while the learner learns,
    exactly one version behind, deterministic); on one core, ``single_process``.
    """
    return "pipelined" if (os.cpu_count() or 1) >= 2 else "single_process"


@dataclass(frozen=True)
class PolicySpec:
    name: str
    mirrors: str
    summary: str
    options: type
    place: Callable[[Graph, Any], PlacedGraph]
    one_process: bool = False   # places every fragment in the loop's process, whatever the graph

    def signature(self) -> str:
        """The options with their defaults, as written on the command line: ``actors=1, max_lag=1``."""
        import dataclasses

        return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(self.options))

    def make_options(self, values: dict[str, Any]) -> Any:
        fields = field_types(self.options)
        problems = []
        kwargs = {}
        for key, raw in values.items():
            if key not in fields:
                problems.append(f"policy '{self.name}' has no option '{key}' ({did_you_mean(key, fields) if fields else 'it takes none'})")
                continue
            try:
                kwargs[key] = _given(raw, fields[key])
            except ValueError as exc:
                problems.append(f"option '{key}' of policy '{self.name}': {exc}")
                continue
            if key in ("actors", "env_workers", "learners") and kwargs[key] < 1:
                problems.append(f"option '{key}' of policy '{self.name}' is {kwargs[key]}: it counts processes, 1 or more")
            elif key in ("envs_per_actor", "envs_per_worker") and kwargs[key] < 0:
                problems.append(f"option '{key}' of policy '{self.name}' is {kwargs[key]}: it counts environments "
                                "in each process, 1 or more (0: the loop's environments divided among them)")
            elif key == "max_lag" and kwargs[key] < 0:
                problems.append(f"option 'max_lag' of policy '{self.name}' is {kwargs[key]}: a staleness bound is a "
                                "number of versions, 0 (sequential semantics) or more")
            elif key == "max_lag" and kwargs[key] > MAX_LAG:
                problems.append(f"option 'max_lag' of policy '{self.name}' is {kwargs[key]}: the channels hold that "
                                f"many rollouts and versions of the state in shared memory; up to {MAX_LAG} is taken")
            elif key == "wait_ms" and not (math.isfinite(kwargs[key]) and kwargs[key] >= 0):
                problems.append(f"option 'wait_ms' of policy '{self.name}' is {kwargs[key]}: how long a request "
                                "waits for the other workers', 0 (answer what has arrived) or more milliseconds")
        if problems:
            takes = f"{self.name}({self.signature()})" if self.signature() else f"'{self.name}' (it takes no options)"
            raise ConfigError("; ".join(problems), fix=f"write {takes}, changing what you need (`fragflow policies` lists every policy's)")
        return self.options(**kwargs)


def _given(raw: Any, annotation: Any) -> Any:
    """An option's value as a ``--policy`` string or the decorator gave it (``max_lag=0.5`` is
    checked as ``"0.5"`` is: not an integer)."""
    if isinstance(raw, str):
        return coerce(raw, annotation)
    if isinstance(annotation, type) and isinstance(raw, annotation) and (annotation is bool or not isinstance(raw, bool)):
        return raw
    return coerce(str(raw.value if isinstance(raw, enum.Enum) else raw), annotation)


def available() -> dict[str, PolicySpec]:
    """Every registered policy, by name."""
    distribution_policies: Any = importlib.import_module("fragflow.distribution_policies")

    found: dict[str, PolicySpec] = {}
    for info in pkgutil.iter_modules(distribution_policies.__path__):
        module = importlib.import_module(f"{distribution_policies.__name__}.{info.name}")
        spec = getattr(module, "POLICY", None)
        if isinstance(spec, PolicySpec):
            found[spec.name] = spec
    return dict(sorted(found.items()))


def get(name: str) -> PolicySpec:
    policies = available()
    if name not in policies:
        raise UnknownPolicyError(f"unknown distribution policy {name!r}",
                                 fix=f"{did_you_mean(name, policies)} (`fragflow policies` lists them)")
    return policies[name]


_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(.*?)\s*$", re.DOTALL)


def parse_policy(text: str) -> tuple[str, dict[str, str]]:
    """``"name"`` or ``"name(key=value, ...)"`` -> (name, {key: value}); anything else is refused
    with what was wrong and the form to write (the policy's own options where its name was read).

    >>> parse_policy("pipelined()")
    ('pipelined', {})
    """
    m = _NAME.match(text)
    name = m.group(1) if m else None

    def refuse(why: str) -> UnknownPolicyError:
        spec = available().get(name) if name is not None else None
        if spec is not None:
            form = f"{name}({spec.signature()})" if spec.signature() else f"{name} (it takes no options)"
            fix = f"write options as key=value, separated by commas: {form}, changing what you need"
        else:
            fix = (f"write a policy's name, one of {', '.join(available())}, and its options if any (write "
                   "options as key=value, separated by commas: actor_learner(actors=2, max_lag=1))")
        return UnknownPolicyError(f"cannot read policy {text!r}: {why}",
                                  fix=f"{fix} (`fragflow policies` lists every policy with its options)")

    if not text.strip():
        raise refuse("no policy is named")
    if text.strip().endswith(".py") or "/" in text or os.sep in text:
        name = None
        raise refuse("a policy is given by its name (custom policy files are not supported: a policy is a module "
                     "of fragflow's distribution_policies/, see docs/architecture.md)")
    if m is None:
        raise refuse("it does not start with a policy's name")
    rest = m.group(2)
    if not rest:
        return m.group(1), {}
    if text.count("(") != text.count(")"):
        raise refuse("unbalanced parentheses")
    if not rest.startswith("(") or ")" not in rest:
        raise refuse(f"{rest!r} after the name, where its options go in parentheses")
    body, _, tail = rest[1:].partition(")")
    if "(" in body:
        raise refuse("parentheses inside the options")
    if tail.strip():
        raise refuse(f"{tail.strip()!r} after the options' closing parenthesis")
    if ";" in body:
        raise refuse("';' between options")
    options: dict[str, str] = {}
    parts = [p.strip() for p in body.split(",")]
    if parts and not parts[-1]:   # (a trailing comma, as Python takes one)
        parts.pop()
    for part in parts if body.strip() else []:
        key, sep, value = (x.strip() for x in part.partition("="))
        if not part:
            raise refuse("an empty option between two commas")
        if not sep:
            raise refuse(f"option {part!r} is not key=value")
        if not key:
            raise refuse(f"option {part!r} has no name")
        if not value:
            raise refuse(f"option {key!r} has no value")
        if "=" in value:
            raise refuse(f"option {key!r} is given {value!r}: options are separated by commas")
        if key in options:
            raise UnknownPolicyError(f"policy option {key!r} is given twice in {text!r}", fix="give each option once")
        options[key] = value
    return m.group(1), options


def resolve(policy: str | None, train: Callable[..., Any]) -> tuple[PolicySpec, Any]:
    """The policy and options for a run: the CLI's ``policy`` string, else the decorator's, else the default."""
    if policy is not None:
        name, raw = parse_policy(policy)
    else:
        name, raw = getattr(train, "__fragflow_policy__", (default_policy(), {}))
    spec = get(name)
    return spec, spec.make_options(dict(raw))


def distribute(policy: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Choose the distribution policy of a training function; ``--policy`` overrides it. ``policy``
    is a name with its options as keywords, or a ``--policy`` string (``"actor_learner(actors=2)"``).

    The function itself is unchanged: called directly it runs eagerly.

    >>> @distribute("single_process")
    ... def train(args):
    ...     pass
    >>> train.__fragflow_policy__
    ('single_process', {})
    """
    where = user_callsite()
    fix = 'write @ff.distribute("pipelined") above it, or another policy\'s name with its options: ' \
        '@ff.distribute("actor_learner", actors=2) (`fragflow policies` lists them)'
    if callable(policy):   # (both failed inside difflib, with a TypeError)
        raise UnknownPolicyError(f"@ff.distribute is given no policy: it was applied to "
                                 f"{getattr(policy, '__qualname__', policy)!r} itself", where=where, fix=fix)
    if not isinstance(policy, str):
        raise UnknownPolicyError(f"@ff.distribute got {policy!r:.60} where it takes a policy's name", where=where,
                                 fix=fix)
    try:   # fail at decoration time on a misspelled name or option, at the decorator's line
        # (its name, or the --policy form, "actor_learner(actors=2)": refused as an unknown name)
        name, written = parse_policy(policy)
        both = sorted(set(written) & set(options))
        if both:
            raise UnknownPolicyError(f"policy option {both[0]!r} is given twice: in {policy!r} and as a keyword "
                                     "argument", fix="give each option once")
        options = {**written, **options}
        get(name).make_options(dict(options))
    except FragflowError as exc:
        raise type(exc)(exc.what, where=where, fix=exc.fix, detail=exc.detail) from None

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__fragflow_policy__ = (name, dict(options))  # type: ignore[attr-defined]
        return fn

    return mark
