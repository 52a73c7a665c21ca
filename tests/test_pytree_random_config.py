from __future__ import annotations

import collections
import enum
import pathlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from fragflow import random as ffr
from fragflow.compiler.pytree import NotAnArray, flatten, leaf_paths, spec_of, to_numpy, unflatten
from fragflow.config import apply_overrides
from fragflow.errors import ConfigError

Pair = collections.namedtuple("Pair", "a b")


def test_flatten_roundtrip_keeps_structure_and_leaves():
    tree = {"x": np.zeros(3), "y": [torch.ones(2), (1.5, None)], "z": Pair(np.int64(3), True)}
    leaves, td = flatten(tree)
    assert len(leaves) == 5
    back = unflatten(td, leaves)
    assert back["y"][1] == (1.5, None) and isinstance(back["z"], Pair)
    assert [p for p, _ in leaf_paths(tree)] == ["['x']", "['y'][0]", "['y'][1][0]", "['z'].a", "['z'].b"]


class _Buffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_buffer("count", torch.ones(1))
        self.register_buffer("empty", None)


class _Mixin:
    pass


class _WithMixin(torch.nn.Module, _Mixin):
    def __init__(self) -> None:
        super().__init__()
        self.x = torch.nn.Linear(3, 1, bias=False)


def _hooked() -> torch.nn.Module:
    def drop_bias(module, state_dict, prefix, metadata) -> None:
        del state_dict[prefix + "bias"]

    m = torch.nn.Linear(2, 2)
    m.register_state_dict_post_hook(drop_bias)
    return m


def _shared() -> torch.nn.Module:
    layer = torch.nn.Linear(2, 2)
    return torch.nn.ModuleDict({"a": layer, "b": layer})


def _hooked_unsaved() -> torch.nn.Module:
    m = torch.nn.Sequential(_Buffers(), torch.nn.Linear(2, 2))
    m.register_state_dict_post_hook(lambda module, state_dict, prefix, metadata: None)
    return m


@pytest.mark.parametrize("make", [
    lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2, bias=False)),
    _Buffers, _WithMixin, _hooked, _shared, _hooked_unsaved, lambda: torch.nn.LSTM(3, 4, 2),
    lambda: torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 3)),
    lambda: torch.nn.MultiheadAttention(8, 2)])
def test_a_module_flattens_as_its_state_dict_holds_it(make):
    """Modules are walked without state_dict's machinery where nothing changes what it holds: the same
    keys in the same order, the same tensors (detached); hooks and overrides go through state_dict.
    The buffers state_dict leaves out (persistent=False) follow, in their modules' order: they are
    part of what the module computes, and were never sent to the acting side (an observation
    normaliser's statistics, updated by the learner, stayed at their first values there)."""
    module = make()
    want = list(module.state_dict(keep_vars=True).items())
    want += [(name, buf) for name, buf in module.named_buffers(remove_duplicate=False)
             if name.rsplit(".", 1)[-1] in module.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set]
    leaves, treedef = flatten(module)
    assert list(treedef[1]) == [k for k, _ in want]
    for (_, tensor), leaf in zip(want, leaves):
        assert leaf.data_ptr() == tensor.data_ptr() and leaf.shape == tensor.shape and not leaf.requires_grad


def test_to_numpy_shares_a_cpu_tensor_s_memory_whatever_its_grad():
    p = torch.nn.Parameter(torch.arange(4.0))
    for t in (p, p.detach(), torch.arange(3, dtype=torch.int64), torch.ones(2, dtype=torch.bfloat16)):
        arr = to_numpy(t)
        assert isinstance(arr, np.ndarray) and arr.shape == tuple(t.shape)
        if t.dtype != torch.bfloat16:
            assert np.shares_memory(arr, t.detach().numpy()) and np.array_equal(arr, t.detach().numpy())
        else:
            assert arr.dtype.name == "bfloat16" and np.array_equal(arr.astype(np.float32), t.float().numpy())


