"""What a checkpoint saves of a process, and how a resumed one loads it back: the loop's locals
(its numbers and strings, ``ff.random`` keys, jax keys, random generators, plain containers and objects of
the user's own, every local object with
``state_dict``/``load_state_dict``), the process-wide random states, the versioned states; a loop
replica's part and its resume point. The files, the manifest and when checkpoints are taken are
:mod:`fragflow.runtime.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import random as pyrandom
import sys
import types
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from fragflow.compiler.pytree import backend_of
from fragflow.errors import FragflowError
from fragflow.runtime.encoding import _NO, Mismatch, Unsupported, _array, _enc, _torch, decode

if TYPE_CHECKING:
    from fragflow.runtime.checkpoint import Checkpoint

RANDOM = "__fragflow_random__"   # in a service group's states part: that process's global random states
# ... and the views of the state the acting side reads, of the versions before the saved one (see acting_views)
ACTING = "__fragflow_acting__"


class CheckpointError(FragflowError):
    """A checkpoint cannot be written or read, or does not fit the program resuming from it."""


# -- the loop's locals ----------------------------------------------------------------------------------
def loop_locals(frame_locals: dict[str, Any], skip: frozenset[int] | set[int] = frozenset(),
                strict: bool = True, recurrent: dict[tuple[Any, ...], str] | None = None,
                latest: dict[str, int] | None = None, where: Any = None, params: tuple[str, ...] = ()
                ) -> tuple[dict[str, Any], dict[str, np.ndarray], list[str]]:
    """What of a loop's locals a checkpoint keeps: ``(entries, arrays, names not kept)``. ``strict``
    (a checkpoint): a buffer of the user's own that cannot be saved is refused; else (an actor's
    restart snapshot, which the user never asked for) it is left out, as a buffer too big for one is.
    ``recurrent``: the outputs (fragment, index, path) the loop gives back to the fragment that made
    them at its next call, held in another process (a served actor's key), with that fragment's role;
    ``latest``: each fragment's last call. A local holding one made by its fragment's last call (the
    next trip gives it back) cannot be saved, and is refused where strict (a resumed run would start
    it anew); an older one is that trip's own, given back within it."""
    from fragflow.api.random import is_key
    from fragflow.api.versioned import Pending, Versioned, VersionedView, pendings_in

    torch = _torch()
    entries: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    left: list[str] = []
    recurrent, latest = recurrent or {}, latest or {}
    for name, x in frame_locals.items():
        key = f"local.{name}"
        carried = [p for p in pendings_in(x) if (p.fragment, p.index, p.path_keys) in recurrent
                   and p.call == latest.get(p.fragment, -2)] if recurrent and not name.startswith("__") else []
        if carried:
            if strict:
                p = carried[0]
                role = recurrent[(p.fragment, p.index, p.path_keys)]
                raise CheckpointError(
                    f"cannot save the loop's {name!r}: it holds an output of {role} '{p.fragment}' that the loop gives "
                    f"back to '{p.fragment}' at its next call, and this policy keeps it in the process that runs "
                    f"'{p.fragment}', so a run resumed from this checkpoint would start it anew (the loop's trips "
                    "begin at this line)", where=where,
                    fix="keep it in the loop: split the key there and give the actor the sub-key (`key, sub = "
                        "ff.random.split(key)`, then `act(..., sub)`), or checkpoint under a policy that acts where "
                        "the loop runs (pipelined, actor_learner)" if role == "actor" else
                        f"keep it in versioned state '{p.fragment}' writes (it then travels and is saved with the "
                        "state), or run with --policy single_process")
            left.append(name)
            continue
        if id(x) in skip or isinstance(x, (Versioned, VersionedView, Pending)) or name.startswith("__"):
            continue
        if name in params and dataclasses.is_dataclass(x) and not isinstance(x, type):
            continue   # the run's settings (Args): a resumed run's, with its --set, not the checkpoint's
        if x is None or isinstance(x, (bool, int, float, str, np.generic)):
            entries[name] = {"as": "value", "v": _enc(x, key, arrays)}
        elif is_key(x):
            entries[name] = {"as": "value", "v": _enc(x, key, arrays)}
        elif _jax_key(x):   # jax.random.PRNGKey's (uint32 [..., 2]): random state the loop carries
            arrays[key] = np.asarray(x)
            entries[name] = {"as": "jax_key", "k": key}
        elif isinstance(x, np.random.Generator):
            entries[name] = {"as": "np_generator", "state": x.bit_generator.state}
        elif isinstance(x, pyrandom.Random):
            entries[name] = {"as": "py_random", "state": _py_state(x.getstate())}
        elif torch is not None and isinstance(x, torch.Generator):
            arrays[key] = x.get_state().numpy()
            entries[name] = {"as": "torch_generator", "k": key}
        elif (callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))
              and not (torch is not None and isinstance(x, (torch.nn.Module, torch.optim.Optimizer)))
              and not isinstance(x, type)):
            try:
                entries[name] = {"as": "component", "type": type(x).__qualname__, "v": _enc(x.state_dict(), key, arrays)}
            except Unsupported as exc:
                raise CheckpointError(f"cannot save the loop's {name!r}: its state_dict() holds {exc}",
                                      fix="return arrays, numbers, strings and dicts/lists of them from state_dict()") from None
        elif (plain := _plain_container(x)) is not None:
            # a list, dict, tuple or deque of numbers, strings and arrays (recent returns, a history, a
            # counter dict): loaded in place, the loop's own object kept (what else holds it sees it)
            try:
                entries[name] = {"as": "container", "kind": plain[0], "maxlen": plain[1],
                                 "v": _enc(list(x) if plain[0] == "deque" else x, key, arrays)}
            except Unsupported:
                left.append(name)
        elif _plain_object(x) and not _buffer_of_users(x):   # (a buffer of the user's own: refused below, where
            # a service holds it, the loop's copy saved would be one no fragment fills)
            # an object of the user's class holding only such values (hand-written statistics): its attributes
            try:
                entries[name] = {"as": "attributes", "type": type(x).__qualname__, "v": _enc(dict(vars(x)), key, arrays)}
            except Unsupported:
                left.append(name)
        elif _state_given(x, skip):
            continue   # the value given to ff.versioned (nets = {"q": q, "opt": opt}): the state holds and saves it
        elif (not callable(x) or _own_instance(x)) and not isinstance(x, types.ModuleType):
            if strict and _buffer_of_users(x):   # its data is the run's: a resumed run would learn from an empty one
                raise CheckpointError(
                    f"cannot save the loop's {name!r}: a {type(x).__qualname__} holds the data its buffer fragments "
                    "keep, but has no state_dict()/load_state_dict(), so a run resumed from this checkpoint would "
                    "go on with it empty", where=_class_line(type(x)),
                    fix=f"give {type(x).__qualname__} state_dict() (returning its arrays, numbers and generators' "
                        "states) and load_state_dict(d) (setting them back), or run without --checkpoint-every")
            left.append(name)
    return entries, arrays, left


