"""What an acting process holds of the versioned state a learner elsewhere sends it, and the check
that it stays as received: a change made in place there (an actor stepping the state's optimizer,
``p.add_(...)``, a draw from a generator in the state) would be lost at the next version, so the
loop refuses it at the call where it is seen. Torch tensors are watched by their version counters
(an integer each), numpy arrays made read-only, random generators compared by their state."""

from __future__ import annotations

import contextlib
import pickle
import random
import sys
from typing import Any

import numpy as np

from fragflow.compiler.pytree import is_generator, leaf_paths
from fragflow.errors import VersionedStateError
from fragflow.source import user_callsite


def check_unchanged(watched: dict[str, list[tuple[str, Any, int]]], drawn: dict[str, list[tuple[str, Any, bytes]]],
                    state: str, fragment: str | None) -> None:
    """Refuse a received version of ``state`` changed in place in this process (an actor that
    steps the state's optimizer, ``p.add_(...)``): here, apart from the learner, the change is
    lost at the next version. A torch tensor's version counter counts its in-place changes, so
    this costs an integer per tensor; numpy leaves are read-only (see received)."""
    for path, tensor, version in watched.get(state, ()):
        if tensor._version != version:
            raise changed_here(f"{state}{path} (by fragment '{fragment}', or by the loop before its call)"
                                if fragment is not None else f"{state}{path} (by the loop)")
    for path, gen, then in drawn.get(state, ()):
        if state_of(gen) != then:
            by = f"fragment '{fragment}', or the loop before its call" if fragment is not None else "the loop"
            raise changed_here(
                f"{state}{path} (a random generator, drawn from by {by})",
                why="the draws move this process's copy of it (a version carries no generator), not the one the "
                    "learner draws from and saves, and every acting process holds a copy that draws the same numbers",
                fix="draw the acting side's random numbers from a generator the loop makes outside ff.versioned "
                    "(or from ff.random keys, one per environment), leave the state's generators to its "
                    "learners, or run with --policy single_process")


def changed_here(what: str, why: str | None = None, fix: str | None = None) -> VersionedStateError:
    return VersionedStateError(
        f"versioned state {what} was changed in place in an acting process, but this policy runs the learner in "
        "another process: " + (why or "the change stays in this process's copy, the learner never sees it, and the "
                                      "next version overwrites it"), where=user_callsite(),
        fix=fix or "leave the state a fragment reads unchanged (work on a copy: tensor.clone(), array.copy(); in-place "
                   "ops change it even under torch.no_grad(), optimizer.step() among them), make the change in a learner "
                   "that writes the state, or run with --policy single_process (a network in training mode changes its "
                   "BatchNorm statistics as it runs: call .eval() on it in the actor, and .train() in the learner)")


def counted() -> contextlib.AbstractContextManager[Any]:
    """Out of torch.inference_mode (a loop that calls the actor under it): tensors made there keep
    no version counter, which received reads, and the state's own tensors are ordinary ones eagerly."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode(False)


def received(roots: Any, trees: list[Any], modules: dict[int, tuple[Any, list[tuple[str, Any]]]]
              ) -> tuple[list[tuple[str, Any, int]], list[tuple[str, Any, bytes]]]:
    """The torch tensors of a received view with their version counters, and its random generators
    (the process's own copies: a version does not carry them) with their states; its numpy arrays
    are made read-only (an in-place write raises where it is made). A module's tensors are the same
    objects at every version (overwritten in place): ``modules`` keeps them, by module, so that a
    version costs an integer per tensor, not a walk of the module's state dict."""
    tensors: list[tuple[str, Any, int]] = []
    generators: list[tuple[str, Any, bytes]] = []
    torch = sys.modules.get("torch")

    def walk(x: Any, path: str) -> None:
        if isinstance(x, np.ndarray):
            x.flags.writeable = False
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(x, tuple) and hasattr(x, "_fields"):
            for f, v in zip(x._fields, x):
                walk(v, f"{path}.{f}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i!r}]")
        elif torch is not None and isinstance(x, torch.Tensor):
            tensors.append((path, x, x._version))
        elif torch is not None and isinstance(x, torch.nn.Module):
            known = modules.get(id(x))
            if known is None or known[0] is not x:
                known = modules[id(x)] = (x, leaf_paths(x))
            # (a module's extra state, get_extra_state's, is put back with set_extra_state: not watched)
            tensors.extend((path + p, t, t._version) for p, t in known[1] if isinstance(t, torch.Tensor))
        elif is_generator(x):
            generators.append((path, x, state_of(x)))

    for root, tree in zip(roots, trees):
        walk(tree, "".join(f"[{k!r}]" for k in root))
    return tensors, generators


def state_of(gen: Any) -> bytes:
    """A random generator's state, which every draw moves."""
    if isinstance(gen, np.random.RandomState):
        return pickle.dumps(gen.get_state(legacy=False))
    if isinstance(gen, np.random.Generator):
        return pickle.dumps(gen.bit_generator.state)
    if isinstance(gen, random.Random):
        return pickle.dumps(gen.getstate())
    return bytes(gen.get_state().numpy())   # a torch.Generator