def test_non_array_leaf_reports_its_path():
    with pytest.raises(NotAnArray) as info:
        flatten({"ok": np.zeros(1), "bad": ["s"]})
    assert info.value.path == "['bad'][0]"


def test_specs_name_dtype_shape_and_backend():
    assert spec_of(np.zeros((2, 3), np.float32)).short() == "f32[2,3]"
    assert spec_of(torch.zeros(4, dtype=torch.int64)).backend == "torch"
    assert spec_of(1.0).dtype == "float" and spec_of(1.0).backend == "python"


def test_keys_are_per_environment_whatever_the_slice():
    full = ffr.keys(7, np.arange(4))
    part = ffr.keys(7, np.array([2, 3]))
    assert (full[2:] == part).all()
    k, sub = ffr.split(full)
    _, sub_part = ffr.split(part)
    assert (ffr.uniform(sub, (5,))[2:] == ffr.uniform(sub_part, (5,))).all()
    assert not (k == sub).any()


def test_uniform_and_normal_look_right():
    key = ffr.keys(0, np.arange(2000))
    u = ffr.uniform(key, (3,))
    assert u.shape == (2000, 3) and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.02
    n = ffr.normal(key, (2,))
    assert n.shape == (2000, 2) and abs(n.mean()) < 0.06 and abs(n.std() - 1) < 0.06
    assert not (ffr.keys(0, np.arange(3)) == ffr.keys(1, np.arange(3))).any()


def test_normal_of_keys_of_several_axes_draws_each_keys_numbers_from_that_key_alone():
    """Keys of shape (env, agent): each key's normals are its own, as uniform's (normal took the
    pair of uniforms from axis 1, the keys' second axis: keys mixed, and (3, 1) keys failed)."""
    keys = ffr.keys(0, np.arange(6))
    grid = keys.reshape(3, 2)
    n = ffr.normal(grid, (4,))
    assert n.shape == (3, 2, 4)
    assert np.array_equal(n.reshape(6, 4), ffr.normal(keys, (4,)))
    changed = grid.copy()
    changed[0, 1] ^= 12345
    assert np.array_equal(ffr.normal(changed, (4,))[0, 0], n[0, 0])
    assert ffr.normal(grid[:, :1], (2,)).shape == (3, 1, 2)
    assert ffr.normal(keys[0]).shape == ()


@dataclass(frozen=True)
class Args:
    num_envs: int = 4
    lr: float = 2.5e-4
    norm: bool = True
    target_kl: float | None = None
    env_id: str = "CartPole-v1"


def test_overrides_convert_by_field_type():
    args = apply_overrides(Args, ["num_envs=8", "lr=1e-3", "norm=false", "target_kl=0.02", "env_id=Acrobot-v1"])
    assert args == Args(8, 1e-3, False, 0.02, "Acrobot-v1")
    assert apply_overrides(Args, ["target_kl=none"]).target_kl is None


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Shapes:
    sizes: tuple[int, ...] = (64, 64)
    pair: tuple[int, float] = (1, 2.0)
    items: list[int] = field(default_factory=lambda: [1, 2])
    color: Color = Color.RED
    path: pathlib.Path = pathlib.Path("runs")
    mapping: dict = field(default_factory=dict)
    bare: tuple = (1, 2)


@dataclass(frozen=True)
class Milestones:
    lr_milestones: tuple[tuple[int, float], ...] = ((0, 1e-3),)
    grid: list[list[int]] = field(default_factory=lambda: [[1]])