def _state_given(x: Any, held: frozenset[int] | set[int]) -> bool:
    """A dict, list or tuple holding objects the versioned state holds (its modules, optimizers) and
    otherwise only numbers and arrays: what the program gave ``ff.versioned`` (``state =
    ff.versioned(nets)``), its objects saved with the state (a learner returning a new dict leaves the
    loop's ``nets`` apart from the state's value, the same objects in it)."""
    if type(x) not in (dict, list, tuple) or not held:
        return False
    items = list(x.values() if isinstance(x, dict) else x)
    torch = sys.modules.get("torch")
    arrays = (np.ndarray,) if torch is None else (np.ndarray, torch.Tensor)   # (not numbers: a loop's counters)
    return any(id(i) in held for i in items) and all(id(i) in held or isinstance(i, arrays) for i in items)


CONTAINER_MAX = 1 << 20   # leaves of a container the loop keeps that a checkpoint saves (more: left out, said)


def _plain_leaf(v: Any) -> bool:
    torch = sys.modules.get("torch")   # (a tensor: a learner's metrics the loop holds, {"loss": tensor(0.3)})
    return v is None or isinstance(v, (bool, int, float, str, np.generic)) or \
        (isinstance(v, np.ndarray) and v.dtype != object) or (torch is not None and type(v) is torch.Tensor) or \
        backend_of(v) == "jax"   # (a jax array of numbers, not a typed key)


