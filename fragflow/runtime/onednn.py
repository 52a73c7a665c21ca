"""``torch.nn.functional.linear`` through oneDNN's inner product inside fragments (see :mod:`kernels`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

from fragflow.runtime import kernels

MIN_MACS = 1 << 21   # multiply-adds of the forward product (batch x in x out) from which oneDNN pays off
# the longest sum a product may have (rows for the weight's gradient, in features for the output, out
# features for the input's gradient): oneDNN splits longer ones among its threads, so that their bits
# depend on the thread count (here from 20k rows), which MKL's do not; up to 16k they did not, 1 to 16 threads
REDUCE_MAX = 8192

_PLAIN = (torch.Tensor, torch.nn.Parameter)
torch_linear = F.linear   # (torch's own, as it was when this module was imported)


@functools.cache
def inner_product() -> Any:
    """oneDNN's inner product on dense tensors (``mkldnn::_linear_pointwise``), where this torch has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
        if not torch.equal(op(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4), "none", [], ""), torch.full((2, 4), 4.0)):
            return None
    except (AttributeError, RuntimeError):
        return None
    return op


def amd_avx512() -> bool:
    """An AMD processor with AVX-512, on which MKL's sgemm takes its AVX2 code."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "AuthenticAMD" in line
    except OSError:
        pass
    return False


def install() -> bool:
    """``torch.nn.functional.linear`` becomes :func:`linear` in this process; False where it is not
    torch's own (another library's already: left to it), or where TorchScript cannot be told what it
    stands for."""
    if F.linear is not torch_linear:
        return F.linear is linear
    try:   # TorchScript compiles a module's F.linear as the aten op it stands for, not as Python
        torch.jit._builtins._register_builtin(linear, "aten::linear")
    except Exception:   # (a private API: a torch without it keeps its own kernel)
        return False
    F.linear = linear
    return True


def uninstall() -> None:
    """torch's own ``torch.nn.functional.linear`` again."""
    if F.linear is linear:
        F.linear = torch_linear


def _forward_ad() -> bool:
    return bool(torch.autograd.forward_ad._current_level >= 0)


def linear(input: Any, weight: Any, bias: Any = None) -> Any:
    """``torch.nn.functional.linear``: through oneDNN inside a fragment where it gains (see
    :mod:`fragflow.runtime.kernels`), else torch's own."""
    # (torch.compile's tracing first, which then sees nothing else; torch.jit's, then the size: most of the
    # layers this is not for are small ones, as an actor's on one observation)
    if not torch.compiler.is_compiling() and kernels.depth.n and type(input) in _PLAIN and type(weight) in _PLAIN \
            and not torch._C._is_tracing() and weight.dim() == 2 and input.numel() * weight.shape[0] >= MIN_MACS \
            and input.dim() >= 2 and input.shape[-1] == weight.shape[1] \
            and input.numel() <= REDUCE_MAX * weight.shape[1] and max(weight.shape) <= REDUCE_MAX \
            and (bias is None or type(bias) in _PLAIN) \
            and input.dtype is torch.float32 and weight.dtype is torch.float32 and input.is_cpu and weight.is_cpu \
            and input.layout is torch.strided and weight.layout is torch.strided \
            and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu and bias.layout is torch.strided
                                  and bias.shape == weight.shape[:1])) \
            and torch._C._get_mkldnn_enabled() \
            and not (torch.is_autocast_enabled("cpu") or torch._C._are_functorch_transforms_active() or _forward_ad()
                     or torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()):
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()   # (oneDNN reads a bias as dense)
        flat = input if input.dim() == 2 else input.reshape(-1, input.shape[-1])
        if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            out = OneDNNLinear.apply(flat, weight, bias)
        else:
            out = inner_product()(flat, weight, bias, "none", [], "")
        return out if input.dim() == 2 else out.view(*input.shape[:-1], weight.shape[0])
    return torch_linear(input, weight, bias)


class OneDNNLinear(torch.autograd.Function):
    """``input @ weight.T + bias`` and its gradients through oneDNN's inner product (2-D input)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        need_input, need_weight, _ = ctx.needs_input_grad
        # (as torch's own: what the gradients asked for need, no more)
        ctx.save_for_backward(input if need_weight else None, weight if need_input else None)
        ctx.has_bias = bias is not None
        return inner_product()(input, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad
        if torch.is_grad_enabled():   # a graph of the gradients (create_graph): torch's own, differentiable ops
            return (grad.mm(weight) if need_input else None, grad.t().mm(input) if need_weight else None,
                    grad.sum(0) if need_bias and ctx.has_bias else None)
        op = inner_product()
        # (the inner product takes strided operands: the transposes are views)
        return (op(grad, weight.t(), None, "none", [], "") if need_input else None,
                op(grad.t(), input.t(), None, "none", [], "") if need_weight else None,
                grad.sum(0) if need_bias and ctx.has_bias else None)
