"""Counter-based random keys, one per environment (numpy, vectorized).

Sampling actions from per-environment keys makes a run independent of where an environment is
stepped: environment ``i`` draws the same numbers whether one process steps all environments or
it sits in the third of four actor processes (HTS-RL's trick for determinism under any placement).

Keys are ``uint64`` arrays with one entry per environment; :func:`split` derives fresh keys,
:func:`uniform` and :func:`normal` draw from them. The mixing function is SplitMix64.

>>> k = keys(seed=1, ids=np.arange(3))
>>> k, sub = split(k)
>>> uniform(sub, (2,)).shape
(3, 2)
>>> bool((uniform(sub, (2,)) == uniform(sub, (2,))).all())
True
"""

from __future__ import annotations

import functools
import math
import weakref

import numpy as np

from fragflow import context

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SPLIT_A = np.uint64(0x2545F4914F6CDD1D)
_SPLIT_B = np.uint64(0xD6E8FEB86659FD93)
_S30, _S27, _S31, _SHIFT = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TWO_M53 = 1.0 / 9007199254740992.0


_MASK = (1 << 64) - 1
_SMALL = 16   # up to this many keys, Python's integers beat a numpy ufunc call per operation


def _mix_int(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, elementwise on uint64 arrays (wrapping arithmetic)."""
    if z.size <= _SMALL:   # the same numbers, in a few microseconds rather than a dozen
        return np.array([_mix_int(v) for v in z.ravel().tolist()], dtype=np.uint64).reshape(z.shape)
    z = z + _GOLDEN                 # a new array; the rest works in place on it
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


class _Known:
    """Arrays known by identity while they live: weak references by ``id``, the dead ones dropped
    as the table grows (a ``WeakValueDictionary`` entry costs a microsecond more: a loop registers
    two keys at every step)."""

    __slots__ = ("_refs", "_prune_at")

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[np.ndarray]] = {}
        self._prune_at = 1024

    def add(self, arr: np.ndarray) -> None:
        refs = self._refs
        refs[id(arr)] = weakref.ref(arr)
        if len(refs) >= self._prune_at:
            for k in [k for k, ref in refs.items() if ref() is None]:
                del refs[k]
            self._prune_at = max(1024, 2 * len(refs))

    def holds(self, x: object) -> bool:
        ref = self._refs.get(id(x))
        return ref is not None and ref() is x

    def __bool__(self) -> bool:
        return bool(self._refs)


_issued = _Known()
_not_env = _Known()   # keys not one per env


def is_key(x: object) -> bool:
    """Whether ``x`` is a key array this module made (a checkpoint saves the loop's keys)."""
    return isinstance(x, np.ndarray) and _issued.holds(x)


def as_key(arr: np.ndarray) -> np.ndarray:
    """``arr`` (keys a checkpoint saved, loaded back) known as a key again: a checkpoint taken
    before the loop splits it saves it as one."""
    _issued.add(arr)
    return arr


def _per_env(arr: np.ndarray, env: bool = True) -> np.ndarray:
    """Tell a tracer that ``arr`` has the environments on axis 0 (keys are per environment), so a
    policy that splits the environments across processes splits keys that cross with them; and
    remember it is a key. ``env`` False: keys of another kind (a learner's noise), left whole."""
    _issued.add(arr)
    if not env:
        _not_env.add(arr)
        return arr
    hint = getattr(context.current(), "hint_axis", None)
    if hint is not None:
        hint(arr, ("env", 0))
    return arr


def keys(seed: int, ids: np.ndarray) -> np.ndarray:
    """One key per id, derived from the run's seed: per environment from ``env.ids`` (a policy that
    splits the environments splits them); from ids as many as no environment has, keys of their own
    (a learner's noise: ``keys(seed, np.arange(1))``)."""
    base = _mix(np.full(1, seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64))
    rows = getattr(context.current(), "env_rows", None)
    return _per_env(_mix(base ^ _mix(np.asarray(ids, dtype=np.uint64))), rows is None or rows(ids))


_SPLIT = np.array([[_SPLIT_A], [_SPLIT_B]], dtype=np.uint64)
_SPLIT_A_INT, _SPLIT_B_INT = int(_SPLIT_A), int(_SPLIT_B)


def split(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent key arrays from one: ``key, sub = split(key)``."""
    env = not _not_env or not _not_env.holds(key)   # (keys of their own split into keys of their own)
    if key.size <= _SMALL:   # the same numbers with Python's integers (a step of one env: a few microseconds)
        ints = key.ravel().tolist()
        a = np.array([_mix_int(k ^ _SPLIT_A_INT) for k in ints], dtype=np.uint64).reshape(key.shape)
        b = np.array([_mix_int(k ^ _SPLIT_B_INT) for k in ints], dtype=np.uint64).reshape(key.shape)
        return _per_env(a, env), _per_env(b, env)
    both = _mix(key.reshape(1, -1) ^ _SPLIT)
    return _per_env(both[0].reshape(key.shape), env), _per_env(both[1].reshape(key.shape), env)


@functools.lru_cache(maxsize=64)
def _counters(n: int) -> np.ndarray:
    counters = _mix(np.arange(1, n + 1, dtype=np.uint64)).reshape(1, -1)
    counters.setflags(write=False)
    return counters


def bits(key: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """uint64 random bits of shape ``key.shape + shape``."""
    n = math.prod(shape)
    out = _mix(key.reshape(-1, 1) ^ _counters(n))
    return out.reshape(key.shape + tuple(shape))


@functools.lru_cache(maxsize=64)
def _counter_ints(n: int) -> tuple[int, ...]:
    return tuple(_counters(n).ravel().tolist())


def uniform(key: np.ndarray, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Floats in the open interval (0, 1), float64, shape ``key.shape + shape``."""
    n = math.prod(shape)
    if key.size * n <= _SMALL:   # as below, with Python's integers (53 bits: exact as floats)
        counters = _counter_ints(n)
        top = [_mix_int(k ^ c) >> 11 for k in key.ravel().tolist() for c in counters]
        return ((np.array(top, dtype=np.float64) + 0.5) * _TWO_M53).reshape(key.shape + tuple(shape))
    return ((bits(key, shape) >> _SHIFT).astype(np.float64) + 0.5) * _TWO_M53


def normal(key: np.ndarray, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Standard normal floats (Box-Muller), float64, shape ``key.shape + shape``."""
    u = uniform(key, (2,) + tuple(shape))
    lead = (slice(None),) * key.ndim   # (the pair's axis follows the key's axes, however many)
    u1, u2 = u[lead + (0,)], u[lead + (1,)]
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def gumbel(key: np.ndarray, shape: tuple[int, ...] = ()) -> np.ndarray:
    """Standard Gumbel noise: ``argmax(logits + gumbel)`` samples a categorical."""
    u = uniform(key, shape)
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return np.negative(u, out=u)