def _plain_container(x: Any, budget: list[int] | None = None) -> tuple[str, int | None] | None:
    """``(kind, maxlen)`` where ``x`` is a list, dict (of str/int keys), tuple or deque whose leaves
    are numbers, strings, None, numpy arrays and torch tensors (nested), at most ``CONTAINER_MAX`` of them: what
    the loop keeps across trips that a checkpoint can save and load back in place; else None."""
    budget = [CONTAINER_MAX] if budget is None else budget
    if isinstance(x, deque):
        kind, items, maxlen = "deque", list(x), x.maxlen
    elif type(x) is list:
        kind, items, maxlen = "list", x, None
    elif type(x) is tuple:
        kind, items, maxlen = "tuple", list(x), None
    elif type(x) is dict:
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
            return None
        kind, items, maxlen = "dict", list(x.values()), None
    else:
        return None
    budget[0] -= len(items)
    if budget[0] < 0:
        return None
    for v in items:
        if not (_plain_leaf(v) or _plain_container(v, budget) is not None):
            return None
    return kind, maxlen


def _users_class(klass: type) -> bool:
    """A class of the user's own: defined in a file of theirs, or arrived with the program by value
    (in a worker started afresh, spawned or from a fork server, the program's module is not
    imported: its classes came pickled by value, and a library's class is always of a module
    imported where its objects exist)."""
    from fragflow.compiler.reach import users_code

    module = sys.modules.get(klass.__module__)
    if module is None:
        return True
    return users_code(getattr(module, "__file__", None) or "<>")


def _plain_object(x: Any) -> bool:
    """An object of a class of the user's own (not a library's), without ``state_dict``, whose
    attributes are all numbers, strings, None, arrays or plain containers of them."""
    attrs = getattr(x, "__dict__", None)
    if not attrs or not _own_instance(x):
        return False
    return all(_plain_leaf(v) or _plain_container(v) is not None or _generator(v) for v in attrs.values())


def _generator(v: Any) -> bool:
    """A random generator an object of the user's own may hold (an exploration-noise object's)."""
    torch = sys.modules.get("torch")
    return isinstance(v, (np.random.Generator, np.random.RandomState)) or type(v) is pyrandom.Random or \
        (torch is not None and isinstance(v, torch.Generator))


def _own_instance(x: Any) -> bool:
    """An instance of a class of the user's own with attributes of its own, callable or not (an
    exploration-noise object drawn by calling it), other than a torch module or optimizer (what the
    loop rebuilds, or versioned state holds)."""
    if isinstance(x, type) or type(getattr(x, "__dict__", None)) is not dict or not _users_class(type(x)):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and isinstance(x, (torch.nn.Module, torch.optim.Optimizer)))


def unsaved_note(frame_locals: dict[str, Any], left: list[str]) -> list[str]:
    """Of the loop's locals a checkpoint leaves out (``left``), those a resumed run would silently
    start afresh where the loop keeps them across trips: objects of the user's own classes and
    containers (what the loop rebuilds, arrays of observations, environments, modules, is not
    named), each as ``name (a Type)``."""
    out = []
    for name in left:
        x = frame_locals.get(name)
        own = _users_class(type(x)) and type(getattr(x, "__dict__", None)) is dict
        if own or (type(x) in (list, dict, tuple, set, deque) and not _of_code(x)):
            out.append(f"'{name}' (a {type(x).__qualname__})")
    return out


def _of_code(x: Any) -> bool:
    """A container of classes and functions only (``wrappers=[gym.wrappers.NormalizeObservation]``):
    configuration the program builds again alike, with no state to save."""
    import functools
    import types

    items = list(x.values() if isinstance(x, dict) else x)
    return bool(items) and all(isinstance(i, (type, types.FunctionType, types.BuiltinFunctionType, functools.partial))
                               for i in items)


def _class_line(klass: type) -> Any:
    """Where the user's class is defined (``file:line``), where that can be found: through its
    module, or, for a class that arrived by value in a process started afresh (its module not
    imported there), the ``class`` line above its first method in the file its methods came from."""
    import inspect
    import linecache
    import re

    from fragflow.source import SourceLoc

    try:
        return SourceLoc.of(inspect.getsourcefile(klass) or "", inspect.getsourcelines(klass)[1])
    except (OSError, TypeError):
        pass
    codes = [code for v in vars(klass).values()
             for code in (getattr(getattr(v, "fn", v), "__code__", None),) if code is not None]
    if not codes:
        return None
    first = min(codes, key=lambda c: c.co_firstlineno)
    header = re.compile(rf"\s*class\s+{re.escape(klass.__name__)}\b")
    for line in range(first.co_firstlineno - 1, 0, -1):
        if header.match(linecache.getline(first.co_filename, line)):
            return SourceLoc.of(first.co_filename, line)
    return None


