"""What the loop replicas a service gathers calls from must agree on, and the refusals where they do not.

Several replicas of the training loop (the acting processes of ``actor_learner``, the env workers of
``central_inference``) each run the whole loop over their share of the environments, and a service
merges their calls of one fragment into one. That is only the program's call where every replica
makes the same calls at the same moments and gives the same values that have no batch axis to
merge along. :class:`ReplicaChecks` holds the service's checks of that, and the messages that say
which replica did what (an ``if`` on each replica's own data, a break on it, a statistic of its own
share), each refused at the user's line rather than waited on for good or learned from silently.
"""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from fragflow.compiler.pytree import to_numpy
from fragflow.errors import ConfigError, FragflowError
from fragflow.lowering import ServiceProgram
from fragflow.lowering.program import WHOLE_MARK
from fragflow.placement.refusals import left_apart, left_at

if TYPE_CHECKING:
    from fragflow.runtime.gathering import _Piece


def _same_value(a: Any, b: Any, backend: str) -> bool:
    """Whether two replicas sent the same value (NaN where both have NaN)."""
    if backend == "python":
        return bool(a == b or (a != a and b != b))
    x, y = to_numpy(a), to_numpy(b)
    try:
        return bool(np.array_equal(x, y, equal_nan=True))
    except TypeError:   # (a dtype with no NaN to compare)
        return bool(np.array_equal(x, y))


_SHARED_SCHEDULE = ("call it on a schedule every replica shares (every N trips, once the buffer holds N steps counted in "
                    "trips), or run with one replica (actors=1, env_workers=1) or --policy single_process")



