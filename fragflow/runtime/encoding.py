"""Values <-> (a JSON structure, named arrays): how a checkpoint stores what a run holds.

Pytrees of numpy arrays, torch tensors, jax arrays, Python and numpy scalars, and the
``state_dict`` of ``nn.Module`` and ``torch.optim`` objects, as a JSON structure whose arrays are
referred to by key (safetensors holds the arrays). Decoding with the live value as a template
loads modules and optimizers in place and checks every array's shape and dtype.

>>> meta, tensors = encode({"w": np.ones(2, np.float32), "n": 3}, "x")
>>> decode(meta, tensors, {"w": np.zeros(2, np.float32), "n": 0})
{'w': array([1., 1.], dtype=float32), 'n': 3}
"""

from __future__ import annotations

import random as pyrandom
import sys
from typing import Any

import numpy as np

from fragflow.compiler.pytree import is_scheduler, unsaved_buffers

_NO = object()


class Unsupported(TypeError):
    def __init__(self, path: str, value: object) -> None:
        super().__init__(f"{path} is a {type(value).__module__}.{type(value).__qualname__}")
        self.path = path


# what a resumed optimizer's saved state set back of what the program built it with (a learning rate
# --set changed): said by the loop that restores it (see LoopInterpreter.versioned)
overridden: list[tuple[str, Any]] = []   # (what, the value built)


def _torch() -> Any:
    return sys.modules.get("torch")


