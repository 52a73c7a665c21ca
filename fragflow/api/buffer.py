"""Rollout buffers: gather per-step data into one batch, as a fragment with role ``buffer``.

``buf.add(**step)`` stores one step (every leaf with the environments on its leading axis; a
value may be a dict of such leaves, as a Dict observation space gives);
``buf.collect(**last)`` returns the batch: every step leaf stacked to ``[num_steps, num_envs,
...]``, plus the ``last`` leaves (e.g. the bootstrap observation) as given, ``[num_envs, ...]``.
The buffer records that environment axis per leaf, which is how a policy that splits the
environments across actor processes reassembles one learner batch from several pieces.

>>> buf = RolloutBuffer(num_steps=2)
>>> for t in range(2):
...     buf.add(obs=np.full((3, 4), t, np.float32))
>>> batch = buf.collect(next_obs=np.zeros((3, 4), np.float32))
>>> batch["obs"].shape, batch["next_obs"].shape
((2, 3, 4), (3, 4))
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from fragflow import context
from fragflow.api.fragment import Fragment, rows
from fragflow.compiler.pytree import backend_of
from fragflow.errors import TraceError
from fragflow.source import user_callsite


def whole_number(value: Any, owner: str, what: str, example: str) -> None:
    """Refuse a size that is not an int, at the user's line: a float (``1e6``) or a string failed
    later, inside the buffer, as a TypeError or AttributeError at its first add or sample."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TraceError(f"{owner} got {what}={value!r:.40}, where it takes a whole number", where=user_callsite(),
                         fix=f"pass an int: {owner}({example}); a float such as 1e6 is int(1e6), and a dataclass "
                             "field holding it is annotated int")