def _buffer_of_users(x: Any) -> bool:
    """An object of a class with ``@ff.fragment("buffer")`` methods (a replay buffer of the user's
    own), or holding such fragments it made of its methods (``self.add = ff.fragment("buffer")(self._add)``;
    not another object's it keeps, ``self.remember = memory.add``, whose data is that object's)."""
    from fragflow.api.fragment import Fragment

    def buffer(v: Any) -> bool:
        return isinstance(v, Fragment) and v.role == "buffer"

    own = getattr(x, "__dict__", None)
    return (any(buffer(v) for klass in type(x).__mro__ for v in vars(klass).values())
            or any(buffer(v) and (v.instance is x or getattr(v.fn, "__self__", None) is x)
                   for v in (own.values() if isinstance(own, dict) else ())))


def _jax_key(x: Any) -> bool:
    """A legacy jax PRNG key (``jax.random.PRNGKey``: uint32, last axis 2), or a batch of them."""
    return type(x).__module__.startswith(("jax", "jaxlib")) and str(getattr(x, "dtype", "")) == "uint32" \
        and bool(getattr(x, "shape", ())) and x.shape[-1] == 2


def _py_state(state: Any) -> Any:
    return [state[0], list(state[1]), state[2]]


def restore_locals(entries: dict[str, Any], arrays: dict[str, np.ndarray], live: dict[str, Any]) -> dict[str, Any]:
    """Given the loop's locals as the resumed run has rebuilt them, the values to assign; objects
    (generators, components) are loaded in place. A saved name the program no longer has is
    assigned anyway (the loop defines it later)."""
    from fragflow.api.random import as_key

    torch = _torch()
    assign: dict[str, Any] = {}
    for name, e in entries.items():
        how = e["as"]
        x = live.get(name)
        try:
            if how == "value":
                cur = live.get(name, _NO)
                value = decode(e["v"], arrays, cur if isinstance(cur, np.ndarray) else _NO, name)
                # (the loop's arrays saved are its keys: a resumed run checkpointed again before it
                # splits them, at its first trip, left them out, and its own resume drew other numbers)
                assign[name] = as_key(value) if isinstance(value, np.ndarray) else value
            elif how == "jax_key":
                import jax.numpy as jnp

                assign[name] = jnp.asarray(_array(arrays, e["k"]))
            elif how == "np_generator" and isinstance(x, np.random.Generator):
                x.bit_generator.state = e["state"]
            elif how == "py_random" and isinstance(x, pyrandom.Random):
                s = e["state"]
                x.setstate((s[0], tuple(s[1]), s[2]))
            elif how == "torch_generator" and torch is not None and isinstance(x, torch.Generator):
                x.set_state(torch.from_numpy(_array(arrays, e["k"]).copy()))
            elif how == "container":
                value = decode(e["v"], arrays, path=name)
                kind = e["kind"]
                if kind == "list" and type(x) is list:
                    x[:] = value
                elif kind == "dict" and type(x) is dict:
                    x.clear()
                    x.update(value)
                elif kind == "deque" and isinstance(x, deque) and x.maxlen == e["maxlen"]:
                    x.clear()
                    x.extend(value)
                else:   # (the loop makes it later, or makes another kind now: the saved one)
                    assign[name] = deque(value, e["maxlen"]) if kind == "deque" else \
                        tuple(value) if kind == "tuple" else value
            elif how == "attributes":
                if x is None or type(x).__qualname__ != e["type"] or type(getattr(x, "__dict__", None)) is not dict:
                    raise Mismatch(f"the loop's {name!r} ({e['type']}) is not there to load into")
                attrs = x.__dict__
                for k, m in e["v"]["items"]:   # (a generator it holds is loaded in place: what else holds it sees it)
                    now = attrs.get(k, _NO)
                    attrs[k] = decode(m, arrays, now if _generator(now) else _NO, f"{name}.{k}")
            elif how == "component":
                if x is None or not callable(getattr(x, "load_state_dict", None)):
                    raise Mismatch(f"the loop's {name!r} ({e['type']}) is not there to load into")
                x.load_state_dict(decode(e["v"], arrays, path=name))
        except Mismatch:
            raise
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise Mismatch(f"the loop's {name!r}: {exc}") from None
    return assign