def test_overrides_set_tuples_of_tuples_from_a_python_literal():
    """A tuple of (update, rate) pairs could not be set at all: its text was split at every comma
    ("expected 2 comma-separated values, got '(0'"), whatever was written (probe helper)."""
    args = apply_overrides(Milestones, ["lr_milestones=((0, 1e-3), (6, 1e-4))", "grid=[[1, 2], []]"])
    assert args == Milestones(((0, 1e-3), (6, 1e-4)), [[1, 2], []])
    assert apply_overrides(Milestones, ["lr_milestones=[[2, 0.5]]"]).lr_milestones == ((2, 0.5),)
    with pytest.raises(ConfigError) as info:
        apply_overrides(Milestones, ["lr_milestones=0:1e-3", "grid=[[1, 'x']]"])
    msg = str(info.value)
    assert "--set lr_milestones=0:1e-3: a tuple of tuples is given as a Python literal, such as " \
           "'((0, 1e-3), (6, 1e-4))'" in msg and "expected an integer, got 'x'" in msg


def test_overrides_set_tuples_lists_enums_and_paths():
    """They were refused with no fix, and the README did not say which types --set takes (helper round 33 C11)."""
    args = apply_overrides(Shapes, ["sizes=128,128,64", "pair=(3, 0.5)", "items=[]", "color=BLUE", "path=/data/x"])
    assert args == Shapes((128, 128, 64), (3, 0.5), [], Color.BLUE, pathlib.Path("/data/x"))
    assert apply_overrides(Shapes, ["sizes=32,", "color=red"]) == Shapes(sizes=(32,))
    with pytest.raises(ConfigError) as info:
        apply_overrides(Shapes, ["pair=1,2,3", "color=green", "mapping={}", "sizes=a,b"])
    msg = str(info.value)
    assert "--set pair=1,2,3: expected 2 comma-separated values" in msg
    assert "expected one of RED, BLUE, got 'green'" in msg and "expected an integer, got 'a'" in msg
    assert "cannot set a field of type dict from the command line (--set takes bool, int" in msg
    with pytest.raises(ConfigError, match=r"does not say the type of its items: annotate it as tuple\[int, \.\.\.\]"):
        apply_overrides(Shapes, ["bare=3,4"])   # (its items became strings: review of round 33)


@dataclass(frozen=True)
class OptCfg:
    lr: float = 3e-4
    max_grad_norm: float = 0.5


@dataclass
class Nested:
    seed: int = 1
    opt: OptCfg = field(default_factory=lambda: OptCfg(lr=1e-3))
    extra: OptCfg | None = None


def test_overrides_set_a_nested_dataclass_field_by_field():
    """A field holding a dataclass (CleanRL's tyro configs, ``--opt.lr``) was refused: "Args has no
    field 'opt.lr'", and ``opt=...`` named the class as ``<class 'module.OptCfg'>`` (helper round 37 A)."""
    args = apply_overrides(Nested, ["opt.max_grad_norm=1.5", "seed=3"])
    assert args == Nested(seed=3, opt=OptCfg(lr=1e-3, max_grad_norm=1.5))   # the field's own default kept
    assert apply_overrides(Nested, ["extra.lr=0.1"]).extra == OptCfg(lr=0.1)   # None: built from its defaults
    base = Nested(opt=OptCfg(lr=0.5))
    assert apply_overrides(Nested, ["opt.lr=0.25"], base=base).opt == OptCfg(lr=0.25)   # (a resume's --set)
    assert base.opt.lr == 0.5
    assert apply_overrides(Nested, ["extra=none"]).extra is None
    with pytest.raises(ConfigError) as info:
        apply_overrides(Nested, ["opt=0.01", "opt.lrr=1", "opt.lr=fast"])
    msg = str(info.value)
    assert "--set opt=0.01: opt holds the dataclass OptCfg, whose fields are set one by one: --set opt.lr=..., " \
           "--set opt.max_grad_norm=..." in msg
    assert "--set opt.lrr: OptCfg has no field 'lrr'; did you mean 'lr'?" in msg
    assert "--set opt.lr=fast: expected a number, got 'fast'" in msg
    assert "the fields of Nested --set takes are: seed, opt.lr, opt.max_grad_norm, extra.lr, extra.max_grad_norm" in msg


