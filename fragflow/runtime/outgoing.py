"""What a service group sends out (see :class:`~fragflow.runtime.service.ServiceRunner`): each
requesting replica's part of a served call's outputs, the scalars the loop logs of them, every new
version of the states it broadcasts, and its parts of a checkpoint; and outputs made its own before
the ring slots their views lie in are freed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from fragflow.compiler.axes import address
from fragflow.compiler.pytree import flatten, leaf_paths, spec_of, to_numpy, unsaved_paths, without_optimizers
from fragflow.errors import ConfigError, SpecChangedError
from fragflow.runtime import calls
from fragflow.runtime.gathering import _Piece
from fragflow.runtime.scalars import non_scalar, scalars_in


class Outgoing:
    """The service runner's sending (the attributes below are the runner's)."""

    program: Any
    endpoints: Any
    checks: dict[str, Any]
    results: Any
    version: int
    writes: dict[str, int]
    current: str
    instances: dict[str, Any]
    states: dict[str, Any]
    replies: dict[str, dict[int, tuple[Any, Any]]]
    started: list[int | None]
    saving: dict[str, Any]
    saved_seq: int
    cuts: dict[int, dict[int, int]]
    driver: int
    resume_random: tuple[Any, Any] | None
    acting_before: dict[str, dict[int, list[Any]]]
    _answered: dict[str, list[str]]
    _seed_random: tuple[dict[str, Any], dict[str, Any]] | None
    flush_reports: Callable[[], None]

    def _answer(self, fragment: str, out: Any, pieces: list[_Piece]) -> None:
        """Send each requesting replica its part of a request's outputs (split along their batch axes)."""
        named = leaf_paths(out)
        leaves = [leaf for _, leaf in named]
        first = self.replies[fragment][pieces[0].replica][0]
        if len(leaves) != len(first.specs):   # (zip below would drop the extra ones)
            self._check_answer(fragment, leaves, first, len(pieces))
        paths = [path for path, _ in named]
        known = self._answered.setdefault(fragment, paths)
        if paths != known:   # (the loop rebuilds the answer in the traced structure: other keys would be misnamed)
            raise SpecChangedError(
                f"fragment '{fragment}' returned outputs {paths}, where its earlier calls returned {known}",
                where=self.checks.get("called_at", {}).get(fragment),
                fix="return the same structure (the same keys) at every call")
        for leaf, axis, spec in zip(leaves, first.axes, first.specs):   # (a longer batch axis would be cut silently)
            shape = getattr(leaf, "shape", ())
            if axis is not None and (len(shape) <= axis or shape[axis] != spec.shape[axis] * len(pieces)):
                self._check_answer(fragment, leaves, first, len(pieces))
                raise SpecChangedError(
                    f"fragment '{fragment}' returned an output of shape {tuple(shape)} for a batch of {len(pieces)} "
                    f"requests of {spec.shape[axis]} rows each", where=self.checks.get("called_at", {}).get(fragment),
                    fix="keep every output's shape fixed across calls: one row per environment it acted for")
        try:
            for i, p in enumerate(pieces):   # the batch holds the pieces' rows in this order (see _merge)
                ring_spec, ring = self.replies[fragment][p.replica]
                part = []
                for leaf, axis, spec in zip(leaves, ring_spec.axes, ring_spec.specs):
                    if axis is None:
                        part.append(leaf)
                    else:
                        n = spec.shape[axis]
                        part.append(to_numpy(leaf).take(range(i * n, (i + 1) * n), axis=axis))
                ring.put(part, self.version)   # (the ring refuses another shape or dtype)
                if self.started[p.replica] is None:
                    self.started[p.replica] = self.version
        except (SpecChangedError, TypeError, ValueError, IndexError):
            self._check_answer(fragment, leaves, first, len(pieces))   # which output, at the actor's line
            raise

    def _check_answer(self, fragment: str, leaves: list[Any], ring_spec: Any, pieces: int) -> None:
        """Refuse outputs of a request that do not match the traced specs the replies were sized for
        (with the batch of ``pieces`` requests along their batch axes), naming the output and the
        loop's line; called where the reply channel refused them."""
        where = self.checks.get("called_at", {}).get(fragment)
        fix = "keep every output's shape and dtype fixed across calls (pad or bucket variable-size data)"
        if len(leaves) != len(ring_spec.specs):
            raise SpecChangedError(f"fragment '{fragment}' returned {len(leaves)} array leaves, but it was traced "
                                   f"returning {len(ring_spec.specs)}", where=where, fix=fix)
        for j, (leaf, axis, spec) in enumerate(zip(leaves, ring_spec.axes, ring_spec.specs)):
            shape = list(spec.shape)
            if axis is not None:
                shape[axis] *= pieces
            got = spec_of(leaf)
            if got.shape != tuple(shape) or (got.dtype != spec.dtype and spec.backend != "python"):
                want = replace(spec, shape=tuple(shape))
                raise SpecChangedError(f"fragment '{fragment}' returned output leaf {j} as {got.short()} "
                                       f"{got.backend}, but it was traced as {want.short()} {want.backend}",
                                       where=where, fix=fix)

    def _logged(self, fragment: str, out: Any) -> dict[int, dict[str, float | None] | None]:
        """The scalars of each part of the call's output the loop may log (see lowering's _logged),
        by their path in the part ("" for a part that is one scalar); None for a part this call did
        not return."""
        logged: dict[int, dict[str, float | None] | None] = {}
        for part, item in enumerate(self.program.logs.get(fragment, ())):
            value = out if item.index < 0 else out[item.index]
            try:
                for k in item.keys:
                    value = value[k]
            except (KeyError, IndexError, TypeError):
                logged[part] = None   # a metric this call did not return (the learner reports it now and then)
                continue
            bad = non_scalar(value) if item.names else None   # (a part the loop sent to ff.log while traced)
            if bad is not None:
                where = "".join(f"[{k!r}]" for k in (*item.keys, *(bad[0].split("/") if bad[0] else ())))
                raise ConfigError(
                    f"output {'' if item.index < 0 else f'[{item.index}]'}{where} of fragment '{fragment}', which "
                    f"the loop logs, {bad[1]} (it was one while the program was traced)",
                    where=self.checks.get("called_at", {}).get(fragment),
                    fix="return scalars to log: reduce it first (x.mean(), x.max()) or return its elements under "
                        "names of their own")
            logged[part] = scalars_in(value)
        return logged

    def _publish(self, state: str, made: bool = False) -> None:
        b = next(b for b in self.program.publish if b.state == state)
        leaves: list[Any] = []
        value = self.states[state]
        for path in b.paths:
            sub = value
            for k in path:
                sub = sub[k]
            leaves.extend(flatten(without_optimizers(sub))[0])
        try:
            self.endpoints.broadcasts[state].publish(leaves, self.version, self.writes.get(state, 0))
        except (SpecChangedError, TypeError, ValueError) as exc:   # (the channel's own words name no fragment)
            unfit = self._made_unfit(state, value, exc) if made else self._unfit(state, exc)
            if isinstance(unfit, SpecChangedError) and unsaved_paths(value):
                unfit.restate(fix=f"{unfit.fix}; a module's buffers travel with each version, those registered with "
                                  "persistent=False too: a cache made or resized after the trace belongs in a plain "
                                  "attribute (self.cache = ...), not a buffer")
            raise unfit from None

    def _made_unfit(self, state: str, value: Any, exc: Exception) -> Exception:
        """The state as the program made it (version 0) does not fit the broadcast, sized from the versions
        its learner returned while traced: a leaf the learner returns in another kind (a Python number it
        turns into a tensor at its first update). Named with both, where the state was made."""
        for (writer, written), traced in self.checks.get("state", {}).items():
            if written != state:
                continue
            for path, leaf in leaf_paths(value):
                spec = traced.get(path)
                got = spec_of(leaf)
                if spec is not None and (got.shape, got.dtype, got.backend) != (spec.shape, spec.dtype, spec.backend):
                    return SpecChangedError(
                        f"versioned state '{state}' holds {path} as {got.short()} {got.backend} as it was made, but "
                        f"learner '{writer}' returns it as {spec.short()} {spec.backend}: this policy sends every "
                        "version of it to the acting side in one layout, the learner's", where=self.checks.get(
                            "made_at", {}).get(state),
                        fix=f"make it as the learner returns it (a {spec.backend} {spec.short()} from the start"
                            + (", torch.tensor(x) for a number it turns into a tensor" if spec.backend == "torch" and
                               got.backend == "python" else "")
                            + "), or have the learner return it as it was made"
                            + (" (float(x), x.item())" if got.backend == "python" else "")
                            + "; or run with --policy single_process")
        return exc

    def _unfit(self, state: str, exc: Exception) -> Exception:
        """The broadcast, sized from the state's traced specs, refused the state a learner just wrote:
        the learner changed a leaf's dtype or shape (or the state's structure) at an update the
        periodic check skips. Named as that check names it: the learner, its line, the leaf."""
        writer = self.current
        traced = self.checks.get("state", {}).get((writer, state))
        if traced is None:   # (published as it came: no learner wrote it)
            return exc
        where = self.checks.get("called_at", {}).get(writer)
        update = self.version if writer == self.program.clock else self.version + 1
        try:
            calls.check_state(self.states[state], traced, writer, state, where, update=update)
        except SpecChangedError as found:
            return found
        return SpecChangedError(
            f"learner '{writer}' returned state '{state}' in update {update} that no longer fits the channel "
            f"sized from its traced specs, which carries it to the acting side: {getattr(exc, 'what', exc)}", where=where,
            fix="keep the state's shapes, dtypes and structure fixed (cast a leaf back to the dtype it was traced with)")

    def _save(self, seq: int) -> None:
        """This group's part of checkpoint ``seq``: the states it writes and its objects' state_dicts."""
        from fragflow.runtime import checkpoint, snapshot

        self.flush_reports()   # (the updates it made before the cut reach the driver before its part)
        self.saved_seq = seq
        for old in [s for s in self.cuts if s <= seq]:
            del self.cuts[old]
        group = self.program.group
        objects: dict[str, Any] = {}
        arrays: dict[str, Any] = {}
        for key, inst in self.instances.items():
            if callable(getattr(inst, "state_dict", None)) and callable(getattr(inst, "load_state_dict", None)):
                try:
                    objects[key] = checkpoint.encode(inst.state_dict(), f"object.{key}", arrays)[0]
                except checkpoint.Unsupported as exc:
                    raise checkpoint.CheckpointError(
                        f"cannot save {key!r} in the {group} process: its state_dict() holds {exc}",
                        fix="return arrays, numbers, strings and dicts/lists of them from state_dict()") from None
        if objects:   # before the states part: the driver commits once every expected part is in
            checkpoint.deliver(self.results, self.saving, seq, self.driver, f"objects.{group}", objects, arrays, {})
        owned = set(self.program.writes) | set(self.writes) | set(self.program.saves) | {b.state for b in self.program.publish}
        meta, arrays = snapshot.encode_states({n: (self.version, v) for n, v in self.states.items() if n in owned})
        rng, rng_arrays = snapshot.global_random()   # what the learner draws next (torch.randperm, dropout)
        # ... and which of them it drew from (in this run, or in the one it resumed): a resumed run in
        # one process goes on from these where its loop did not draw (see snapshot.drawn_apart)
        before = (self.resume_random or ({}, {}))[0].get("drew", [])
        since = snapshot.drawn((rng, rng_arrays), self._seed_random) if self._seed_random is not None else []
        rng["drew"] = [g for g in snapshot.GENERATORS if g in before or g in since]
        meta[snapshot.RANDOM] = rng
        arrays.update(rng_arrays)
        if self.program.max_lag and self.program.ordered and self.program.publish:
            meta[snapshot.ACTING] = snapshot.encode_acting(self._acting_views(), arrays)
        checkpoint.deliver(self.results, self.saving, seq, self.driver, f"states.{group}", meta, arrays,
                           {"version": self.version})

    def _acting_views(self) -> dict[str, dict[int, list[Any]]]:
        """What the acting side reads of each state it is sent, at the ``max_lag`` versions before
        this one: under an exact version choice the loop's next trips act with them (update ``i``
        with version ``i - max_lag``), so a run resumed from this checkpoint must have them. Keyed by
        how many versions before; none before the run's first (acted with version 0, saved)."""
        out: dict[str, dict[int, list[Any]]] = {}
        for b in self.program.publish:
            views = out[b.state] = {}
            for k in range(1, self.program.max_lag + 1):
                v = self.version - k
                if v >= 0:   # (still in the broadcast, max_lag + 3 versions deep; complete: a newer one is out)
                    views[k] = self.endpoints.broadcasts[b.state].read(v)[1]
                elif v in self.acting_before.get(b.state, {}):   # (this run is resumed: before its version 0)
                    views[k] = self.acting_before[b.state][v]
        return out


def owned(tree: Any, spans: list[tuple[int, int]]) -> Any:
    """``tree`` with each array leaf whose memory lies in one of ``spans`` (ring slots about to be
    freed for the next piece) replaced by a copy: a batch's zero-copy views are the call's to read,
    not to keep (``torch.as_tensor(batch["obs"])[-1]`` in the state it returns). Dicts and lists are
    changed in place; modules and optimizers hold their own tensors and are not walked."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            new = owned(v, spans)
            if new is not v:
                tree[k] = new
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            new = owned(v, spans)
            if new is not v:
                tree[i] = new
        return tree
    if isinstance(tree, tuple):
        kids = [owned(v, spans) for v in tree]
        if all(a is b for a, b in zip(kids, tree)):
            return tree
        return type(tree)(*kids) if hasattr(tree, "_fields") else tuple(kids)
    at = address(tree)
    if at is not None and any(lo <= at[0] < hi for lo, hi in spans):
        return tree.copy() if isinstance(tree, np.ndarray) else tree.clone()
    return tree
