"""The acting side of a distributed policy: the user's loop, run as the actor program.

Each actor process runs the training loop over its slice of the environments. Fragment calls run
locally, except two: a read of versioned state returns the broadcast version the policy allows,
and the learner call becomes a put on this actor's trajectory channel, returning the state handle
and :class:`~fragflow.versioned.Pending` placeholders for the learner's other outputs.
"""

from __future__ import annotations

import time
from typing import Any

import cloudpickle
import numpy as np

from fragflow.context import InstanceNames
from fragflow.envs import VectorEnv
from fragflow.errors import ConfigError
from fragflow.fragment import Fragment
from fragflow.pytree import flatten, unflatten
from fragflow.runtime.channels import ParamChannel, TrajectoryChannel
from fragflow.runtime.control import Control
from fragflow.runtime.monitor import flat_scalars
from fragflow.runtime.plan import RunPlan
from fragflow.source import SourceLoc, user_callsite
from fragflow.versioned import Pending, Versioned, VersionedView

REPORT_EVERY = 0.2   # seconds between progress reports to the driver


class ActorInterpreter:
    def __init__(self, plan: RunPlan, index: int, traj: TrajectoryChannel, all_trajs: list[TrajectoryChannel],
                 params: ParamChannel | None, control: Control, results: Any, init: Any) -> None:
        self.plan, self.index = plan, index
        self.traj, self.all_trajs, self.params = traj, all_trajs, params
        self.control, self.results, self.init = control, results, init
        self.instance_name = InstanceNames()
        self._state_names = InstanceNames()
        self.resources: list[Any] = []
        self.update = 0
        self.rollout_version: int | None = None
        self.current = "(loop)"
        self._treedefs: list[Any] = []
        self._trees: tuple[int, list[Any]] | None = None
        self._handle: Versioned | None = None
        self._sent_treedef = False
        self._steps = 0
        self._episodes: list[tuple[float, int]] = []
        self._next_report = time.monotonic() + REPORT_EVERY

    # -- interpreter protocol ------------------------------------------------------------
    def env_ids(self, num_envs: int) -> np.ndarray:
        n = self.plan.actors
        if num_envs % n:
            raise ConfigError(f"cannot split {num_envs} environments across {n} actors", where=user_callsite(),
                              fix=f"use a number of environments divisible by {n}, or another actors=")
        per = num_envs // n
        return np.arange(self.index * per, (self.index + 1) * per)

    def adopt(self, resource: Any) -> None:
        self.resources.append(resource)

    def versioned(self, value: Any, name: str, where: SourceLoc | None) -> Versioned:
        for path in self.plan.read_paths:
            sub = value
            for k in path:
                sub = sub[k]
            self._treedefs.append(flatten(sub)[1])
        if self.index == 0:
            self.init.put(("state", cloudpickle.dumps(value)))
        self._handle = Versioned(self._state_names(name), 0, None, where)
        return self._handle

    def call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.current = frag.name
        if frag.role == "logger":
            return self._log(args[0] if args else kwargs)
        if frag.writes is not None:
            return self._learner_call(frag, args, kwargs)
        if any(isinstance(a, (Versioned, VersionedView)) for a in args):
            args = tuple(self._resolve(a) for a in args)
        if kwargs and any(isinstance(v, (Versioned, VersionedView)) for v in kwargs.values()):
            kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
        out = frag.fn(*args, **kwargs)
        env = frag.instance
        if isinstance(env, VectorEnv) and frag is env.step:
            self._steps += env.num_envs
            if env.finished_episodes:
                self._episodes.extend(env.pop_finished())
            if time.monotonic() >= self._next_report:
                self.report()
        return out

    # -- versioned state -------------------------------------------------------------------
    def _version(self) -> int:
        """The parameter version of the current rollout, chosen at its first state read."""
        if self.rollout_version is None:
            plan, i = self.plan, self.update
            assert self.params is not None
            if plan.trajectory == "balanced":
                v = self.control.admit(self.all_trajs, self.params, plan.actors, plan.max_lag)
            elif plan.parameters == "exact":
                v = max(0, i - plan.max_lag)
                self.params.wait_for(v)
            else:
                v = self.params.wait_for(max(0, i - plan.max_lag))
            self.rollout_version = v
        return self.rollout_version

    def _resolve(self, x: Any) -> Any:
        if not isinstance(x, (Versioned, VersionedView)):
            return x
        assert self.params is not None
        v = self._version()
        if self._trees is None or self._trees[0] != v:
            _, leaves = self.params.read(v)
            trees, pos = [], 0
            for td, n in zip(self._treedefs, self.plan.param_counts):
                trees.append(unflatten(td, leaves[pos:pos + n]))
                pos += n
            self._trees = (v, trees)
        path = () if isinstance(x, Versioned) else x.path
        for root, tree in zip(self.plan.read_paths, self._trees[1]):
            if path[:len(root)] == root:
                for k in path[len(root):]:
                    tree = tree[k]
                return tree
        raise ConfigError(f"the acting side read state{''.join(f'[{k!r}]' for k in path)}, which was not traced",
                          where=user_callsite(), fix="read the same state views on every call")

    # -- the learner boundary ----------------------------------------------------------------
    def _learner_call(self, frag: Fragment, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = frag.signature.bind(*args, **kwargs)
        payload = {k: v for k, v in bound.arguments.items() if k != frag.writes}
        leaves, treedef = flatten(payload)
        if not self._sent_treedef and self.index == 0:
            self.init.put(("treedef", cloudpickle.dumps(treedef)))
        self._sent_treedef = True
        version = self._version() if self.params is not None else self.update
        self.traj.put(leaves, version)
        if self.plan.trajectory == "balanced":
            self.control.produced()
        self.update += 1
        self.rollout_version = None
        self.report()
        handle = bound.arguments[self.plan.writes]
        rest = [Pending(frag.name, i) for i in range(1, max(self.plan.arity, 1))]
        return (handle, *rest)

    def _log(self, tree: Any) -> None:
        if self.index != 0:
            return None
        scalars = flat_scalars(_without_pending(tree))
        if scalars:
            self.results.put(("actor_log", scalars))
        return None

    def report(self) -> None:
        if self._steps or self._episodes:
            self.results.put(("steps", self.index, self._steps, self._episodes))
            self._steps, self._episodes = 0, []
        self._next_report = time.monotonic() + REPORT_EVERY

    def close(self) -> None:
        for r in self.resources:
            r.close()


def _without_pending(tree: Any) -> Any:
    """The tree minus the learner outputs this actor never saw (they are logged by the learner)."""
    if isinstance(tree, Pending):
        return None
    if isinstance(tree, dict):
        return {k: _without_pending(v) for k, v in tree.items() if not isinstance(v, Pending)}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_without_pending(v) for v in tree)
    return tree