def global_random() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The process-wide random states: torch's, numpy's legacy one, python's ``random``."""
    torch = _torch()
    entries: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    arrays["random.numpy"] = np.asarray(keys)
    entries["numpy"] = [name, int(pos), int(has_gauss), float(cached)]
    entries["python"] = _py_state(pyrandom.getstate())
    if torch is not None:
        arrays["random.torch"] = torch.get_rng_state().numpy()
    return entries, arrays


GENERATORS = ("numpy", "python", "torch")


def set_global_random(entries: dict[str, Any], arrays: dict[str, np.ndarray],
                      only: tuple[str, ...] | list[str] = GENERATORS) -> None:
    torch = _torch()
    if "numpy" in only:
        name, pos, has_gauss, cached = entries["numpy"]
        np.random.set_state((name, _array(arrays, "random.numpy"), pos, has_gauss, cached))
    if "python" in only:
        s = entries["python"]
        pyrandom.setstate((s[0], tuple(s[1]), s[2]))
    if "torch" in only and torch is not None and "random.torch" in arrays:
        torch.set_rng_state(torch.from_numpy(arrays["random.torch"].copy()))


def drawn(now: tuple[dict[str, Any], dict[str, np.ndarray]], then: tuple[dict[str, Any], dict[str, np.ndarray]]) -> list[str]:
    """The process-wide generators drawn from between two :func:`global_random` states."""
    (e1, a1), (e0, a0) = now, then
    out = []
    if e1["numpy"] != e0["numpy"] or not np.array_equal(a1["random.numpy"], a0["random.numpy"]):
        out.append("numpy")
    if e1["python"] != e0["python"]:
        out.append("python")
    if "random.torch" in a1 and ("random.torch" not in a0 or not np.array_equal(a1["random.torch"], a0["random.torch"])):
        out.append("torch")
    return out


def drawn_apart(ckpt: Checkpoint) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """Of a checkpoint written across processes, the random states of the (first) service whose
    process drew from its generators, and which it drew from (``entries["drew"]``): a run resumed in
    one process goes on from those."""
    for name in ckpt.manifest.get("parts", {}):
        if name.startswith("states."):
            meta, arrays = ckpt.part(name)
            if meta.get(RANDOM, {}).get("drew"):
                return meta[RANDOM], arrays
    return None


