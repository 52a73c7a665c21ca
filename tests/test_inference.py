"""ff.numpy_forward: a torch MLP's forward pass in numpy, for acting."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fragflow as ff
from fragflow.errors import ConfigError


def _close(module: nn.Module, x: np.ndarray) -> bool:
    with torch.no_grad():
        expected = module(torch.as_tensor(x)).numpy()
    got = ff.numpy_forward(module, x)
    return got.dtype == np.float32 and got.shape == expected.shape and np.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_numpy_forward_computes_what_the_module_computes():
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    nets = [nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)),
            nn.Sequential(nn.Linear(4, 6, bias=False), nn.Sigmoid(), nn.Identity(), nn.Sequential(nn.Linear(6, 2))),
            nn.Linear(4, 2)]
    for net in nets:
        assert _close(net, x)
        assert _close(net, x[:1])
    assert np.allclose(ff.numpy_forward(nets[0], torch.as_tensor(x)), ff.numpy_forward(nets[0], x))   # a tensor in


def test_numpy_forward_reads_the_weights_anew_after_every_change():
    """Its numpy views are kept while the tensors, their storage and their version counters are the
    same: an optimizer's step, `.data =` and load_state_dict each change the result."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = np.ones((3, 4), np.float32)
    first = ff.numpy_forward(net, x)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.as_tensor(x)).sum().backward()
    opt.step()
    stepped = ff.numpy_forward(net, x)
    assert not np.allclose(first, stepped) and _close(net, x)
    with torch.no_grad():
        net[2].bias.data = torch.full((2,), 5.0)
    assert _close(net, x) and not np.allclose(ff.numpy_forward(net, x), stepped)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net.load_state_dict(other.state_dict())
    assert np.allclose(ff.numpy_forward(net, x), ff.numpy_forward(other, x)) and _close(net, x)


def test_numpy_forward_refuses_a_layer_it_does_not_compute_at_the_user_s_line():
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"but got a LayerNorm") as info:
        ff.numpy_forward(net, np.zeros((1, 4), np.float32))
    assert info.value.where is not None and info.value.where.file.endswith("test_inference.py")
    assert "call the module itself" in info.value.fix


def test_numpy_forward_refuses_what_it_would_compute_differently_from_the_module():
    """A computed weight (weight normalisation, old and new style), forward hooks, float64 weights: each refused at the call,
    where numpy_forward would read a missing weight, skip the hooks or compute in another dtype."""
    x = np.zeros((2, 4), np.float32)
    parametrized = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (torch's deprecation of the old weight_norm)
        normed = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 2)))
    hooked = nn.Sequential(nn.Linear(4, 2))
    hooked[0].register_forward_hook(lambda module, args, out: out * 2)
    hooked_outer = nn.Sequential(nn.Linear(4, 2))
    hooked_outer.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    cases = [(normed, "has forward hooks"), (parametrized, r"(?s)ParametrizedLinear.*computes its weight"), (hooked, "has forward hooks"), (hooked_outer, "has forward hooks"),
             (nn.Linear(4, 2).double(), "torch.float64 weights")]
    for net, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            ff.numpy_forward(net, x)
        assert info.value.where is not None and info.value.where.file.endswith("test_inference.py")


def test_numpy_forward_of_weights_made_in_inference_mode_and_of_a_saturated_sigmoid():
    with torch.inference_mode():
        net = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid())
    x = np.full((2, 4), -200.0, np.float32)
    with torch.inference_mode():
        expected = net(torch.as_tensor(x)).numpy()
    with np.errstate(over="raise"):   # (1 / (1 + exp(-x)) overflowed for large negative x)
        got = ff.numpy_forward(net, x)
    assert np.allclose(got, expected, atol=1e-6)


