"""The kernel a fragment's float32 ``Linear`` layers run on: oneDNN's inner product where it is chosen
(``FRAGFLOW_LINEAR``), inside fragments only, in every process of a run and eagerly alike; torch's own
everywhere else. Its values and gradients are torch's up to float rounding; the transforms and modes it
does not serve (autocast, ``torch.func``, forward AD, TorchScript, double backward) get torch's own."""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fragflow as ff
from fragflow.errors import ConfigError
from fragflow.program import load
from fragflow.runtime import kernels, onednn

has_onednn = pytest.mark.skipif(onednn.inner_product() is None,
                                reason="a torch built without oneDNN (torch.ops.mkldnn._linear_pointwise): nothing to choose")


@pytest.fixture
def chosen(monkeypatch):
    """Sets FRAGFLOW_LINEAR for the test; the process chooses again before and after it."""
    def choose(value: str) -> None:
        monkeypatch.setenv("FRAGFLOW_LINEAR", value)
        kernels.reset()
    yield choose
    monkeypatch.delenv("FRAGFLOW_LINEAR", raising=False)
    kernels.reset()


def _inside(fn, *args):
    """``fn(*args)`` as a fragment's code runs it."""
    with kernels.in_fragment:
        return fn(*args)


def _by_onednn(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return onednn.inner_product()(x, layer.weight, layer.bias, "none", [], "")


@has_onednn
def test_inside_a_fragment_a_big_enough_float32_linear_takes_onednn_and_outside_torch_s_own(chosen):
    chosen("onednn")
    torch.manual_seed(0)
    layer, x = nn.Linear(256, 256), torch.randn(64, 256)   # 4M multiply-adds, above onednn.MIN_MACS
    with torch.no_grad():
        by_torch = onednn.torch_linear(x, layer.weight, layer.bias)
        assert not torch.equal(_by_onednn(layer, x), by_torch)   # (the two kernels round apart: the test can tell)
        assert torch.equal(_inside(layer, x), _by_onednn(layer, x))
        assert torch.equal(layer(x), by_torch)                   # outside any fragment
        small = torch.randn(4, 256)                              # 262k multiply-adds: below, torch's own
        assert torch.equal(_inside(layer, small), onednn.torch_linear(small, layer.weight, layer.bias))
        double = layer.double()
        assert torch.equal(_inside(double, x.double()), onednn.torch_linear(x.double(), double.weight, double.bias))
        layer.float()
        # sums longer than onednn.REDUCE_MAX (oneDNN splits them among its threads): torch's own
        long = torch.randn(onednn.REDUCE_MAX + 1, 256)
        assert torch.equal(_inside(layer, long), onednn.torch_linear(long, layer.weight, layer.bias))
        with torch.backends.mkldnn.flags(enabled=False):   # oneDNN turned off: torch's own
            assert torch.equal(_inside(layer, x), by_torch)


@has_onednn
def test_its_bits_do_not_depend_on_the_thread_count(chosen):
    """Up to onednn.REDUCE_MAX rows and features, as MKL's: eagerly, in the trace and in workers the
    thread counts differ."""
    chosen("onednn")
    torch.manual_seed(4)
    layer = nn.Linear(256, 512)
    x = torch.randn(onednn.REDUCE_MAX, 256, requires_grad=True)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            layer.zero_grad()
            out = _inside(layer, x)
            (gx,) = torch.autograd.grad(out.square().sum(), x, retain_graph=True)
            out.square().sum().backward()
            got.append((out, gx, layer.weight.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(got[0][0], onednn.torch_linear(x, layer.weight, layer.bias))   # (oneDNN's)
    assert all(torch.equal(a, b) for other in got[1:] for a, b in zip(got[0], other))


@has_onednn
@pytest.mark.parametrize("case", ["2d", "3d", "no bias", "strided bias", "transposed input", "frozen weight",
                                  "input without grad"])
def test_values_and_gradients_are_torch_s_up_to_rounding(chosen, case):
    chosen("onednn")
    torch.manual_seed(1)
    weight = torch.randn(192, 320, requires_grad=case != "frozen weight")
    bias = None if case == "no bias" else (torch.randn(384)[::2] if case == "strided bias" else torch.randn(192))
    if bias is not None:
        bias = bias.detach().requires_grad_()
    shape = {"3d": (4, 32, 320), "transposed input": (320, 128)}.get(case, (128, 320))
    x = torch.randn(*shape)
    if case == "transposed input":
        x = x.t()
    x.requires_grad_(case != "input without grad")
    grad_out = torch.randn(*x.shape[:-1], 192)
    leaves = [t for t in (x, weight, bias) if t is not None and t.requires_grad]

    calls = []
    real = onednn.inner_product()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn, "inner_product", lambda: lambda *a: calls.append(1) or real(*a))
        out = _inside(lambda: F.linear(x, weight, bias))
        got = torch.autograd.grad(out, leaves, grad_out)
    want_out = onednn.torch_linear(x, weight, bias)
    want = torch.autograd.grad(want_out, leaves, grad_out)
    assert len(calls) == 1 + sum(t is x or t is weight for t in leaves)   # the forward, and a product per gradient
    assert out.shape == want_out.shape
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-4)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-3)