def encode_states(states: dict[str, tuple[int, Any]]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The ``states`` part: each versioned state's version and value."""
    meta: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, (version, value) in states.items():
        try:
            meta[name] = {"version": version, "v": _enc(value, f"state.{name}", arrays)}
        except Unsupported as exc:
            raise CheckpointError(f"cannot save versioned state {name!r}: {exc}",
                                  fix="keep arrays, numbers, modules and optimizers (and dicts/lists of them) in versioned state") from None
    return meta, arrays


def restore_state(part: tuple[Any, dict[str, np.ndarray]], name: str, value: Any, where: Any = None) -> tuple[Any, int]:
    """Versioned state ``name`` as saved, loaded into the program's freshly built ``value``; and its version."""
    meta, arrays = part
    if name not in meta:   # a state no process of the placement wrote or held (loop-only): as the program makes it
        return value, 0
    try:
        restored = decode(meta[name]["v"], arrays, value, name)
    except Mismatch as exc:
        raise CheckpointError(f"the checkpoint does not fit this program: {exc}", where=where,
                              fix="resume with the algorithm and arguments that wrote it (shapes come from the args)") from None
    return restored, int(meta[name]["version"])


def encode_acting(views: dict[str, dict[int, list[Any]]], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The ``ACTING`` entry of a states part: of each broadcast state, the leaves the acting side
    reads of the version ``k`` before the saved one, for ``k`` in 1..max_lag (an exact version
    choice acts with them on the loop's next trips: a resumed run must too)."""
    try:
        return {state: {str(k): _enc(leaves, f"acting.{state}.{k}", arrays) for k, leaves in by.items()}
                for state, by in views.items()}
    except Unsupported as exc:   # (the broadcast's leaves are arrays and numbers: not expected)
        raise CheckpointError(f"cannot save the acting side's views: {exc}") from None


def acting_views(part: tuple[Any, dict[str, np.ndarray]] | None) -> dict[str, dict[int, list[Any]]]:
    """The views :func:`encode_acting` saved, keyed by the version they are in a run resumed from
    the checkpoint, whose saved version is its version 0: ``-k``."""
    if part is None:
        return {}
    meta, arrays = part
    return {state: {-int(k): decode(v, arrays, path=f"acting.{state}.{k}") for k, v in by.items()}
            for state, by in meta.get(ACTING, {}).items()}


def held_by_state(states: dict[str, Any]) -> set[int]:
    """Ids of the objects the loop's versioned state holds (its modules, optimizers, schedulers):
    saved with the states, not again as the loop's locals (a scheduler the loop also names would be
    its copy, never stepped where the learner runs apart, and a resume would load it over the
    state's)."""
    from fragflow.compiler.reach import objects_of

    return {id(o) for handle in states.values() for o in objects_of(handle.value)}


def loop_part(snapshot: Any, skip: frozenset[int] | set[int] = frozenset(), strict: bool = True,
              recurrent: dict[tuple[Any, ...], str] | None = None, latest: dict[str, int] | None = None
              ) -> tuple[dict[str, Any], tuple[Any, dict[str, np.ndarray]]]:
    """A loop replica's position and part from a trip snapshot: ``(position, (meta, arrays))``
    (``strict``, ``recurrent``, ``latest``: see :func:`loop_locals`)."""
    from fragflow.source import SourceLoc, display_path

    where = SourceLoc(display_path(snapshot.file), snapshot.line) if snapshot.file else None
    entries, arrays, left = loop_locals(snapshot.frame_locals, skip, strict, recurrent, latest, where,
                                        getattr(snapshot, "params", ()))
    rng, rng_arrays = global_random()
    arrays.update(rng_arrays)
    meta = {"line": snapshot.line, "trip": snapshot.trip, "locals": entries, "random": rng, "not_saved": left,
            "unsaved": unsaved_note(snapshot.frame_locals, left)}
    if not strict:   # (a restart snapshot: buffers of the user's own it could not take, which a restart would empty)
        # (name, class, the prefix of its fragments' names: where a service holds it, the loop's copy is unused)
        meta["lost"] = [[n, type(x).__qualname__, getattr(x, "name", None) or type(x).__name__] for n in left
                        if _buffer_of_users(x := snapshot.frame_locals.get(n))]
    return ({"line": snapshot.line, "trip": snapshot.trip}, (meta, arrays))


def served_objects(ckpt: Checkpoint) -> dict[str, tuple[Any, dict[str, np.ndarray]]]:
    """The objects service groups saved (``learner_replay``'s replay buffer), by name: where the
    resumed placement keeps such an object in the loop, the loop loads it from there, not from its
    own copy, which that placement never filled."""
    out: dict[str, tuple[Any, dict[str, np.ndarray]]] = {}
    for name in ckpt.manifest.get("parts", {}):
        if name.startswith("objects."):
            meta, arrays = ckpt.part(name)
            for key, v in meta.items():
                out[key] = (v, arrays)
    return out


def resume_point(part: tuple[Any, dict[str, np.ndarray]],
                 served: dict[str, tuple[Any, dict[str, np.ndarray]]] | None = None,
                 held_here: Any = None, apart: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None,
                 recomputed: Any = None) -> Any:
    """A loop replica's :class:`~fragflow.runtime.trips.Resume` from its part: when the saved loop
    starts again, the process's random states are set and the loop's locals loaded (an object a
    service group saved, ``served``, from that group's part where ``held_here(name)``: the loop
    now holds it). ``apart`` (one process resuming a checkpoint written across processes, see
    :func:`drawn_apart`): a generator a service drew from goes on from the service's state (where
    the loop's process drew from it too, one process would have interleaved their draws: neither
    state is where it stood). ``recomputed`` (a run resumed with args changed from the checkpoint's):
    a callable given what the values the program computed before its loops, from the new args, keep
    (see :func:`kept_as_computed`), to say so where they differ from the checkpoint's."""
    from fragflow.runtime.trips import Resume

    meta, arrays = part

    def restore(frame: Any) -> dict[str, Any]:
        set_global_random(meta["random"], arrays)
        if apart is not None:
            set_global_random(apart[0], apart[1], apart[0]["drew"])
        entries, found = meta["locals"], arrays
        if recomputed is not None:
            entries, changed = kept_as_computed(entries, arrays, frame)
            if changed:
                recomputed(changed)
        if served:
            entries, found = dict(entries), dict(arrays)
            for name, e in meta["locals"].items():
                x = frame.f_locals.get(name)
                key = getattr(x, "name", None) or type(x).__name__
                if e["as"] == "component" and key in served and (held_here is None or held_here(key)):
                    v, more = served[key]
                    entries[name] = dict(e, v=v)
                    found.update(more)
        try:
            return restore_locals(entries, found, frame.f_locals)
        except Mismatch as exc:   # named at the loop the checkpoint resumes
            from fragflow.source import SourceLoc, display_path

            raise CheckpointError(f"the checkpoint does not fit this program: {exc}",
                                  where=SourceLoc(display_path(frame.f_code.co_filename), int(meta["line"])),
                                  fix="resume with the algorithm and arguments that wrote it") from None

    return Resume(int(meta["line"]), int(meta["trip"]), restore)


def _immutable(x: Any) -> bool:
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, np.generic)):
        return True
    return isinstance(x, (tuple, frozenset)) and all(_immutable(v) for v in x)


def kept_as_computed(entries: dict[str, Any], arrays: dict[str, np.ndarray], frame: Any
                     ) -> tuple[dict[str, Any], list[tuple[str, Any, Any]]]:
    """The saved loop locals a run resumed with changed args assigns: not a value the program binds
    only before its first loop and never changes after (a number, a string, a tuple of them:
    ``num_updates = args.total_timesteps // batch``), which this run has just computed from its own
    args (a saved one would put the old args' back, its loop's header and body disagreeing). Also
    (name, the checkpoint's value, this run's) of those that differ."""
    from fragflow.compiler.resumable import set_before_loops

    before = set_before_loops(frame.f_code)
    if not before:
        return entries, []
    live = frame.f_locals
    kept: dict[str, Any] = {}
    changed: list[tuple[str, Any, Any]] = []
    for name, e in entries.items():
        now = live.get(name, _NO)
        tuple_ = e["as"] == "container" and e.get("kind") == "tuple"
        if (e["as"] == "value" or tuple_) and name in before and now is not _NO and _immutable(now):
            try:
                saved = decode(e["v"], arrays, _NO, name)
            except Exception:   # (the entry is left to the restore, which reports what does not fit)
                kept[name] = e
                continue
            saved = tuple(saved) if tuple_ else saved
            if type(saved) is not type(now) or not (saved == now or repr(saved) == repr(now)):
                changed.append((name, saved, now))
            continue
        kept[name] = e
    return kept, changed


def recomputed_message(changed: list[tuple[str, Any, Any]]) -> str:
    shown = ", ".join(f"{name} {_short(saved)} -> {_short(now)}" for name, saved, now in changed[:6])
    more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
    return (f"resumed with args changed from the checkpoint's: the values the training function computes before "
            f"its loop are this run's, from its args, not the checkpoint's: {shown}{more}")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def copied_generators(frame: Any, replicas: int, held_out: list[tuple[str, Any]] | None = None) -> str | None:
    """A warning, where the loop holds random generators of its own (``rng = np.random.default_rng(s)``,
    an exploration-noise object of the user's class holding one): each of the ``replicas`` loop
    processes, which split the environments, holds a copy of it, so numbers drawn from it for each
    process's environments repeat across processes where one process would draw a number for each.
    One a versioned state holds is most likely its learner's (TD3's smoothing noise), which draws from
    the one it holds: it goes to ``held_out`` instead, named only if the loop's copy moves later."""
    torch = _torch()
    kinds = (np.random.Generator, pyrandom.Random, np.random.RandomState) + ((torch.Generator,) if torch else ())
    module = frame.f_globals.get("__name__")
    from fragflow.api.versioned import Versioned
    from fragflow.compiler.reach import attributes_read, objects_of

    found: list[str] = []
    names = {name: x for name in frame.f_code.co_names
             if not name.startswith("__") and (x := frame.f_globals.get(name, _NO)) is not _NO}   # (the module's it reads)
    pairs = [*frame.f_locals.items(), *names.items()]
    held = {id(o) for _, x in pairs if isinstance(x, Versioned) for o in objects_of(x.value) if isinstance(o, kinds)}
    for name, x in pairs:
        if name.startswith("__"):
            continue
        if isinstance(x, kinds):
            if id(x) in held:
                if held_out is not None:
                    held_out.append((generator_label(name, x), x))
                continue
            found.append(generator_label(name, x))
        elif getattr(type(x), "__module__", None) == module and type(getattr(x, "__dict__", None)) is dict:
            # an object of the user's own (an exploration-noise object, a replay buffer): named once the loop's copy
            # draws (``held_out``); a buffer whose fragments run beside the learner (learner_replay) draws there
            mine = [(generator_label(f"{name}.{attr}", v), v) for attr, v in vars(x).items() if isinstance(v, kinds)]
            if held_out is not None:
                held_out += mine
            else:
                found += [label for label, _ in mine]
    # an env's action space sampled in the loop (CleanRL's warm-up `envs.single_action_space.sample()`): its
    # generator, copied into every process, draws the same random actions in each. Named once it has drawn
    # (``held_out``): a loop that reads the space's size or bounds and samples something else (a replay
    # buffer's `rb.sample`) draws nothing from it
    used = attributes_read(frame.f_code)
    if "sample" in used and held_out is not None:
        for attr in ("single_action_space", "action_space"):
            if attr in used:
                held_out += [(f"`{name}.{attr}` (its sample()'s generator)", gen) for name, x in frame.f_locals.items()
                             if not name.startswith("__") and _is_env(x) and
                             (gen := getattr(getattr(x, attr, None), "_np_random", None)) is not None]
    found = list(dict.fromkeys(found))
    return copied_message(frame.f_code, found, replicas) if found else None


def global_generators() -> list[tuple[str, Any]]:
    """The process-wide random generators (label, generator): torch's (once imported), numpy's and
    Python's global ones, which every loop process starts from in the same state."""
    torch = _torch()
    found = [("torch's global generator (`torch.manual_seed`'s: `torch.distributions`' `sample()`, `torch.rand`, "
              "`torch.multinomial`)", torch.default_generator)] if torch is not None else []
    return found + [("numpy's global generator (`np.random.rand`, `np.random.choice`)", np.random.mtrand._rand),
                    ("Python's `random` (`random.random()`)", pyrandom._inst)]


def global_message(code: Any, found: list[str], replicas: int) -> str:
    """The warning for the process-wide generators ``found`` (their labels) the loop, or a fragment
    run in its process (an actor sampling its actions), drew from."""
    from fragflow.source import display_path

    return (f"the training loop ({display_path(code.co_filename)}:{code.co_firstlineno}, `{code.co_name}`), or a "
            f"fragment run in its process (an actor sampling actions), draws from {' and '.join(found)}: each of the "
            f"{replicas} loop processes, which split the environments, starts from the same state of it, so numbers it "
            "draws for its own environments (sampled actions, exploration) repeat across processes (the second "
            "process's first environment gets what the first process's first environment gets) where one process "
            "would draw a number for each. For numbers per environment use ff.random keys (`key = "
            "ff.random.keys(seed, env.ids)`, then `key, sub = ff.random.split(key)`; a categorical sample is "
            "`(logits + ff.random.gumbel(sub, logits.shape[1:])).argmax(-1)`, a normal one `ff.random.normal(sub, "
            "shape)`), the same under every policy; or run one loop process (actors=1, env_workers=1, or --policy "
            "single_process)")


def _is_env(x: Any) -> bool:
    """An environment fragflow made (``ff.envs.make``), which the loop steps."""
    from fragflow.api.envs import VectorEnv

    return isinstance(x, VectorEnv)


def generator_label(name: str, x: Any) -> str:
    return f"`{name}` (a {type(x).__module__.split('.')[0]}.{type(x).__name__})"


def copied_message(code: Any, found: list[str], replicas: int) -> str:
    """The warning of :func:`copied_generators` for the generators ``found`` (their labels)."""
    from fragflow.source import display_path

    return (f"the training loop ({display_path(code.co_filename)}:{code.co_firstlineno}, `{code.co_name}`) holds or reads the random "
            f"generator{'s' if len(found) > 1 else ''} {', '.join(found)}: each of the {replicas} loop processes, "
            "which split the environments, holds a copy, so numbers it draws for its own environments (exploration "
            "noise) repeat across processes (the second process's first environment gets what the first process's "
            "first environment gets) where one process would draw a number for each. For numbers per environment "
            "use ff.random keys (`key = ff.random.keys(seed, env.ids)`, then `key, sub = ff.random.split(key)` and "
            "`ff.random.normal(sub, shape)`), the same under every policy; or run one loop process (actors=1, "
            "env_workers=1, or --policy single_process)")
