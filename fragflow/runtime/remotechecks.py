"""What a loop replica refuses as it sends a call to a fragment served in another process, after the
trace: module data the loop changed since the fragment was sent, the evaluation env's observations
through requests sized for the training envs', versioned state made after the trace."""

from __future__ import annotations

from typing import Any

from fragflow.api.fragment import Fragment
from fragflow.api.versioned import Versioned, VersionedView
from fragflow.compiler.pytree import fits, leaf_paths, spec_of
from fragflow.compiler.reach import Reached
from fragflow.errors import PlacementError
from fragflow.runtime import calls
from fragflow.source import user_callsite


class RemoteChecks:
    """The loop interpreter's checks of its calls served elsewhere (the attributes below are the interpreter's)."""

    program: Any
    _calls_of: dict[str, int]
    _eval_obs: tuple[int, Any] | None
    _every: int
    index: int

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

    def _eval_misfit(self, leaves: list[Any], specs: tuple[Any, ...]) -> str:
        """Why the evaluation env's observations, given to an actor served for the training envs,
        cannot go through its requests ("": they can, as a second training env's of the same size
        would): several workers would each send them whole, or their slot is sized for another array
        (another number of environments, another dtype)."""
        if self.program.replicas > 1:
            return (f"for {self.program.replicas} env workers at once, each sending its slice of the training "
                    "envs, where every worker steps the evaluation env whole")
        assert self._eval_obs is not None
        mine = {id(x) for _, x in leaf_paths(self._eval_obs[1])}
        for x, spec in zip(leaves, specs):
            got = spec_of(x)
            if id(x) in mine and not fits(got, spec):
                return (f"through channels sized for the training envs' calls ({spec.short()}), and the evaluation "
                        f"env's observations are {got.short()}")
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
