"""``ff.numpy_forward``: a small torch MLP's forward pass computed in numpy, for acting.

An actor computes a row per environment: a few thousand multiply-adds, where each torch call costs
microseconds of its own (the dispatcher, autograd's bookkeeping, a module's ``__call__``). numpy's
calls cost a fraction of that: a 64-64 tanh policy on 8 rows took 9.7 us in numpy against
torch's 21.5 us, DQN's 120-84 Q-network on one row 8.6 against 19.1 us (quiet machine, a module called again). The weights are the module's own, read without copying; the result
is the same float32 arithmetic up to rounding (different matrix kernels). Learning keeps torch.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from fragflow.api.versioned import Versioned, VersionedView, _loop_value
from fragflow.errors import ConfigError
from fragflow.source import user_callsite


def numpy_forward(module: Any, x: Any) -> np.ndarray:
    """``module(x)`` in numpy, for an ``nn.Sequential`` (or a single layer) of ``nn.Linear``,
    ``nn.Tanh``, ``nn.ReLU``, ``nn.Sigmoid`` and ``nn.Identity`` layers whose parameters are on the
    CPU. ``x``: an array or tensor with the batch first; returns float32."""
    if isinstance(module, (Versioned, VersionedView)):   # the loop's own read of the state (as `state["q"](x)`)
        module = _loop_value(module, "given to ff.numpy_forward")
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        module = module._orig_mod   # (torch.compile's wrapper: the module it compiles computes the same)
    out = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float32)
    try:
        plan = _PLANS.get(module)
    except TypeError:   # (no module, a dict or a function: refused below)
        plan = None
    if plan is not None and _unchanged(plan, module):
        try:
            return _run(plan[2], out)
        except ValueError:   # (an input of another width: the layer-by-layer pass below says which layer)
            pass
    y = _apply(module, out)
    # planned at its second call (a module made anew for each call, a slice net[:2], never is)
    _PLANS[module] = _plan(module) if module in _PLANS else None
    return y


# A module's pass as a list of steps, made at its second call and taken while nothing it was made
# from has changed (the same layers of the same classes and forwards in each Sequential, no hooks, the
# same weight tensors at the same storage, shape and strides): a call then costs the products and a few checks a layer, without the
# layer-by-layer walk's (13.1 -> 8.6 us for DQN's Q-network on one row)
_PLANS: weakref.WeakKeyDictionary[Any, tuple[Any, ...] | None] = weakref.WeakKeyDictionary()   # (None: given once)
_LINEAR, _TANH, _RELU, _SIGMOID = range(4)


def _plan(module: Any) -> tuple[Any, ...]:
    """What a pass of ``module`` reads (each layer's class and forward, its hooks, its children, a
    Linear's parameters) and its steps. It holds no reference to ``module`` itself (its key in
    ``_PLANS``: a module called again is freed as any, with its plan); its layers stand as None."""
    nn = _nn()
    layers: list[tuple[Any, ...]] = []
    linears: list[tuple[Any, ...]] = []
    steps: list[tuple[int, Any, Any]] = []

    def walk(layer: Any, ref: Any) -> None:
        cls = type(layer)
        kind = _kind(layer)
        children = layer._modules
        layers.append((ref, cls, cls.forward, children,
                       tuple(children.values()) if kind is nn.Sequential else None))
        if kind is nn.Sequential:
            for inner in children.values():
                walk(inner, inner)
        elif kind is nn.Linear:
            wt, b = _arrays(layer)
            params = layer._parameters
            w, bias = params["weight"], params.get("bias")
            linears.append((ref, params, w, bias, w.data_ptr(), w.stride(), w.shape,
                            None if bias is None else bias.data_ptr(), None if bias is None else bias.shape))
            steps.append((_LINEAR, wt, b))
        elif kind is nn.Tanh:
            steps.append((_TANH, None, None))
        elif kind is nn.ReLU:
            steps.append((_RELU, None, None))
        elif kind is nn.Sigmoid:
            steps.append((_SIGMOID, None, None))

    walk(module, None)
    return tuple(layers), tuple(linears), tuple(steps)


def _unchanged(plan: tuple[Any, ...], module: Any) -> bool:
    layers, linears, _ = plan
    for ref, cls, forward, children, members in layers:
        m = module if ref is None else ref
        d = m.__dict__   # (a module's own attributes, looked up without walking its class's)
        if type(m) is not cls or cls.forward is not forward or d["_forward_hooks"] or d["_forward_pre_hooks"] or \
                d["_modules"] is not children or (members is not None and tuple(children.values()) != members):
            return False
    for ref, params, w, b, ptr, stride, shape, bptr, bshape in linears:
        if (module if ref is None else ref).__dict__["_parameters"] is not params or params.get("weight") is not w or \
                params.get("bias") is not b or w.data_ptr() != ptr or w.stride() != stride or w.shape != shape or \
                (b is not None and (b.data_ptr() != bptr or b.shape != bshape)):
            return False
    return True


def _run(steps: tuple[tuple[int, Any, Any], ...], x: np.ndarray) -> np.ndarray:
    """The same arithmetic as :func:`_apply`; in place only on arrays made here."""
    own = False   # (x is the caller's until a step has made a new array)
    for kind, wt, b in steps:
        if kind == _LINEAR:
            x = x @ wt
            if b is not None:
                x += b
        elif kind == _TANH:
            x = np.tanh(x, out=x) if own else np.tanh(x)
        elif kind == _RELU:
            x = np.maximum(x, np.float32(0), out=x) if own else np.maximum(x, np.float32(0))
        else:
            x = np.tanh(x * np.float32(0.5)) * np.float32(0.5) + np.float32(0.5)
        own = True
    return x


_NN: Any = None
# a Linear layer's weight and bias as numpy arrays (views of the tensors), with what they were read
# from: the same tensor objects at the same storage, of the same shape and strides, hold the same values
_VIEWS: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _nn() -> Any:
    global _NN
    if _NN is None:
        from torch import nn

        _NN = nn
    return _NN


def _arrays(layer: Any) -> tuple[np.ndarray, np.ndarray | None]:
    params = layer._parameters
    w, b = params.get("weight"), params.get("bias")
    hit = _VIEWS.get(layer)
    # (the views share the tensors' memory, so an in-place change shows through them; a tensor or
    # storage replaced, `.data = ...` or a new Parameter, is read anew, and so is a view of the same
    # storage of another shape or strides, `w.data = w.data.t()`)
    if hit is not None and hit[0] is w and hit[1] is b and hit[2] == w.data_ptr() and hit[3] == w.stride() and \
            hit[4] == w.shape and (b is None or (hit[5] == b.data_ptr() and hit[6] == b.shape)):
        return hit[7], hit[8]
    if w is None:
        raise ConfigError(f"ff.numpy_forward reads a Linear layer's weight, but this {layer} computes its weight "
                          "(a parametrization, such as weight or spectral normalisation)", where=user_callsite(),
                          fix="call the module itself for a layer whose weight is computed")
    if w.device.type != "cpu" or str(w.dtype) != "torch.float32":
        raise ConfigError(f"ff.numpy_forward computes float32 on the CPU, but this {layer} has {w.dtype} weights on "
                          f"{w.device}", where=user_callsite(),
                          fix="call the module itself where its parameters are of another dtype or on an accelerator")
    wt = w.detach().numpy().T
    bn = b.detach().numpy() if b is not None else None
    _VIEWS[layer] = (w, b, w.data_ptr(), w.stride(), w.shape, None if b is None else b.data_ptr(),
                     None if b is None else b.shape, wt, bn)
    return wt, bn


def _kind(layer: Any) -> Any:
    """The torch class whose arithmetic ``layer`` computes: its own class, or the class of torch's it
    derives from where it keeps that class's forward (``class MLP(nn.Sequential)`` building its layers
    in ``__init__``); None for any other."""
    nn = _nn()
    cls = type(layer)
    for kind in (nn.Linear, nn.Tanh, nn.ReLU, nn.Sigmoid, nn.Identity, nn.Sequential):
        if cls is kind or (issubclass(cls, kind) and cls.forward is kind.forward):
            return kind
    return None


def _apply(layer: Any, x: np.ndarray, place: str = "") -> np.ndarray:
    nn = _nn()
    if not isinstance(layer, nn.Module):
        raise ConfigError(f"ff.numpy_forward takes a torch module (an nn.Sequential of nn.Linear layers and "
                          f"activations, or one layer), but got a {type(layer).__name__}", where=user_callsite(),
                          fix="give it the module itself (a network's nn.Sequential), or call the module itself; "
                              "for a dict of parameter tensors, compute the layers in numpy (x @ w.T + b)")
    if isinstance(layer, nn.modules.lazy.LazyModuleMixin):
        raise ConfigError(f"ff.numpy_forward reads a layer's weights, but this {type(layer).__name__} is a lazy layer "
                          "whose weights torch makes at its first call", where=user_callsite(),
                          fix="call the module itself once before (or give the layer its input size, nn.Linear)")
    if layer._forward_hooks or layer._forward_pre_hooks:
        raise ConfigError(f"ff.numpy_forward computes a layer's own arithmetic, but this {layer} has forward hooks, "
                          "which it would skip", where=user_callsite(), fix="call the module itself (its hooks run)")
    kind = _kind(layer)
    if kind is nn.Linear:
        wt, b = _arrays(layer)
        if x.shape[-1:] != wt.shape[:1]:
            raise ConfigError(f"ff.numpy_forward's layer {place + ' ' if place else ''}{layer} takes rows of "
                              f"{wt.shape[0]} numbers, but got an input of shape {x.shape}", where=user_callsite(),
                              fix="give it a batch of rows of the network's input size (the observation's), and "
                                  "layers whose sizes follow each other")
        return x @ wt + b if b is not None else x @ wt
    if kind is nn.Tanh:
        return np.tanh(x)
    if kind is nn.ReLU:
        return np.maximum(x, np.float32(0))
    if kind is nn.Sigmoid:
        return np.tanh(x * np.float32(0.5)) * np.float32(0.5) + np.float32(0.5)   # (no overflow for large -x)
    if kind is nn.Identity:
        return x
    if kind is nn.Sequential:
        for i, inner in enumerate(layer):
            x = _apply(inner, x, f"{place}[{i}]")
        return x
    raise ConfigError(f"ff.numpy_forward computes nn.Linear layers and the elementwise activations Tanh, ReLU, "
                      f"Sigmoid (and Identity) in an nn.Sequential, but got a {type(layer).__name__}",
                      where=user_callsite(), fix="call the module itself (torch computes any layer), or give "
                      "numpy_forward the Sequential of Linear layers and activations it is made of")