def encode(value: Any, key: str, tensors: dict[str, np.ndarray] | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """A JSON structure describing ``value`` and the arrays it refers to (by key)."""
    out: dict[str, np.ndarray] = {} if tensors is None else tensors
    return _enc(value, key, out), out


def _enc(x: Any, key: str, out: dict[str, np.ndarray]) -> Any:
    torch = _torch()
    if x is None:
        return {"t": "none"}
    if isinstance(x, np.generic):   # before Python's scalars: np.float64 is a float, np.bool_ is not a bool
        return {"t": "np", "dtype": x.dtype.str, "v": x.item()}
    if isinstance(x, (bool, int, float, str)):
        return {"t": "py", "v": x}
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise Unsupported(key, x)
        out[key] = np.ascontiguousarray(x)
        return {"t": "ndarray", "k": key, "shape": list(x.shape)}
    if torch is not None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            if t.dtype == torch.bfloat16:
                out[key] = t.view(torch.int16).numpy()
            else:
                out[key] = t.numpy()
            return {"t": "tensor", "k": key, "dtype": str(t.dtype).removeprefix("torch."), "device": str(x.device),
                    "shape": list(t.shape)}
        if isinstance(x, torch.nn.Module):
            unsaved = dict(unsaved_buffers(x))   # (state_dict leaves them out; they travel with the state's versions)
            if unsaved:
                return {"t": "module", "v": _enc(x.state_dict(), key, out), "unsaved": _enc(unsaved, f"{key}.unsaved", out)}
            return {"t": "module", "v": _enc(x.state_dict(), key, out)}
        if isinstance(x, torch.optim.Optimizer):
            return {"t": "optimizer", "v": _enc(x.state_dict(), key, out)}
        if is_scheduler(x):
            return {"t": "scheduler", "v": _enc(x.state_dict(), key, out)}
        if isinstance(x, torch.Generator):
            return {"t": "torch_generator", "v": _enc(x.get_state(), key, out), "device": str(x.device)}
    if isinstance(x, np.random.Generator):
        return {"t": "np_generator", "bit_generator": type(x.bit_generator).__name__,
                "v": _enc(x.bit_generator.state, key, out)}
    if isinstance(x, np.random.RandomState):
        return {"t": "np_randomstate", "v": _enc(x.get_state(legacy=False), key, out)}
    if type(x) is pyrandom.Random:   # (Python's own: its Mersenne Twister's 625 words, as numbers)
        version, words, gauss = x.getstate()
        return {"t": "py_random", "version": version, "words": list(words), "gauss": gauss}
    if type(x).__module__.startswith(("jax", "jaxlib")) and hasattr(x, "shape"):
        out[key] = np.ascontiguousarray(np.asarray(x))
        return {"t": "jax", "k": key, "shape": list(x.shape)}
    if isinstance(x, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
            raise Unsupported(key, next(k for k in x if not isinstance(k, (str, int)) or isinstance(k, bool)))
        return {"t": "dict", "items": [[k, _enc(v, f"{key}[{k!r}]", out)] for k, v in x.items()]}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"t": "namedtuple", "items": [_enc(v, f"{key}.{f}", out) for f, v in zip(x._fields, x)]}
    if isinstance(x, (list, tuple)):
        return {"t": "list" if isinstance(x, list) else "tuple",
                "items": [_enc(v, f"{key}[{i}]", out) for i, v in enumerate(x)]}
    raise Unsupported(key, x)


class Mismatch(ValueError):
    """A saved value does not fit the live object it is loaded into."""


def decode(meta: Any, tensors: dict[str, np.ndarray], template: Any = _NO, path: str = "") -> Any:
    """The value ``meta`` describes. With a ``template`` (the live value) modules and optimizers are
    loaded in place and every array must have the template's shape and dtype (else :class:`Mismatch`)."""
    kind = meta["t"]
    torch = _torch()
    if kind == "none":
        return None
    if kind == "py":
        return meta["v"]
    if kind == "np":
        return np.array(meta["v"], dtype=np.dtype(meta["dtype"]))[()]
    if kind in ("ndarray", "jax"):
        arr = _array(tensors, meta["k"], meta.get("shape"))
        if template is not _NO and hasattr(template, "shape"):
            _same(path, tuple(arr.shape), str(arr.dtype), tuple(template.shape), str(np.dtype(template.dtype)))
        if kind == "jax":
            import jax.numpy as jnp

            return jnp.asarray(arr)
        return arr.copy()
    if kind == "tensor":
        assert torch is not None, "torch is needed to load a tensor"
        arr = _array(tensors, meta["k"], meta.get("shape"))
        dtype = getattr(torch, meta["dtype"])
        t = torch.from_numpy(arr.copy())
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        if template is not _NO and isinstance(template, torch.Tensor):
            _same(path, tuple(t.shape), meta["dtype"], tuple(template.shape), str(template.dtype).removeprefix("torch."))
            # loaded in place: a tensor an optimizer steps (SAC's log_alpha) stays its parameter, with
            # requires_grad (a new tensor had neither: the first backward after a resume failed)
            with torch.no_grad():
                template.copy_(t)
            return template
        return t.to(meta.get("device", "cpu")) if meta.get("device", "cpu") != "cpu" else t
    if kind in ("module", "optimizer", "scheduler"):
        sd = decode(meta["v"], tensors, path=path)
        if template is _NO:
            return sd
        live = template.state_dict()
        if kind == "scheduler":
            if set(sd) != set(live):
                raise Mismatch(f"{path}: the saved learning-rate scheduler had {sorted(sd)}, this one {sorted(live)}")
            template.load_state_dict(sd)
        elif kind == "module":
            _check_tree(path, sd, live)
            try:
                template.load_state_dict(sd, strict=True)
            except RuntimeError as exc:
                raise Mismatch(f"{path}: {str(exc).splitlines()[0]}") from None
            if "unsaved" in meta:
                _load_unsaved(template, decode(meta["unsaved"], tensors, path=path), path)
        else:
            saved_groups = [len(g["params"]) for g in sd.get("param_groups", [])]
            live_groups = [len(g["params"]) for g in live.get("param_groups", [])]
            if saved_groups != live_groups:
                raise Mismatch(f"{path}: the optimizer had parameter groups of sizes {saved_groups}, this one {live_groups}")
            for i, (built, saved) in enumerate(zip(live.get("param_groups", []), sd.get("param_groups", []))):
                for key, value in built.items():   # (the rate --set changed, which the saved state sets back)
                    was = saved.get(key, value)
                    if key != "params" and isinstance(value, (int, float)) and isinstance(was, (int, float)) and \
                            not isinstance(value, bool) and value != was:
                        overridden.append((f"{path}.param_groups[{i}][{key!r}]: {value!r} as built, {was!r} as saved",
                                           value))
            try:
                template.load_state_dict(sd)
            except (ValueError, KeyError) as exc:
                raise Mismatch(f"{path}: {exc}") from None
        return template
    if kind in ("torch_generator", "np_generator", "np_randomstate"):   # (loaded into the live one, else a new one)
        saved = decode(meta["v"], tensors, path=path)
        if kind == "torch_generator":
            assert torch is not None, "torch is needed to load a torch.Generator"
            gen = template if isinstance(template, torch.Generator) else torch.Generator(meta.get("device", "cpu"))
            gen.set_state(saved)
        elif kind == "np_generator":
            gen = template if isinstance(template, np.random.Generator) else \
                np.random.Generator(getattr(np.random, meta["bit_generator"])())
            if type(gen.bit_generator).__name__ != meta["bit_generator"]:
                raise Mismatch(f"{path}: the saved generator was a {meta['bit_generator']}, this one a "
                               f"{type(gen.bit_generator).__name__}")
            gen.bit_generator.state = saved
        else:
            gen = template if isinstance(template, np.random.RandomState) else np.random.RandomState()
            gen.set_state(saved)
        return gen
    if kind == "py_random":
        gen = template if type(template) is pyrandom.Random else pyrandom.Random()
        gen.setstate((meta["version"], tuple(meta["words"]), meta["gauss"]))
        return gen
    if kind == "dict":
        items = [(k, v) for k, v in meta["items"]]
        if template is not _NO and isinstance(template, dict):
            if [k for k, _ in items] != list(template):
                raise Mismatch(f"{path or 'the value'} had keys {[k for k, _ in items]}, the program's has {list(template)}")
            return {k: decode(v, tensors, template[k], f"{path}[{k!r}]") for k, v in items}
        return {k: decode(v, tensors, path=f"{path}[{k!r}]") for k, v in items}
    if kind in ("list", "tuple", "namedtuple"):
        metas = meta["items"]
        if template is not _NO and isinstance(template, (list, tuple)):
            if len(metas) != len(template):
                raise Mismatch(f"{path or 'the value'} had {len(metas)} items, the program's has {len(template)}")
            kids = [decode(m, tensors, t, f"{path}[{i}]") for i, (m, t) in enumerate(zip(metas, template))]
            if kind == "namedtuple" and hasattr(template, "_fields"):
                return type(template)(*kids)
        else:
            kids = [decode(m, tensors, path=f"{path}[{i}]") for i, m in enumerate(metas)]
        return kids if kind == "list" else tuple(kids)
    raise Mismatch(f"{path}: unknown entry kind {kind!r}")


def _array(tensors: dict[str, np.ndarray], key: str, shape: list[int] | None = None) -> np.ndarray:
    if key not in tensors:
        raise Mismatch(f"array {key!r} is missing from the checkpoint")
    arr = tensors[key]
    if shape is not None and list(arr.shape) != list(shape):
        if arr.size != int(np.prod(shape)):
            raise Mismatch(f"array {key!r} has shape {list(arr.shape)} in the file but {shape} in the manifest")
        arr = arr.reshape(shape)   # safetensors stores a 0-d array as [1]
    return arr


def _same(path: str, shape: tuple[int, ...], dtype: str, want_shape: tuple[int, ...], want_dtype: str) -> None:
    if shape != want_shape or dtype != want_dtype:
        raise Mismatch(f"{path or 'the value'} was saved as {dtype}{list(shape)}, the program has {want_dtype}{list(want_shape)}")


def _load_unsaved(module: Any, saved: dict[str, Any], path: str) -> None:
    """Put a module's saved non-persistent buffers back (in place where the module has one of that
    shape and dtype; else as its buffer: a cache the program makes at its first update)."""
    import torch

    for name, t in saved.items():
        prefix, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(prefix)
        except AttributeError:
            raise Mismatch(f"{path}: the module has no submodule {prefix!r} for its saved buffer {name!r}") from None
        if leaf not in owner._buffers:
            raise Mismatch(f"{path}: the module has no buffer {name!r} (registered with persistent=False) to load")
        live = owner._buffers[leaf]
        with torch.no_grad():
            if live is not None and live.shape == t.shape and live.dtype == t.dtype:
                live.copy_(t)
            else:
                owner._buffers[leaf] = t.to(live.device) if live is not None else t


def _check_tree(path: str, saved: dict[str, Any], live: dict[str, Any]) -> None:
    if list(saved) != list(live):
        missing, extra = [k for k in live if k not in saved], [k for k in saved if k not in live]
        raise Mismatch(f"{path}: the module's parameters differ (missing {missing[:4]}, unexpected {extra[:4]})")
    for k, v in saved.items():
        w = live[k]
        if hasattr(v, "shape") and hasattr(w, "shape"):
            _same(f"{path}[{k!r}]", tuple(v.shape), str(v.dtype).removeprefix("torch."), tuple(w.shape),
                  str(w.dtype).removeprefix("torch."))