def test_numpy_forward_computes_subclasses_that_keep_torch_s_forward_and_refuses_what_is_no_module():
    """A class of the user's made of an nn.Sequential (`class MLP(nn.Sequential)` building its layers
    in __init__) or of an nn.Linear, whose forward is torch's own, was refused as 'got a MLP'; a
    parameter dict, a function or a state_dict failed in fragflow's code ('dict' object has no
    attribute '_forward_hooks'), and an uninitialised LazyLinear was refused for forward hooks the
    user never registered. Now the subclasses are computed, and the others are refused at the call
    saying what they are."""
    class MLP(nn.Sequential):
        def __init__(self) -> None:
            super().__init__(nn.Linear(4, 8), nn.Tanh(), Scaled(8, 2))

    class Scaled(nn.Linear):   # (torch's forward, its own initialisation)
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__(n_in, n_out)
            with torch.no_grad():
                self.weight.mul_(0.1)

    class Doubled(nn.Linear):   # (a forward of its own: not computed)
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(2)
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    assert _close(MLP(), x) and _close(nn.Sequential(MLP(), nn.ReLU()), x)
    cases = [(nn.Sequential(Doubled(4, 2)), "but got a Doubled"),
             ({"w": torch.zeros(2, 4)}, "takes a torch module .* but got a dict"),
             (lambda v: v, "takes a torch module .* but got a function"),
             (nn.Linear(4, 2).state_dict(), "takes a torch module .* but got a OrderedDict"),
             (nn.Sequential(nn.LazyLinear(2)), "LazyLinear .*whose weights torch makes at its first call")]
    for net, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            ff.numpy_forward(net, x)
        assert info.value.where is not None and info.value.where.file.endswith("test_inference.py")
        assert "call the module itself" in info.value.fix


LOOP_READ = """
import numpy as np
import torch
from torch import nn
import fragflow as ff

@ff.fragment("actor")
def act(net, obs):
    return ff.numpy_forward(net, obs).argmax(-1)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    net, opt = state["net"], state["opt"]
    loss = net(torch.as_tensor(batch["obs"], dtype=torch.float32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return state, {}

def train():
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    state = ff.versioned({"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    seen = []
    for _ in range(4):
        for _ in range(4):
            a = act(state["net"], obs)
            buf.add(obs=obs)
            obs, *_ = env.step(a)
        state, _ = learn(state, buf.collect())
        seen.append(ff.numpy_forward(state["net"], obs))   # @read
    return seen
"""


def test_numpy_forward_of_the_state_s_module_in_the_loop_runs_as_eagerly_in_one_process_and_is_refused_apart(write_algo):
    """`ff.numpy_forward(state["net"], obs)` in the training loop (an evaluation) was refused under every
    policy, single_process included, as 'but got a VersionedView', where eagerly `state["net"]` is the
    module. Now it reads the state as the loop's other reads do: as eagerly in one process, and refused
    at its line where the learner runs apart (the loop's copy is not the newest)."""
    from fragflow.errors import VersionedStateError
    from fragflow.program import load
    from tests.conftest import relpath

    path, marks = write_algo(LOOP_READ, "loop_read.py")
    prog = load(str(path))
    eager = prog.train()
    result = ff.run(prog.train, policy="single_process")
    assert len(result.value) == 4 and all(np.array_equal(a, b) for a, b in zip(result.value, eager))
    with pytest.raises(VersionedStateError, match=rf"given to ff.numpy_forward in the training loop(.|\n)*"
                                                  rf"at {relpath(path)}:{marks['read']}"):
        ff.run(prog.train, policy="pipelined")


def test_numpy_forward_names_the_layer_an_input_of_another_width_does_not_fit():
    """An input whose rows are not as wide as a Linear layer takes failed with numpy's own words from
    fragflow's code ('matmul: Input operand 1 has a mismatch in its core dimension 0 ...'), naming no
    layer. Now it is refused at the call, naming the layer, its place and the input's shape."""
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(5, 2))
    with pytest.raises(ConfigError, match=r"ff.numpy_forward's layer \[0\] Linear\(in_features=4, out_features=8, "
                                          r"bias=True\) takes rows of 4 numbers, but got an input of shape \(3, 5\)") as info:
        ff.numpy_forward(net, np.zeros((3, 5), np.float32))
    assert info.value.where is not None and info.value.where.file.endswith("test_inference.py")
    with pytest.raises(ConfigError, match=r"layer \[2\] Linear\(in_features=5, .* but got an input of shape \(3, 8\)"):
        ff.numpy_forward(net, np.zeros((3, 4), np.float32))
    with pytest.raises(ConfigError, match=r"layer Linear\(in_features=4, .* but got an input of shape \(3,\)"):
        ff.numpy_forward(nn.Linear(4, 2), np.zeros(3, np.float32))