@has_onednn
def test_it_keeps_only_what_the_gradients_asked_for_need(chosen):
    """As torch's own: a frozen weight changed in place before the backward is not an error."""
    chosen("onednn")
    torch.manual_seed(5)
    weight, x = torch.randn(256, 256), torch.randn(64, 256, requires_grad=True)
    out = _inside(lambda: F.linear(x, weight))
    with torch.no_grad():
        weight.add_(1.0)   # (the input's gradient needs the weight: changed, as torch's would refuse)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    weight.requires_grad_()
    frozen = torch.randn(64, 256)
    out = _inside(lambda: F.linear(frozen, weight))
    with torch.no_grad():
        weight.add_(1.0)   # the input needs no gradient: the weight's gradient needs the input only
    out.sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(256, 64) @ frozen)


@has_onednn
def test_a_graph_of_the_gradients_is_differentiable_again(chosen):
    """create_graph=True (gradient penalties, meta-learning): the gradients come from differentiable ops."""
    chosen("onednn")
    torch.manual_seed(2)
    layer = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)

    def penalty(run):
        (gx,) = torch.autograd.grad(run(layer, x).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), layer.weight)[0]

    torch.testing.assert_close(_inside(penalty, lambda m, v: m(v)), penalty(lambda m, v: m(v)), rtol=1e-4, atol=1e-3)


@has_onednn
def test_transforms_and_modes_it_does_not_serve_get_torch_s_own(chosen):
    chosen("onednn")
    _inside(lambda: None)   # (the process chooses at its first fragment)
    assert F.linear is onednn.linear
    torch.manual_seed(3)
    layer, x = nn.Linear(256, 256), torch.randn(64, 256)
    params = dict(layer.named_parameters())

    def mine(p, v):
        return torch.func.functional_call(layer, p, (v,)).sum()

    # (outside a fragment, torch's own)
    grads, want = _inside(lambda: torch.func.grad(mine)(params, x)), torch.func.grad(mine)(params, x)
    assert all(torch.equal(grads[k], want[k]) for k in want)
    batched = _inside(torch.func.vmap(layer), x.view(4, 16, 256))
    assert torch.equal(batched, torch.func.vmap(layer)(x.view(4, 16, 256)))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        tangent = torch.autograd.forward_ad.unpack_dual(_inside(layer, dual)).tangent
        assert torch.equal(tangent, torch.autograd.forward_ad.unpack_dual(layer(dual)).tangent)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _inside(layer, x).dtype is torch.bfloat16
    scripted = torch.jit.script(layer)   # TorchScript compiles F.linear as aten::linear
    with torch.no_grad():
        assert torch.equal(_inside(scripted, x), onednn.torch_linear(x, layer.weight, layer.bias))
    traced = _inside(torch.jit.trace, layer, x)
    assert "mkldnn" not in str(traced.graph)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)   # (dynamo's graph without code generation)
    with torch.no_grad():
        assert torch.equal(_inside(compiled, x), onednn.torch_linear(x, layer.weight, layer.bias))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as flops:   # (a dispatch mode sees torch's own ops)
        _inside(layer, x)
    assert flops.get_total_flops() == 2 * 64 * 256 * 256


@has_onednn
def test_a_failure_to_install_it_leaves_torch_s_own_and_no_fragment_open(chosen, monkeypatch):
    chosen("onednn")

    def fails(*args):
        raise RuntimeError("no such private API")

    monkeypatch.setattr(torch.jit._builtins, "_register_builtin", fails)
    layer, x = nn.Linear(256, 256), torch.randn(64, 256)
    with torch.no_grad():
        assert torch.equal(_inside(layer, x), onednn.torch_linear(x, layer.weight, layer.bias))
    assert F.linear is onednn.torch_linear and kernels.depth.n == 0


