"""The user's module data as it was before the trace, put back where the trace unwinds.

Under a policy of several processes the trace runs the loop and its fragments for real, then the
run starts afresh in its processes, which fork from the driver or are sent the program (its module
pickled by value where it was loaded from a file path). What the trace did to the module's data
went with it: a loop's ``global step; step += 1``, a schedule it keeps in a global dict
(``CFG["eps"] *= 0.5``), a list it appends to, an array it changes in place, a global network
an optimizer of the module steps; the run started from the values the trace left (a counter at 25
for 16 steps, the first actions taken with the exploration rate of the trace's last update).
Eagerly, and under ``single_process`` (whose run the trace begins), the loop starts from the
module as it was imported. So the names of the training function's module, and of its module's
fragments' modules, are bound again to the values they held, and what those values hold is put
back in place (the same objects: a fragment, an optimizer, a closure that holds one sees it put
back): a list's, dict's or set's items (one level deep, and so on into the containers and arrays
they hold, to a few levels; a tuple's items, the tuple itself being unchangeable), an array's or tensor's values, a module's parameters and buffers, an
optimizer's state and a learning-rate scheduler's, the attributes of an object of a class of those modules (a tracker, the user's own
buffer). Other objects (fragflow's buffers, a library's objects) are left as the trace left them,
and so are arrays over 16 MB (64 MB in all).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np

_DEPTH = 3
_MAX_BYTES = 64 << 20    # (arrays beyond this many bytes in all, or one larger than _MAX_ARRAY, a data set the
_MAX_ARRAY = 16 << 20    # module loads, are not copied: left as the trace leaves them)


class ModuleData:
    def __init__(self, scopes: list[dict[str, Any]]) -> None:
        self._names: list[tuple[dict[str, Any], str, Any]] = []
        self._items: list[tuple[Any, Any]] = []     # (container, shallow copy)
        self._arrays: list[tuple[Any, Any]] = []    # (array or tensor, copy of its values)
        self._optimizers: list[tuple[Any, Any]] = []
        self._schedulers: list[tuple[Any, Any]] = []
        self._bytes = 0
        self._seen: set[int] = set()
        self._objects: list[tuple[Any, dict[str, Any]]] = []   # (object of a user's class, its attributes)
        self._modules = {scope.get("__name__") for scope in scopes} - {None}
        done: set[int] = set()
        for scope in scopes:
            if id(scope) in done:
                continue
            done.add(id(scope))
            for name, value in list(scope.items()):
                if name.startswith("__"):
                    continue
                self._names.append((scope, name, value))
                self._take(value, 0)

    def watched(self, names: list[tuple[dict[str, Any], str]]) -> None:
        """Names the trace's watchers rebind and put back themselves (an imported ``set_num_threads``):
        not rebound here (undone while torch's own stays patched, the program could not be pickled)."""
        skip = {(id(scope), name) for scope, name in names}
        self._names = [(scope, name, value) for scope, name, value in self._names if (id(scope), name) not in skip]

    def _take(self, value: Any, depth: int) -> None:
        if id(value) in self._seen or depth > _DEPTH:
            return
        kind = type(value)
        if kind in (list, dict, set):
            self._seen.add(id(value))
            self._items.append((value, copy.copy(value)))
            for item in (value.values() if kind is dict else value if kind is list else ()):
                self._take(item, depth + 1)
        elif isinstance(value, tuple):   # (itself unchangeable, a namedtuple too: what it holds is put back)
            self._seen.add(id(value))
            for item in value:
                self._take(item, depth + 1)
        elif self._users(value):
            self._seen.add(id(value))
            fields = {k: v for k, v in vars(value).items() if k != "_fragflow_bound"}
            self._objects.append((value, fields))
            for item in fields.values():
                self._take(item, depth + 1)
        elif isinstance(value, np.ndarray) and value.flags.writeable and value.dtype != object:
            self._array(value, value.nbytes, lambda: value.copy())
        elif (torch := sys.modules.get("torch")) is not None:
            if isinstance(value, torch.Tensor):
                self._array(value, value.numel() * value.element_size(), lambda: value.detach().clone())
            elif isinstance(value, torch.nn.Module):
                self._seen.add(id(value))
                for t in [*value.parameters(), *value.buffers()]:
                    self._take(t, depth)
            elif isinstance(value, torch.optim.Optimizer):
                self._seen.add(id(value))
                try:
                    self._optimizers.append((value, copy.deepcopy(value.state_dict())))
                except Exception:   # (an optimizer whose state cannot be copied is left as it is)
                    pass
            elif isinstance(value, torch.optim.lr_scheduler.LRScheduler):   # (its epoch with its optimizer's rate)
                self._seen.add(id(value))
                try:
                    self._schedulers.append((value, copy.deepcopy(value.state_dict())))
                except Exception:
                    pass

    def _users(self, value: Any) -> bool:
        """An object of a class of the user's modules (a tracker, a schedule object, the user's buffer),
        with a plain ``__dict__``: its attributes are put back."""
        module = getattr(type(value), "__module__", "")
        return module in self._modules and not isinstance(value, type) and type(getattr(value, "__dict__", None)) is dict

    def _array(self, value: Any, nbytes: int, copied: Any) -> None:
        self._seen.add(id(value))
        if nbytes > _MAX_ARRAY or self._bytes + nbytes > _MAX_BYTES:
            return
        self._bytes += nbytes
        self._arrays.append((value, copied()))

    def restore(self) -> None:
        for scope, name, value in self._names:
            if scope.get(name, value) is not value or name not in scope:
                scope[name] = value
        for obj, fields in self._objects:
            attributes = vars(obj)
            for key in [k for k in attributes if k not in fields and k != "_fragflow_bound"]:
                del attributes[key]
            attributes.update(fields)
        for container, saved in self._items:
            if type(container) is list:
                container[:] = saved
            else:
                container.clear()
                container.update(saved)
        for array, saved in self._arrays:
            # (only what changed: a copy bumps a tensor's version counter, which the run's checks of
            # what a fragment reaches read as the loop's change)
            if isinstance(array, np.ndarray):
                if array.shape == saved.shape and not np.array_equal(array, saved, equal_nan=saved.dtype.kind in "fc"):
                    np.copyto(array, saved)
            else:
                import torch

                if array.shape == saved.shape and array.dtype == saved.dtype and not torch.equal(array, saved):
                    with torch.no_grad():
                        array.copy_(saved)
        for opt, saved in self._optimizers:
            if not opt.state and not saved["state"] and [{k: v for k, v in g.items() if k != "params"}
                                                         for g in opt.param_groups] == \
                    [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]:
                continue   # (unchanged: not steps, as a fresh optimizer's)
            try:
                opt.load_state_dict(saved)
            except Exception:
                pass
        for sched, saved in self._schedulers:
            try:
                sched.load_state_dict(copy.deepcopy(saved))
            except Exception:
                pass
