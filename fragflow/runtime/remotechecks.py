"""What a loop replica refuses as it sends a call to a fragment served in another process, after the
trace: module data the loop changed since the fragment was sent, the evaluation env's observations
through requests sized for the training envs', versioned state made after the trace, a learner
other than the clock writing the acted-with state phase-long."""

from __future__ import annotations

from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler.pytree import fits, leaf_paths, spec_of
from fragflow.compiler.reach import Reached
from fragflow.errors import PlacementError
from fragflow.lowering.disciplines import Exact
from fragflow.runtime import calls
from fragflow.source import user_callsite


class RemoteChecks:
    """The loop interpreter's checks of its calls served elsewhere (the attributes below are the interpreter's)."""

    program: Any
    _calls_of: dict[str, int]
    _eval_obs: tuple[int, Any] | None
    _every: int
    _unclocked: dict[str, list[Any]]
    checks: dict[str, Any]
    index: int
    update: int

    def _check_reached(self, frag: Fragment, name: str, reached: Reached) -> None:
        """Refuse a call of a fragment served in another process whose module data (a global dict's
        key, a closure's number) the loop changed since the fragment was sent there, after the trace
        (one changed while traced is refused at placement): its copy would never see the change."""
        changed = reached.changed(calls.is_checked(self._calls_of.get(name, -1) + 2, self._every))
        if changed:
            raise PlacementError(
                f"{frag.role} fragment '{name}' ({frag.defined_at}) reads the {changed}, which the training loop "
                f"(or a fragment run in its process, an actor) changed after the trace, but this policy runs '{name}' in another process, with a copy of it as "
                "it was at the fragment's first call: the change would never reach it", where=user_callsite(),
                fix=f"pass the value to '{name}' as an argument at the call ({name}(..., epsilon)), or keep it in "
                    "versioned state a learner writes (a network the loop syncs, a target network: "
                    "ff.versioned({'net': net}, name='target'), passed to the fragment and synced by a learner "
                    "fragment that writes it); or run with --policy single_process")

    def _eval_misfit(self, leaves: list[Any], specs: tuple[Any, ...], obs: Any = None,
                     whose: str = "the evaluation env's") -> str:
        """Why the evaluation env's observations (``obs``: another env's, ``whose``), given to an actor
        served for the training envs, cannot go through its requests ("": they can, as a second
        training env's of the same size would): several workers would each send them whole, or their
        slot is sized for another array (another number of environments, another dtype)."""
        if self.program.replicas > 1:
            return (f"for {self.program.replicas} env workers at once, each sending its slice of the training "
                    "envs, where every worker steps the evaluation env whole")
        if obs is None:
            assert self._eval_obs is not None
            obs = self._eval_obs[1]
        mine = {id(x) for _, x in leaf_paths(obs)}
        for x, spec in zip(leaves, specs):
            got = spec_of(x)
            if id(x) in mine and not fits(got, spec):
                return (f"through channels sized for the training envs' calls ({spec.short()}), and {whose} "
                        f"observations are {got.short()}")
        return ""

    def _refuse_untraced_state(self, name: str, route: Any, arguments: dict[str, Any]) -> None:
        """Versioned state made after the trace (ff.versioned(...) run again in the loop) given to a
        fragment of another process, which holds only the states the trace saw: it would wait for it."""
        for value in arguments.values():
            held = value if isinstance(value, Versioned) else value.handle if isinstance(value, VersionedView) else None
            if held is not None and self.program.service_for(route.group, self.index) not in self.program.ship.get(
                    held.name, ()):
                raise PlacementError(
                    f"ff.versioned(...) made new state in the loop after tracing, and '{name}' was given it, but "
                    f"this policy runs '{name}' in another process, which holds the states the trace saw: the new "
                    "state would never reach it", where=held.created_at or user_callsite(),
                    fix="make versioned state once, before the loop, and let the learner return its next value (to "
                        "start it afresh, return the fresh value from the learner), or run with --policy single_process")

    def _unclocked_write(self, name: str, state: str) -> None:
        """Learner ``name``, not the clock, writes ``state``, which this loop's actors act with. Versions
        count the clock's calls: a write between two of them belongs to the next version, which an
        actor acting versions behind takes an update later (SAC's policy step after its Q step). Where
        such writes follow one another with acting between them and no clock call (a phase of the
        loop that calls another learner: `if u < pretrain_updates: pretrain(...) else: learn(...)`),
        no new version comes: the actors would act with the state as the clock last left it for the
        whole phase, whatever ``max_lag`` says. Refused then, as the placement refuses such a phase in
        a loop of its own; ``max_lag=0`` waits for every write, and so does ``pipelined``'s exact
        choice before the clock's first call (its version then takes every write issued)."""
        last = self._unclocked.get(state)
        waits_for_all = self.program.max_lag == 0 or (isinstance(self.program.choice, Exact) and self.update == 0)
        if last is not None and last[1] and not waits_for_all:
            clock = self.checks.get("clock")
            again = "its previous call" if last[0] == name else f"the previous call of '{last[0]}'"
            raise PlacementError(
                f"learner '{name}' writes '{state}', which the actors act with, where learner '{clock}' (whose calls "
                f"count the run's versions) was not called since {again}, and the actors acted in between: the loop "
                f"calls another learner in place of '{clock}' (a phase of training of its own), which makes no new "
                f"version, so with max_lag={self.program.max_lag} the actors would act there with '{state}' as "
                f"'{clock}' last left it, not with what '{name}' learns", where=user_callsite(),
                fix="give that phase a versioned value of its own (pre = ff.versioned(..., name='pre'), which its "
                    "learner writes) and hand it to the acted-with state by a learner called once between the phases "
                    "(state = adopt(state, pre)), or call one learner fragment in both phases (the phase an argument); "
                    "or run with max_lag=0, with central_inference (which acts beside the learner with its newest "
                    "state) or with --policy single_process")
        self._unclocked[state] = [name, False]
