"""Replay buffers as fragments (role ``buffer``): ``add`` transitions, ``sample`` batches and, for
prioritized replay, ``update_priorities``.

The three are fragments of one object, so a placement keeps them together, and the graph records
``add -> sample`` (and ``update_priorities -> sample``) as effect edges: where the buffer lives is
the placement's choice (on every actor under ``actor_learner``, with the learner under
``learner_replay``), never the algorithm's.

``add(**transition)`` takes leaves whose leading axis indexes this process's environments;
``sample(batch_size)`` returns every stored key as ``[batch, ...]`` plus ``index`` (int64, where
each sample is stored) and ``weight`` (float32 importance weights, 1 for uniform sampling). The
batch has the named ``sample`` axis: when a policy gives every one of N actors its own buffer, each
samples ``batch_size / N`` and the learner receives the pieces merged, so it always sees
``batch_size`` samples. Sampling uses a generator seeded ``(seed, replica)``.

Prioritized replay (Schaul et al., 2016, https://arxiv.org/abs/1511.05952) samples in proportion
to ``priority ** alpha`` (new transitions get the largest priority seen) and weights each sample by
``(size * P(i)) ** -beta``, normalised by the batch's largest weight.

>>> rb = ReplayBuffer(capacity=8, seed=0)
>>> rb.add(obs=np.arange(4, dtype=np.float32).reshape(2, 2), reward=np.ones(2))
>>> batch = rb.sample(3)
>>> batch["obs"].shape, batch["index"].dtype.name, float(batch["weight"][0])
((3, 2), 'int64', 1.0)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fragflow import context
from fragflow.api.buffer import whole_number
from fragflow.api.fragment import Fragment, rows
from fragflow.compiler.pytree import to_numpy
from fragflow.errors import TraceError
from fragflow.source import user_callsite


def _sample_axis(path: str) -> tuple[str, int]:
    return ("sample", 0)


class _SumTree:
    """Priorities in a binary tree of partial sums: O(log n) update and prefix-sum search, vectorized."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << max(capacity - 1, 1).bit_length()
        self.tree = np.zeros(2 * self.size, np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def set(self, index: np.ndarray, value: np.ndarray) -> None:
        node = np.asarray(index, np.int64) + self.size
        if not node.size:
            return
        self.tree[node] = value
        node = np.unique(node // 2)
        while node[0] >= 1:
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
            if node[0] == 1:
                break
            node = np.unique(node // 2)

    def find(self, mass: np.ndarray) -> np.ndarray:
        node = np.ones(mass.shape, np.int64)
        mass = mass.copy()
        while node[0] < self.size:
            left = self.tree[2 * node]
            right = mass > left
            mass -= left * right
            node = 2 * node + right
        return node - self.size

    def get(self, index: np.ndarray) -> np.ndarray:
        return self.tree[np.asarray(index) + self.size]


class ReplayBuffer:
    """A ring of the last ``capacity`` transitions added in this process."""

    def __init__(self, capacity: int, *, seed: int = 0, prioritized: bool = False, alpha: float = 0.6,
                 beta: float = 0.4, eps: float = 1e-6) -> None:
        whole_number(capacity, "ReplayBuffer", "capacity", "args.buffer_size")
        if capacity < 1:
            raise TraceError(f"ReplayBuffer needs capacity >= 1, got {capacity}", where=user_callsite(),
                             fix="pass the number of transitions to keep")
        interp = context.current()
        self.name = "replay" if interp is None else interp.instance_name("replay")
        replica = interp.replica() if interp is not None else (0, 1)
        self.capacity = capacity
        self.prioritized = prioritized
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self._seed = seed
        self._rng = np.random.default_rng([seed, replica[0]])
        self._storage: dict[str, np.ndarray] | None = None
        self._pos = 0
        self._size = 0
        self._tree = _SumTree(capacity) if prioritized else None
        self._max_priority = 1.0
        self.add = Fragment(self._add, "buffer", name=f"{self.name}.add", instance=self, in_axes=rows)
        self.sample = Fragment(self._sample, "buffer", name=f"{self.name}.sample", instance=self, axes=_sample_axis)
        self.update_priorities = Fragment(self._update_priorities, "buffer", name=f"{self.name}.update_priorities",
                                          instance=self)

    def _ff_served(self) -> None:
        """This copy is the one a service keeps (the buffer beside the learner, fed by every loop
        replica): it samples as loop replica 0's copy would (as ``single_process``'s), whichever
        replica's copy reached the service first."""
        if self._size == 0:
            self._rng = np.random.default_rng([self._seed, 0])

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: the stored transitions (only the ``size`` filled rows), the
        write position, the priorities and the sampling generator's state."""
        out: dict[str, Any] = {"pos": self._pos, "size": self._size, "max_priority": self._max_priority,
                               "rng": self._rng.bit_generator.state}
        if self._storage is not None:
            out["storage"] = {k: v[:self._size] for k, v in self._storage.items()}
        if self._tree is not None:
            out["priorities"] = self._tree.get(np.arange(self._size))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity:
            raise ValueError(f"the saved buffer holds {size} transitions, more than this buffer's capacity {self.capacity}")
        storage = state.get("storage")
        self._storage = None
        if storage is not None:
            self._storage = {}
            for k, v in storage.items():
                v = np.asarray(v)
                self._storage[k] = np.zeros((self.capacity, *v.shape[1:]), v.dtype)
                self._storage[k][:size] = v
        self._pos, self._size = int(state["pos"]), size
        self._max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = state["rng"]
        if self._tree is not None and "priorities" in state:
            self._tree.tree[:] = 0.0
            self._tree.set(np.arange(size), np.asarray(state["priorities"], np.float64))

    def __repr__(self) -> str:
        return f"<ReplayBuffer {self.name}: {self._size}/{self.capacity}{' prioritized' if self.prioritized else ''}>"

    def _add(self, **transition: Any) -> None:
        nested = next((k for k, v in transition.items() if isinstance(v, (dict, list, tuple))), None)
        if nested is not None:
            value = transition[nested]
            flat = isinstance(value, (list, tuple)) and all(isinstance(x, (int, float, bool, np.number)) for x in value)
            raise TraceError(f"{self.name}.add got a {type(value).__name__} for '{nested}'; a replay "
                             "buffer stores one array per key", where=user_callsite(),
                             fix=f"make it an array, one row per environment: {nested}=np.asarray({nested}) (or have the "
                                 "fragment that makes it return an array)" if flat else
                                 f"add its leaves under keys of their own, e.g. {nested}_pos=obs['pos']")
        arrays = {k: to_numpy(v) for k, v in transition.items()}
        n = {a.shape[0] if a.ndim else 1 for a in arrays.values()}
        if len(n) != 1:
            raise TraceError(f"{self.name}.add got leaves with different leading sizes {sorted(n)}", where=user_callsite(),
                             fix="give every leaf the environments on its first axis")
        count = n.pop()
        if self._storage is None:
            self._storage = {k: np.zeros((self.capacity, *a.shape[1:]) if a.ndim else (self.capacity,), a.dtype)
                             for k, a in arrays.items()}
        elif arrays.keys() != self._storage.keys():
            raise TraceError(f"{self.name}.add got keys {sorted(arrays)}, earlier {sorted(self._storage)}",
                             where=user_callsite(), fix="add the same keys every time")
        end = self._pos + count
        index = np.arange(self._pos, end) % self.capacity if end > self.capacity or self._tree is not None else None
        rows: Any = slice(self._pos, end) if end <= self.capacity else index   # a slice writes faster
        for k, a in arrays.items():
            self._storage[k][rows] = a if a.ndim else a.reshape(1)
        if self._tree is not None:
            assert index is not None
            self._tree.set(index, np.full(count, self._max_priority ** self.alpha))
        self._pos = (self._pos + count) % self.capacity
        self._size = min(self._size + count, self.capacity)

    def _sample(self, batch_size: int, beta: float | None = None) -> dict[str, np.ndarray]:
        interp = context.current()
        _, replicas = interp.replica() if interp is not None else (0, 1)
        if batch_size % replicas:
            raise TraceError(f"{self.name}.sample({batch_size}) is split across {replicas} actor processes, each with "
                             "a buffer of its own, which does not divide it", where=user_callsite(),
                             fix=f"use a batch size divisible by {replicas}, or keep the buffer with the learner")
        share = batch_size // replicas
        if self._storage is None or self._size == 0:
            raise TraceError(f"{self.name}.sample called on an empty buffer", where=user_callsite(),
                             fix="add transitions first (start learning after a warm-up)")
        if self._tree is None:
            index = self._rng.integers(0, self._size, share)
            weight = np.ones(share, np.float32)
        else:
            total = self._tree.total
            mass = (np.arange(share) + self._rng.random(share)) * (total / share)
            index = np.minimum(self._tree.find(mass), self._size - 1)
            p = self._tree.get(index) / total
            w = (self._size * p) ** -(self.beta if beta is None else beta)
            weight = (w / w.max()).astype(np.float32)
        batch = {k: v[index] for k, v in self._storage.items()}
        batch["index"] = index.astype(np.int64)
        batch["weight"] = weight
        return batch

    def _update_priorities(self, index: Any, priority: Any) -> None:
        if self._tree is None:
            raise TraceError(f"{self.name}.update_priorities on a buffer made without prioritized=True",
                             where=user_callsite(), fix="create it with ff.ReplayBuffer(..., prioritized=True)")
        p = np.abs(to_numpy(priority).astype(np.float64)).reshape(-1) + self.eps
        self._max_priority = max(self._max_priority, float(p.max()))
        self._tree.set(to_numpy(index).astype(np.int64).reshape(-1), p ** self.alpha)