class RolloutBuffer:
    """A fixed-length rollout buffer; storage is allocated anew for every rollout."""

    def __init__(self, num_steps: int) -> None:
        whole_number(num_steps, "RolloutBuffer", "num_steps", "args.num_steps")
        if num_steps < 1:
            raise TraceError(f"RolloutBuffer needs num_steps >= 1, got {num_steps}", where=user_callsite(),
                             fix="pass the number of steps per rollout")
        interp = context.current()
        self.name = "buffer" if interp is None else interp.instance_name("buffer")
        self.num_steps = num_steps
        self._storage: dict[str, Any] | None = None
        self._step_keys: frozenset[str] = frozenset()
        self._time_major: frozenset[str] = frozenset()   # collect()'s leaves that start [time, env]
        self._order: tuple[str, ...] | None = None
        self._views: dict[str, Any] = {}
        self._t = 0
        self.add = Fragment(self._add, "buffer", name=f"{self.name}.add", instance=self, in_axes=rows)
        self.collect = Fragment(self._collect, "buffer", name=f"{self.name}.collect", instance=self,
                                axes=self._axes)

    def _add(self, **step: Any) -> None:
        if self._t >= self.num_steps:
            raise TraceError(f"{self.name}.add called {self._t + 1} times before collect, but num_steps={self.num_steps}",
                             where=user_callsite(), fix="call collect() after every num_steps adds")
        if self._storage is None:
            nested = [found for k, v in step.items() for found in _sequences(v, k, k)]
            if nested:
                raise TraceError(f"{self.name}.add got '{nested[0][0]}' as a {nested[0][1]} (a Tuple "
                                 "action or observation?): a rollout buffer stores arrays and dicts of arrays",
                                 where=user_callsite(), fix=f"add each entry under a key of its own ({nested[0][2]}_0=..., "
                                 f"{nested[0][2]}_1=...), or give it as a dict")
            sizes = {k: np.shape(v)[0] for k, v in step.items() if not isinstance(v, dict) and np.ndim(v) >= 1}
            if len(set(sizes.values())) > 1:
                raise TraceError(f"{self.name}.add got leaves with different numbers of rows: "
                                 + ", ".join(f"'{k}' {n}" for k, n in sizes.items()), where=user_callsite(),
                                 fix="give every leaf one row per environment this process steps (size "
                                     "per-environment arrays with env.num_envs, which is this process's share "
                                     "where a policy splits the environments)")
            # the keys in the order of the first rollout's first add, however later adds order them: the
            # collected batch is the same pytree every rollout
            order = self._order if self._order is not None and set(self._order) == set(step) else tuple(step)
            self._order = order
            self._storage = {k: _alloc(self.num_steps, step[k]) for k in order}
            self._views = {k: _view(s) for k, s in self._storage.items()}
        elif step.keys() != self._storage.keys():
            raise TraceError(f"{self.name}.add got keys {sorted(step)}, earlier {sorted(self._storage)}",
                             where=user_callsite(), fix="add the same keys at every step")
        t = self._t
        views = self._views
        for k, v in step.items():
            view = views[k]
            if type(view) is dict:   # a Dict observation: its leaves, each stored as any other
                _put(view, t, v)
            else:
                try:
                    view[t] = _host(v) if type(view) is np.ndarray else _detached(v)   # (torch storage: on a GPU, bfloat16)
                except ValueError:
                    raise TraceError(f"{self.name}.add got '{k}' of shape {tuple(np.shape(v))}, but its storage "
                                     f"holds steps of shape {tuple(view.shape[1:])} (from the first add)",
                                     where=user_callsite(),
                                     fix="add the same shapes at every step: one row per environment this process "
                                         "steps (size per-environment arrays with env.num_envs, which is this "
                                         "process's share where a policy splits the environments)") from None
        self._t = t + 1

    def _collect(self, **last: Any) -> dict[str, Any]:
        if self._t != self.num_steps or self._storage is None:
            raise TraceError(f"{self.name}.collect called after {self._t} adds, expected num_steps={self.num_steps}",
                             where=user_callsite(), fix="add exactly num_steps steps before each collect")
        clash = set(last) & set(self._storage)
        if clash:
            raise TraceError(f"{self.name}.collect got {sorted(clash)}, which are also step keys",
                             where=user_callsite(), fix="give the collect() arguments other names")
        self._step_keys = frozenset(self._storage)
        self._time_major = frozenset(k for k, v in last.items() if _time_major(v, self.num_steps, self._storage))
        batch = dict({k: _as_added(v) for k, v in self._storage.items()}, **last)
        self._storage, self._t = None, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: the steps added to the rollout under way (a loop checkpointed
        between its adds and its ``collect``), as numpy arrays, with the library each was added in."""
        if self._storage is None or not self._t:
            return {"t": 0}
        return {"t": self._t, "order": list(self._storage),
                "steps": {k: _saved(v, self._t) for k, v in self._storage.items()},
                "kinds": {k: _kind(v) for k, v in self._storage.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the rollout a checkpoint saved (the environments were reset: its next steps come
        from new episodes)."""
        t = int(state["t"])
        if t > self.num_steps:
            raise ValueError(f"the saved rollout holds {t} steps, more than this buffer's num_steps={self.num_steps}")
        self._storage, self._views, self._t = None, {}, 0
        if not t:
            return
        order = tuple(state["order"])
        self._order = order
        self._storage = {k: _restored(self.num_steps, state["steps"][k], state["kinds"][k]) for k in order}
        self._views = {k: _view(v) for k, v in self._storage.items()}
        self._t = t

    def _axes(self, path: str) -> tuple[str, int]:
        """The ``env`` axis of a collected batch's leaf: 1 for step data ``[time, env, ...]``, 0 for
        the ``last`` leaves ``[env, ...]``, 1 for a ``last`` leaf the loop stacked per step, which
        starts ``[time, env]`` as the steps do (``collect(logp=np.stack(logps))``)."""
        key = path[2:].split("'")[0] if path.startswith("['") else ""
        return ("env", 1 if key in self._step_keys or key in self._time_major else 0)


def _time_major(x: Any, num_steps: int, storage: dict[str, Any]) -> bool:
    """Whether a ``collect`` argument starts ``[time, env]`` like the step data: its first two sizes
    are the rollout's steps and environments (where the two counts are equal, nothing tells it from
    an ``[env, ...]`` leaf, which it is taken for, as before)."""
    shape = getattr(x, "shape", None)
    envs = {v.shape[1] for v in storage.values() if not isinstance(v, dict) and len(getattr(v, "shape", ())) >= 2}
    return (shape is not None and len(shape) >= 2 and len(envs) == 1 and shape[0] == num_steps
            and shape[1] in envs and num_steps not in envs)


def _view(storage: Any) -> Any:
    """A numpy view of (torch) storage: assigning through numpy is several times cheaper than
    indexing a torch tensor, and writes the same memory."""
    if isinstance(storage, dict):
        return {k: _view(v) for k, v in storage.items()}
    if isinstance(storage, np.ndarray) or storage.device.type != "cpu" or str(storage.dtype) == "torch.bfloat16":
        return storage   # (numpy has no bfloat16: written as torch)
    return storage.numpy()