def test_a_program_without_torch_does_not_import_it(tmp_path):
    import subprocess
    import sys

    code = ("import sys, os; os.environ['FRAGFLOW_LINEAR'] = 'onednn'\n"
            "import fragflow as ff\n"
            "from fragflow.runtime import kernels\n"
            "@ff.fragment('actor')\n"
            "def act(x):\n    return x + 1\n"
            "assert kernels.setting() == 'onednn' and act(1) == 2\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_torch_leaves_torch_nn_functional_linear_alone(chosen):
    chosen("torch")
    _inside(lambda: None)
    assert F.linear is onednn.torch_linear


@has_onednn
def test_auto_takes_onednn_on_an_amd_cpu_with_avx512_only(chosen, monkeypatch):
    chosen("auto")
    monkeypatch.setattr(onednn, "amd_avx512", lambda: True)
    assert kernels.chosen() == "onednn"
    monkeypatch.setattr(onednn, "amd_avx512", lambda: False)
    assert kernels.chosen() == "torch"
    monkeypatch.delenv("FRAGFLOW_LINEAR")
    assert kernels.setting() == "auto" and kernels.chosen() == "torch"


PROGRAM = """
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
import fragflow as ff

@dataclass(frozen=True)
class Args:
    updates: int = 4

def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

@ff.fragment("actor")
def act(obs):
    return np.zeros(obs.shape[0], dtype=np.int64)

@ff.fragment("learner", writes="state")
def learn(state, batch):
    net, opt = state["net"], state["opt"]
    gen = torch.Generator().manual_seed(int(state["t"][0]))
    x = torch.as_tensor(batch["obs"], dtype=torch.float32).reshape(-1, 4)
    x = torch.cat([x, torch.randn(256 - x.shape[0], 4, generator=gen)])   # a batch of 256
    loss = (net(x).squeeze(-1) - x.sum(-1)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    layer = net[2]
    with torch.no_grad():   # which kernel this process's fragments take: torch's own, bit for bit, or another
        h = torch.randn(256, 256, generator=gen)
        kernel = float(torch.equal(layer(h), torch._C._nn.linear(h, layer.weight, layer.bias)))
    return dict(state, t=state["t"] + 1), {"loss": loss.detach(), "torch_kernel": kernel}

def train(args: Args):
    env = ff.envs.make("CartPole-v1", num_envs=2, seed=0)
    net = make_net()
    state = ff.versioned({"t": np.zeros(1), "net": net, "opt": torch.optim.Adam(net.parameters(), lr=1e-3)})
    buf = ff.RolloutBuffer(4)
    obs = env.reset()
    for _ in range(args.updates):
        for _ in range(4):
            action = act(obs)
            obs, *_ = env.step(action)
            buf.add(obs=obs)
        state, metrics = learn(state, buf.collect())
        ff.log(metrics)
    return state
"""


def _column(run_dir, name) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f)]


def _params(state) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["net"].parameters()]


@has_onednn
def test_every_process_of_a_run_takes_the_chosen_kernel_and_a_seed_gives_one_result(write_algo, tmp_path, chosen,
                                                                                    monkeypatch):
    """The learner's network: eagerly, under single_process and in a forked and a spawned learner worker, the
    same bits (its data does not depend on acting), which torch's own kernel does not give."""
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    chosen("onednn")
    eager = _params(program.train(program.args_cls()))
    runs = {}
    for name, policy, start in [("single", "single_process", ""), ("fork", "pipelined(actors=1)", "fork"),
                                ("spawn", "pipelined(actors=1)", "spawn")]:
        if start:
            monkeypatch.setenv("FRAGFLOW_START_METHOD", start)
        result = ff.run(program.train, program.args_cls(), policy=policy, out=tmp_path / name)
        assert _column(tmp_path / name, "torch_kernel") == [0.0] * 4, name
        runs[name] = _params(result.value)
    for name, params in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(params, eager)), name
    chosen("torch")
    result = ff.run(program.train, program.args_cls(), policy="pipelined(actors=1)", out=tmp_path / "torch")
    assert _column(tmp_path / "torch", "torch_kernel") == [1.0] * 4
    assert not all(torch.equal(a, b) for a, b in zip(_params(result.value), eager))


def test_a_malformed_fragflow_linear_is_refused_before_the_run(write_algo, chosen):
    chosen("mkl")
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    with pytest.raises(ConfigError, match=r"FRAGFLOW_LINEAR='mkl' is not one of auto, onednn, torch") as info:
        ff.run(program.train, program.args_cls(), policy="single_process")
    assert "FRAGFLOW_LINEAR=torch" in info.value.fix


def test_onednn_asked_of_a_torch_without_it_is_refused(write_algo, chosen, monkeypatch):
    chosen("onednn")
    monkeypatch.setattr(onednn, "inner_product", lambda: None)
    path, _ = write_algo(PROGRAM)
    program = load(str(path))
    with pytest.raises(ConfigError, match=r"FRAGFLOW_LINEAR=onednn, but this torch .* has no oneDNN inner product"):
        ff.run(program.train, program.args_cls(), policy="single_process")