def test_every_bad_override_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        apply_overrides(Args, ["num_env=8", "lr=fast", "norm=maybe", "oops"])
    msg = str(info.value)
    assert "no field 'num_env'; did you mean 'num_envs'?" in msg
    assert "--set lr=fast: expected a number, got 'fast'" in msg
    assert "expected true or false, got 'maybe'" in msg
    assert "--set 'oops': expected key=value" in msg


def test_small_key_arrays_mix_to_the_same_numbers_as_the_vectorized_path():
    from fragflow.api import random as R

    def vectorized(z):   # the same keys among enough others that _mix takes its numpy path
        padded = np.concatenate([z.ravel(), np.zeros(R._SMALL + 1, np.uint64)])
        return R._mix(padded)[:z.size].reshape(z.shape)

    rng = np.random.default_rng(0)
    for shape in [(1,), (3,), (2, 8), (4, 4), (1, 1), (17,)]:
        z = rng.integers(0, 2**63, size=shape, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        mixed = R._mix(z)
        assert mixed.dtype == np.uint64 and mixed.shape == z.shape
        assert np.array_equal(mixed, vectorized(z))
    top = np.array([2**64 - 1, 0], np.uint64)
    assert np.array_equal(R._mix(top), vectorized(top))


def test_split_and_uniform_draw_the_same_numbers_for_a_few_keys_as_for_many():
    # a process stepping 2 of 40 environments takes the small-key path, one stepping all 40 the
    # vectorized one: environment i must draw the same numbers in both
    many = ffr.keys(3, np.arange(40))
    for _ in range(3):
        many, sub = ffr.split(many)
        few, few_sub = ffr.split(many[5:7].copy())
        assert np.array_equal(ffr.split(many)[0][5:7], few) and np.array_equal(ffr.split(many)[1][5:7], few_sub)
        for shape in [(), (1,), (2,), (3, 2), (9,)]:
            u = ffr.uniform(sub[5:7].copy(), shape)
            assert u.dtype == np.float64 and np.array_equal(ffr.uniform(sub, shape)[5:7], u)


def test_keys_stay_known_while_they_live_however_many_steps_split_them():
    # a loop splits its keys at every step: the table of keys made drops the dead ones as it grows,
    # never a live one (a checkpoint saves the loop's keys as keys), and keys of their own (a
    # learner's noise) split into keys of their own
    from fragflow.api import random as R

    kept = ffr.keys(1, np.arange(2))
    own = R._per_env(ffr.keys(1, np.arange(7)).copy(), env=False)   # (as a trace makes them for no env's ids)
    assert R.is_key(kept) and R.is_key(own) and R._not_env.holds(own) and not R._not_env.holds(kept)
    key = kept
    for _ in range(5000):   # several prunings of the table
        key, sub = ffr.split(key)
        assert R.is_key(sub)
    assert R.is_key(kept) and R.is_key(key)
    assert not R.is_key(kept.copy()) and not R.is_key(np.zeros(2, np.uint64))
    assert len(R._issued._refs) < 4096   # the dead steps' keys were dropped
    a, b = ffr.split(own)
    assert R._not_env.holds(a) and R._not_env.holds(b) and not R._not_env.holds(sub)


def test_an_outputs_skeleton_keeps_what_has_no_array_and_leaves_other_sequences_to_their_paths():
    import collections

    import torch

    from fragflow.compiler.pytree import fill_skeleton, skeleton_of

    Pair = collections.namedtuple("Pair", "a b")
    out = (np.zeros(2), None, {}, {"x": [np.ones(1), Pair(np.ones(1), None)]})
    assert fill_skeleton(skeleton_of(out), iter([1, 2, 3])) == (1, None, {}, {"x": [2, Pair(3, None)]})
    assert skeleton_of({"shape": torch.Size([2, 3])}) is None   # torch.Size holds no markers