class ReplicaChecks:
    """The checks of :class:`~fragflow.runtime.service.ServiceRunner` on its loop replicas' calls
    (a mixin: the attributes below are the runner's)."""

    program: ServiceProgram
    checks: dict[str, Any]
    results: Any
    pools: dict[str, list[_Piece]]
    ring_specs: dict[str, Any]
    fragments: dict[str, Any]
    finished: list[bool]
    _calls_made: dict[tuple[int, str], int]
    _apart: dict[str, dict[int, tuple[int, list[Any], int]]]
    _whole: dict[tuple[str, int], tuple[int, list[Any]]]
    _changed: dict[str, tuple[int, int, int]]
    _alike: dict[str, set[int]]
    _stalled_since: float
    _stall_warned: bool
    _stall_warn: float

    def _on_own_data(self, fragment: str) -> str:
        """How the loop calls ``fragment`` on data of each replica's own environments: under the
        ``if`` around its call, where the training function's source has one."""
        guard = self.checks.get("guarded_at", {}).get(fragment)
        return f"under the `if` at {guard}" if guard is not None else "under a condition"

    def _refuse_unpaired(self, fragment: str, pieces: list[_Piece]) -> None:
        """Calls gathered one per replica, made after different numbers of env steps: the replicas
        call ``fragment`` under a condition on data of their own environments (an episode that
        ended), so this call would join different moments of the run (and single_process, stepping
        every environment, would call it at other times still)."""
        where = self.checks.get("called_at", {}).get(fragment)
        steps = ", ".join(f"replica {p.replica} after {p.steps}" for p in pieces)
        raise ConfigError(
            f"'{fragment}' is called by the loop replicas after different numbers of env steps ({steps}), and "
            f"this policy gathers one call of each replica into one: the loop calls it {self._on_own_data(fragment)} "
            "on data of each replica's own environments (an episode that ended, a reward), which the replicas see "
            "differently", where=where, fix=_SHARED_SCHEDULE)

    def _diverged(self, fragment: str, pieces: list[_Piece]) -> ConfigError:
        """Calls gathered one per replica in order, where one replica made ``fragment``'s next call
        before another made its last: the replicas make different calls. The fragments another
        replica called meanwhile (still waiting for this one's share) are what the loop calls on
        data of each replica's own environments."""
        counts: dict[int, list[_Piece]] = {}
        for p in pieces:
            counts.setdefault(p.replica, []).append(p)
        k, twice = next((r, ps) for r, ps in counts.items() if len(ps) > 1)
        others = sorted(((f, ps) for f, ps in self.pools.items()
                         if f != fragment and ps and all(p.replica != k for p in ps)),
                        key=lambda item: min(p.tag for p in item[1]))
        at = " and ".join(str(p.steps) for p in twice)
        if not others:
            return ConfigError(
                f"loop replica {k} called '{fragment}' again (after {at} env steps) before the other replicas had "
                "called it as often, and this policy gathers one call of each replica into one: the loop calls it "
                f"{self._on_own_data(fragment)} on data of each replica's own environments (an episode that "
                "ended, a reward), which the replicas see differently",
                where=self.checks.get("called_at", {}).get(fragment), fix=_SHARED_SCHEDULE)
        cause = others[0][0]
        names = " and ".join(f"'{f}'" for f, _ in others)
        by = ", ".join(str(r) for r in sorted({p.replica for _, ps in others for p in ps}))
        return ConfigError(
            f"loop replica(s) {by} called {names} where replica {k} did not (it went on to call '{fragment}' "
            f"again, after {at} env steps), and this policy gathers one call of each replica into one: the loop "
            f"calls '{cause}' {self._on_own_data(cause)} on data of each replica's own environments (an episode "
            "that ended, a reward), which the replicas see differently",
            where=self.checks.get("called_at", {}).get(cause), fix=_SHARED_SCHEDULE)

    def _watch_stall(self) -> None:
        """Warn once when a call has waited long for the other replicas' share: a loop that calls a
        learner under an ``if`` on data (an episode ending) calls it different numbers of times
        in different replicas, and under a policy that gathers one call per replica they then wait
        for each other for good."""
        now = time.monotonic()
        if not self.program.ordered and any(self.finished) and not all(self.finished):
            # gathered on arrival: a replica still calling a fragment past the calls a finished one made
            for (k, fragment), last in self._calls_made.items():
                ended = [j for j in range(self.program.producers)
                         if self.finished[j] and self._calls_made.get((j, fragment), -1) < last]
                if not self.finished[k] and ended:
                    raise self._left_apart(fragment, ended, [k])
        partial = [(f, pieces) for f, pieces in self.pools.items() if pieces and len(pieces) < self.program.producers]
        if not partial:
            self._stalled_since = now
            return
        for fragment, pieces in partial:
            sent = {p.replica for p in pieces}
            missing = [k for k in range(self.program.producers) if k not in sent]
            if self.program.ordered and missing and all(self.finished[k] for k in missing):
                # (gathered on arrival, a call a finished replica leaves unpaired at the end is dropped)
                raise self._left_apart(fragment, missing, sorted(sent))
        if self._stall_warned or now - self._stalled_since < self._stall_warn:
            return
        self._stall_warned = True
        calls = []
        for fragment, pieces in partial:
            have = sorted({p.replica for p in pieces})
            missing = [k for k in range(self.program.producers) if k not in have]
            calls.append(f"'{fragment}' by loop replica {', '.join(map(str, have))}, not {', '.join(map(str, missing))}")
        self.results.put(("warn", (
            f"the learner's process has waited {now - self._stalled_since:.0f} s for calls that gather one from each "
            f"loop replica; it holds {'; '.join(calls)}. If the loop calls a fragment under an `if` on data (an "
            "episode that ended), the replicas make different calls and wait for each other for good: call it on "
            "a schedule every replica shares (every N trips), or run with one replica (actors=1, env_workers=1) "
            "or --policy single_process")))

    def _left_apart(self, fragment: str, ended: list[int], going: list[int]) -> FragflowError:
        """Replicas that made different numbers of calls of ``fragment`` by the end of their loop."""
        resumed = (getattr(self, "saving", None) or {}).get("resume")
        saved = getattr(self, "_calls_saved", {})   # (a resumed run's: calls made before its checkpoint)
        idle = [k for k in sorted(ended + going)
                if all(saved.get(key) == last for key, last in self._calls_made.items() if key[0] == k)]
        went_on = [k for k in sorted(ended + going) if k not in idle]
        if resumed and idle and went_on:
            # (a resumed replica that made no call: the budget ends before where it stood, not the program's leaving)
            from fragflow.runtime.snapshot import CheckpointError

            return CheckpointError(
                f"the run resumed from {getattr(resumed, 'path', resumed)} has loop replica(s) {', '.join(map(str, idle))} end at once, while "
                f"replica(s) {', '.join(map(str, went_on))} go on: the budget of these args ends between where the "
                "replicas stood in the checkpoint (their trips are its manifest's loop.positions; replicas gathered "
                "as they arrive are saved at different trips), so the replicas past it cannot end where the others do",
                fix="resume with a budget beyond every replica's saved trip (--set the field of your Args that sets "
                    "its steps or updates), or resume an earlier checkpoint")
        called_at = self.checks.get("called_at", {}).get(fragment)
        loop = self.checks.get("left_loop", {}).get(fragment)
        guard = self.checks.get("guarded_at", {}).get(fragment)
        made = ", ".join(f"replica {k}: {self._calls_made.get((k, fragment), -1) + 1}" for k in sorted(ended + going))
        values = "data of its own environments" + (
            ", or an evaluation of the version it acts with, which differs between replicas that act with the "
            "newest version" if not self.program.ordered and self.checks.get("evaluates") else "")
        return apart(ConfigError(
            f"loop replica(s) {', '.join(map(str, ended))} ended the training loop while replica(s) "
            f"{', '.join(map(str, going))} still called '{fragment}', whose calls gather one from each replica "
            "(or, gathered as they arrive, a piece of several): the replicas left the loop"
            + left_apart(loop, values)
            + f", or call '{fragment}'{f' (at {called_at})' if called_at else ''} under an `if` on such "
            f"data{f' (the `if` at {guard})' if guard else ''} (calls of it taken: {made})",
            where=(left_at(loop) if not guard else loop[0] if loop else None) or called_at,
            fix=self._leaving_fix()))

    def _leaving_fix(self) -> str:
        """How to leave the loop at the same trip in every replica: on a count they share, or, where an
        evaluation env's return decides and the calls are gathered as they arrive (each replica acts
        with the newest version), with the policy at max_lag=0, where every replica acts and evaluates
        with the same version (each steps the evaluation env whole, from the same seed)."""
        policy, options = self.checks.get("policy", ("", {}))
        exact = ""
        if not self.program.ordered and self.checks.get("evaluates") and options.get("max_lag"):
            count = next((f"{k}={options[k]}, " for k in ("actors", "env_workers") if k in options), "")
            exact = (f"where it is an evaluation env's return, run with --policy \"{policy}({count}max_lag=0)\" or "
                     "pipelined: every replica then evaluates the same version and leaves at the same trip; ")
        return (exact + "end the loop on a count every replica shares (updates, the configured total of steps) and "
                "call fragments on a schedule every replica shares, or run with one replica (actors=1, "
                "env_workers=1) or --policy single_process (a learner's metric cannot decide it where the learner "
                "runs apart: the loop does not have its value)")

    def _ended_apart(self) -> None:
        """Every replica ended its loop: each must have made as many calls of each fragment as the
        others (gathered as they arrive, a replica left with calls the others never made is seen
        as it makes them only if the others ended first; else here, whatever the timing)."""
        producers = self.program.producers
        for fragment in dict.fromkeys(f for _, f in self._calls_made):
            made = [self._calls_made.get((k, fragment), -1) for k in range(producers)]
            if len(set(made)) > 1:
                fewest = min(made)
                raise self._left_apart(fragment, [k for k in range(producers) if made[k] == fewest],
                                       [k for k in range(producers) if made[k] > fewest])

    def _calls_apart(self, k: int, fragment: str) -> None:
        """Calls taken one per replica in order: replica ``k``'s next call is ``fragment`` while the
        replicas before it made another call, still waiting for ``k``'s. The replicas call
        different fragments here (one under an ``if`` on data of its own environments), and each
        would wait for the others' call for good (a served actor's reply among them)."""
        for other, pool in self.pools.items():
            if other == fragment or not pool:
                continue
            called_at = self.checks.get("called_at", {})
            guards = self.checks.get("guarded_at", {})
            # the call under an `if` (where the source has one), else a learner, names the line
            cause = next((f for f in (other, fragment) if f in guards), None) or \
                (fragment if fragment == self.program.clock else other)
            have = ", ".join(str(p.replica) for p in pool)
            raise ConfigError(
                f"loop replica {k}'s next call into the {self.program.group}'s process is '{fragment}' (at "
                f"{called_at.get(fragment)}), while replica(s) {have} called '{other}' (at {called_at.get(other)}) "
                "there: this policy takes one call of each replica at a time, in order, and the replicas' calls "
                f"differ, so each would wait for the others' for good: the loop calls '{cause}' "
                f"{self._on_own_data(cause)} on data of each replica's own environments (an episode that ended, a "
                "reward, a batch's mean), which the replicas see differently", where=called_at.get(cause),
                fix="call it on a schedule every replica shares (every N trips, once the buffer holds N steps counted "
                    "in trips), or run with one replica (actors=1, env_workers=1) or --policy single_process")

    def _unbatched(self, fragment: str, leaves: list[Any]) -> tuple[tuple[str, int], ...]:
        """(path, checksum) of each argument leaf of a call without a batch axis: what the learners of
        multi_learner, each given its own loop replicas' call, must hold alike (see GradientAllReduce)."""
        ring = self.ring_specs.get(fragment)
        if ring is None:
            return ()
        out = []
        for j, axis in enumerate(ring.axes):
            if axis is None and j not in ring.counts and j < len(leaves):
                path = ring.paths[j] if j < len(ring.paths) else f"argument leaf {j}"
                arr = np.ascontiguousarray(to_numpy(leaves[j]) if ring.specs[j].backend != "python" else
                                           np.asarray(leaves[j]))
                if arr.dtype.kind in "fc":   # equal as _same_value compares: -0.0 is 0.0, every NaN one NaN
                    arr = np.where(np.isnan(arr), np.nan, arr + 0.0).astype(arr.dtype)
                out.append((path[len(WHOLE_MARK):] if path.startswith(WHOLE_MARK) else path,
                            zlib.crc32(arr.view(np.uint8).reshape(-1).data, zlib.crc32(str(arr.dtype).encode()))
                            & 0xFFFFFF))
        return tuple(out)

    def _differs(self, fragment: str, j: int) -> ConfigError:
        ring = self.ring_specs[fragment]
        path = ring.paths[j] if j < len(ring.paths) else f"argument leaf {j}"
        if path.startswith(WHOLE_MARK):
            path = path[len(WHOLE_MARK):]
            return ConfigError(
                f"{path} of '{fragment}' has as many rows as the run has environments, which fragflow takes for "
                "one row per environment (each process sends its own rows, and the served call joins them), but "
                "the loop's replicas hold different values of it: joined, it would be none of them (a statistic "
                "whose size only equals the number of environments?)", where=self.checks.get("called_at", {}).get(fragment),
                fix="if it has a row per environment, size it with env.num_envs (the environments this process "
                    "steps: each process then holds its own rows, whatever it fills them with); if not, compute it "
                    "from the batch inside a fragment or keep it in versioned state; or run with one acting process "
                    "(actors=1; env_workers=1 under central_inference)")
        # (a served actor, central_inference's, acts once for the replicas' environments merged)
        acts = getattr(self.fragments.get(fragment), "role", None) == "actor"
        return ConfigError(
            f"{path} of '{fragment}' ({ring.specs[j].short()}) differs between the loop's replicas, each "
            "stepping its share of the environments, and has no batch axis to merge them along: "
            + ("one replica's would be acted with, for every replica's environments" if acts else
               "one replica's would be learned and the others' lost"),
            where=self.checks.get("called_at", {}).get(fragment),
            fix="pass per-environment data through an env fragment, ff.RolloutBuffer or "
                "ff.ReplayBuffer (which declare their batch axes), or run with one acting process "
                "(actors=1; env_workers=1 under central_inference)")

    def _apart_in_time(self, fragment: str, j: int, call: int, steps: tuple[tuple[int, int], ...]) -> ConfigError:
        """A value without a batch axis that differs between the replicas' same call of ``fragment``,
        made after different numbers of env steps: the loop calls it on data of each replica's own
        environments, and a value it computes from its own count (a schedule) differs with them."""
        ring = self.ring_specs[fragment]
        path = ring.paths[j] if j < len(ring.paths) else f"argument leaf {j}"
        path = path[len(WHOLE_MARK):] if path.startswith(WHOLE_MARK) else path
        at = ", ".join(f"replica {r} after {n}" for r, n in sorted(steps))
        return ConfigError(
            f"'{fragment}' is called by the loop replicas after different numbers of env steps (its call {call + 1}: "
            f"{at}), so its {path} ({ring.specs[j].short()}) differs between them, and the call gathers their "
            f"pieces into one: the loop calls it {self._on_own_data(fragment)} on data of each replica's own "
            "environments (an episode that ended, a reward), which the replicas see differently",
            where=self.checks.get("called_at", {}).get(fragment), fix=_SHARED_SCHEDULE)

    def _compare_apart(self, fragment: str, pieces: list[_Piece]) -> None:
        """Calls gathered as they arrive: a leaf without a batch axis is compared with another
        replica's at the same call even where the two pieces reach different updates (one piece per
        update, on a loaded machine), so that values that differ are refused whatever the timing."""
        ring = self.ring_specs[fragment]
        plain = [j for j, axis in enumerate(ring.axes) if axis is None and j not in ring.counts]
        if not plain:
            return
        # nothing given with a batch axis: every replica sends the whole call (see _whole_calls_alike)
        whole = self.program.producers > 1 and all(axis is None for j, axis in enumerate(ring.axes)
                                                   if j not in ring.counts)
        seen = self._apart.setdefault(fragment, {})
        for p in pieces:
            first = seen.get(p.call)
            if first is None:
                seen[p.call] = (p.replica, [np.array(to_numpy(p.leaves[j]), copy=True)
                                            if ring.specs[j].backend != "python" else p.leaves[j] for j in plain],
                                p.steps)
                while len(seen) > 64:   # (the oldest calls: replicas are never that far apart)
                    del seen[next(iter(seen))]
                continue
            if first[0] == p.replica:
                continue
            for j, value in zip(plain, first[1]):
                if not _same_value(value, p.leaves[j], ring.specs[j].backend):
                    if first[2] != p.steps:   # the calls come from different moments: that is why
                        raise self._apart_in_time(fragment, j, p.call, ((first[0], first[2]), (p.replica, p.steps)))
                    raise self._differs(fragment, j)
            if whole:
                alike = self._alike.setdefault(fragment, set())
                alike.add(p.call)
                if len(alike) > 64:   # (the oldest calls: replicas are never that far apart)
                    alike.discard(min(alike))
        if whole:
            self._whole_calls_alike(fragment, plain, pieces)

    def _whole_calls_alike(self, fragment: str, plain: list[int], pieces: list[_Piece]) -> None:
        """Calls gathered as they arrive, of a fragment given nothing with a batch axis (a batch the
        loop samples from its own dataset, with no environment in it): each replica sends the whole
        call, and an update takes any of the pieces, two calls of one replica among them, so one
        call's data would be learned and the other's lost. Arrays that change from one call to the
        next are refused once the replicas are seen to send the same values at one of those calls or later
        (values of their own, which differ between them at a call, are refused as such first), at the
        latest at every replica's second call, whatever the timing."""
        ring = self.ring_specs[fragment]
        for p in pieces:
            values = [np.array(to_numpy(p.leaves[j]), copy=True) if ring.specs[j].backend != "python" else p.leaves[j]
                      for j in plain]
            last = self._whole.get((fragment, p.replica))
            self._whole[(fragment, p.replica)] = (p.call, values)
            if last is None or last[0] == p.call or fragment in self._changed:
                continue
            for j, before, now in zip(plain, last[1], values):
                # (a number that changes, a rate or coefficient of the update, is the oldest piece's, as beside
                # batched data: arrays are the call's data)
                if ring.specs[j].shape and not _same_value(before, now, ring.specs[j].backend):
                    self._changed[fragment] = (j, last[0], p.call)
                    break
        changed = self._changed.get(fragment)
        # (a call of the other replicas dropped as stale is never compared: any later one alike will do)
        if changed is not None and any(c >= changed[1] for c in self._alike.get(fragment, ())):
            j, a, b = changed
            path = ring.paths[j] if j < len(ring.paths) else f"argument leaf {j}"
            path = path[len(WHOLE_MARK):] if path.startswith(WHOLE_MARK) else path
            raise ConfigError(
                f"{path} of '{fragment}' ({ring.specs[j].short()}) changes from call to call (calls {a + 1} "
                f"and {b + 1}), and nothing '{fragment}' is given has a batch axis: each of the loop's "
                f"{self.program.producers} replicas sends the whole call, and calls gathered as they arrive "
                "make an update of any of them, two calls of one replica among them, so one call's values "
                "would be learned and the other's lost",
                where=self.checks.get("called_at", {}).get(fragment),
                fix="run with one acting process (actors=1) or max_lag=0, whose calls are taken in order, or "
                    "pass per-environment data through ff.ReplayBuffer or ff.RolloutBuffer (which declare "
                    "their batch axes)")


_E = TypeVar("_E", bound=FragflowError)


def apart(err: _E) -> _E:
    """``err`` marked as what a service sees of loop replicas that left the loop apart: a replica
    whose program raised closes its channels too (its calls are learned from), and the driver then
    reports that replica's own error, which follows at once, rather than this consequence of it."""
    err.replicas_apart = True   # type: ignore[attr-defined]
    return err