def test_numpy_forward_reads_a_weight_made_a_view_of_its_own_storage_anew():
    """Its views were kept while the weight's storage began at the same address: a weight made a
    transposed view of itself (`w.data = w.data.t()`, a tied decoder's) kept the old view, and the
    forward pass computed with the untransposed matrix, silently; a weight or bias cut to fewer rows
    (`b.data = b.data[:4]`) kept the longer one. Shape and strides now count as well."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 6))
    x = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    assert _close(net, x)
    with torch.no_grad():
        net[0].weight.data = net[0].weight.data.t()
    assert _close(net, x)
    with torch.no_grad():
        net[2].weight.data = net[2].weight.data[:4]
        net[2].bias.data = net[2].bias.data[:4]
    assert _close(net, x) and ff.numpy_forward(net, x).shape == (3, 4)


def test_numpy_forward_of_a_compiled_module_computes_the_module_it_wraps():
    """torch.compile(net) was refused as 'got a OptimizedModule' (compiling is lazy: nothing compiles here)."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    compiled = torch.compile(net)
    assert type(compiled).__name__ == "OptimizedModule"
    assert np.array_equal(ff.numpy_forward(compiled, x), ff.numpy_forward(net, x)) and _close(net, x)


def test_numpy_forward_of_a_module_called_again_follows_every_change_to_it():
    """A module's second call makes its pass a list of steps, taken while the layers, their hooks and
    their weight tensors are those it was made from: each change below, made after that, is computed
    (or refused) as at a first call."""
    torch.manual_seed(4)
    x = np.random.default_rng(3).normal(size=(2, 4)).astype(np.float32)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3))

    def called_twice() -> None:
        ff.numpy_forward(net, x)
        assert _close(net, x)

    called_twice()
    net[1] = nn.Sigmoid()                        # a layer of a Sequential replaced
    called_twice()
    net[2][0] = nn.Linear(8, 8)                  # ... of an inner one
    called_twice()
    net.append(nn.ReLU())                        # a layer added
    called_twice()
    with torch.no_grad():
        net[0].weight = nn.Parameter(torch.randn(8, 4))   # a new Parameter
        net[3].bias.data = torch.randn(3)                 # new storage
        net[2][0].weight.mul_(2.0)                        # in place (the steps read it through views)
    called_twice()
    assert np.allclose(ff.numpy_forward(net, x[:1]), ff.numpy_forward(net, x)[:1])
    with pytest.raises(ConfigError, match=r"layer \[0\] Linear\(in_features=4, .* but got an input of shape \(2, 5\)"):
        ff.numpy_forward(net, np.zeros((2, 5), np.float32))   # (another width: the layer named, as at a first call)
    hook = net[2][1].register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(ConfigError, match="has forward hooks"):
        ff.numpy_forward(net, x)
    hook.remove()
    called_twice()
    net.double()
    with pytest.raises(ConfigError, match="torch.float64 weights"):
        ff.numpy_forward(net, x)
    input_kept = x.copy()
    relu_first = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))
    for _ in range(3):
        ff.numpy_forward(relu_first, x)
    assert np.array_equal(x, input_kept)   # (the input is never written in place)


def test_numpy_forward_of_a_module_called_again_follows_a_class_or_its_children_replaced_and_frees_it():
    """Found in review: a layer's class swapped (or its class's forward patched) and a Sequential's
    children replaced whole (`net._modules = ...`) after the second call kept the steps made before,
    silently (the ReLU's output where the layer now negates); and a module called twice was never
    freed (its steps held it)."""
    import collections
    import gc
    import weakref

    class Neg(nn.ReLU):
        def forward(self, x):
            return -x

    torch.manual_seed(5)
    x = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    ff.numpy_forward(net, x)
    ff.numpy_forward(net, x)
    net[1].__class__ = Neg
    with pytest.raises(ConfigError, match="but got a Neg"):
        ff.numpy_forward(net, x)
    net[1].__class__ = nn.ReLU
    assert _close(net, x)
    net._modules = collections.OrderedDict([("0", net[0]), ("1", nn.Tanh())])
    assert _close(net, x)

    class Twice(nn.Sequential):   # (keeps torch's forward until patched)
        pass

    twice = Twice(nn.Linear(4, 3))
    ff.numpy_forward(twice, x)
    assert _close(twice, x)
    Twice.forward = lambda self, v: nn.Sequential.forward(self, v) * 2   # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="but got a Twice"):
        ff.numpy_forward(twice, x)
    gone = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    ff.numpy_forward(gone, x)
    ff.numpy_forward(gone, x)
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