def _put(view: dict[str, Any], t: int, step: Any) -> None:
    if not isinstance(step, dict) or step.keys() != view.keys():
        raise TraceError(f"a buffer's dict leaf got {sorted(step) if isinstance(step, dict) else type(step).__name__}, "
                         f"earlier the keys {sorted(view)}", where=user_callsite(3),
                         fix="add the same keys at every step")
    for k, v in step.items():
        if type(view[k]) is dict:
            _put(view[k], t, v)
        else:
            view[k][t] = _host(v) if type(view[k]) is np.ndarray else _detached(v)


def _detached(v: Any) -> Any:
    return v.detach() if getattr(v, "requires_grad", False) else v


def _host(v: Any) -> Any:
    """``v`` for a numpy view's assignment: a torch tensor as numpy (copied from a GPU)."""
    if type(v) is np.ndarray or not hasattr(v, "numpy"):
        return v
    device = getattr(v, "device", None)
    if getattr(v, "requires_grad", False):   # (an actor computing without torch.no_grad: its values are stored)
        v = v.detach()
    return v.cpu().numpy() if getattr(device, "type", "cpu") != "cpu" else v.numpy()


def _alloc(num_steps: int, x: Any) -> Any:
    if isinstance(x, dict):   # a Dict observation space's leaves
        return {k: _alloc(num_steps, v) for k, v in x.items()}
    backend = backend_of(x)
    if backend == "torch":
        import torch

        return torch.empty((num_steps, *x.shape), dtype=x.dtype, device=x.device)
    arr = np.asarray(x)
    if backend == "jax":   # gathered in host memory, handed back as one jax array by collect
        return _JaxSteps((num_steps, *arr.shape), dtype=arr.dtype)
    return np.empty((num_steps, *arr.shape), dtype=arr.dtype)


def _saved(storage: Any, t: int) -> Any:
    if isinstance(storage, dict):
        return {k: _saved(v, t) for k, v in storage.items()}
    return np.array(_view(storage)[:t].view(np.ndarray) if isinstance(storage, np.ndarray) else
                    storage[:t].cpu().numpy())


def _kind(storage: Any) -> Any:
    if isinstance(storage, dict):
        return {k: _kind(v) for k, v in storage.items()}
    if isinstance(storage, _JaxSteps):
        return "jax"
    kind = backend_of(storage) or "numpy"
    return f"torch@{storage.device}" if kind == "torch" and storage.device.type != "cpu" else kind


def _restored(num_steps: int, steps: Any, kind: Any) -> Any:
    """Storage for ``num_steps`` steps of the library ``kind``, its first rows ``steps``."""
    if isinstance(kind, dict):
        return {k: _restored(num_steps, steps[k], kind[k]) for k in kind}
    steps = np.asarray(steps)
    if kind.startswith("torch"):   # ("torch@cuda:0": a rollout of tensors on a GPU goes back there)
        import torch

        device = kind.partition("@")[2] or "cpu"
        out = torch.empty((num_steps, *steps.shape[1:]), dtype=torch.from_numpy(steps[:0].copy()).dtype, device=device)
        out[:len(steps)] = torch.from_numpy(steps.copy())
        return out
    arr = np.empty((num_steps, *steps.shape[1:]), dtype=steps.dtype)
    arr[:len(steps)] = steps
    return arr.view(_JaxSteps) if kind == "jax" else arr


class _JaxSteps(np.ndarray):
    """Storage for a leaf added as jax arrays: numpy memory, returned by ``collect`` as a jax array."""


def _as_added(storage: Any) -> Any:
    """A collected leaf in the library it was added in."""
    if isinstance(storage, dict):
        return {k: _as_added(v) for k, v in storage.items()}
    if isinstance(storage, _JaxSteps):
        import jax.numpy as jnp

        return jnp.asarray(storage.view(np.ndarray))
    return storage


def _sequences(value: Any, path: str, key: Any) -> list[tuple[str, str, Any]]:
    """(path, type, key) of the tuples and lists of arrays in a step's value, a dict's entries too
    (a Tuple inside a Dict observation): numpy would stack their parts into one array, the
    environments' axis second."""
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _sequences(v, f"{path}[{k!r}]", k)]
    if isinstance(value, (tuple, list)) and any(getattr(x, "ndim", 0) >= 1 or isinstance(x, (tuple, list, dict))
                                                for x in value):
        return [(path, type(value).__name__, key)]
    return []
