"""PettingZoo parallel environments as one env fragment, with an ``agent`` axis after the ``env`` axis.

``ff.envs.make("mpe2:simple_spread_v3", num_envs=8)`` (the ``multiagent`` extra) gives a
:class:`MultiAgentVectorEnv`; agents of different kinds are padded to one observation and one
action space, with ``action_mask`` saying which actions are each agent's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from fragflow.api.envcheck import a_number
from fragflow.api.envs import VectorEnv
from fragflow.compiler.pytree import to_numpy
from fragflow.errors import ConfigError, UnknownEnvError
from fragflow.source import definition_of, user_callsite

# the types of one number a step's dicts mostly hold (checked without a_number's general test)
_NUMBERS = frozenset({float, int, bool, np.float64, np.float32, np.bool_, np.int64})


def _corner(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of an array of ``shape`` placed at the start of a larger one."""
    return tuple(slice(0, int(n)) for n in shape)


def _padded_observations(spaces: list[Any]) -> gym.spaces.Box | None:
    """One Box every agent's observation fits in (each axis as long as the longest), or None when
    the agents' observations are not boxes of one rank."""
    if not all(isinstance(sp, gym.spaces.Box) for sp in spaces) or len({len(sp.shape) for sp in spaces}) != 1:
        return None
    shape = tuple(int(n) for n in np.max([sp.shape for sp in spaces], axis=0))
    dtype = np.result_type(*[sp.dtype for sp in spaces])
    low, high = np.zeros(shape, dtype), np.zeros(shape, dtype)   # a padded entry is always 0
    for sp in spaces:
        at = _corner(sp.shape)
        low[at], high[at] = np.minimum(low[at], sp.low), np.maximum(high[at], sp.high)
    return gym.spaces.Box(low, high, shape, dtype)


def _padded_actions(spaces: list[Any]) -> tuple[gym.Space, np.ndarray] | None:
    """One action space for every agent and the mask of what each agent's actions may be: for
    ``Discrete`` spaces ``Discrete(largest n)`` and ``mask[agent, a]`` = action ``a`` is the
    agent's; for Boxes of one rank the largest box and ``mask[agent, ...]`` = the entry is the
    agent's (the others are dropped before the env sees the action). None when neither fits."""
    if all(isinstance(sp, gym.spaces.Discrete) and int(sp.start) == 0 for sp in spaces):
        n = max(int(sp.n) for sp in spaces)
        return gym.spaces.Discrete(n), np.arange(n)[None, :] < np.array([int(sp.n) for sp in spaces])[:, None]
    box = _padded_observations(spaces)
    if box is None:
        return None
    mask = np.zeros((len(spaces), *box.shape), bool)
    low, high = np.full(box.shape, -1.0, box.dtype), np.full(box.shape, 1.0, box.dtype)
    for j, sp in enumerate(spaces):
        mask[j][_corner(sp.shape)] = True
    for sp in reversed(spaces):   # a shared entry takes the first agent's bounds
        low[_corner(sp.shape)], high[_corner(sp.shape)] = sp.low, sp.high
    return gym.spaces.Box(low, high, box.shape, box.dtype), mask


class MultiAgentVectorEnv(VectorEnv):
    """A batch of PettingZoo parallel environments stepped as one fragment call.

    ``possible_agents`` fixes the agents' order on the ``agent`` axis. ``step(actions)`` takes
    ``[num_envs, num_agents, ...]`` actions and returns ``(obs, reward, terminated, truncated,
    info)`` with ``[num_envs, num_agents, ...]`` arrays. An agent that has left an episode the others
    go on with gets zero observations and rewards, and is marked terminated; an environment resets
    (same-step autoreset, ``info["final_obs"]`` as for gymnasium envs) when all its agents are done.

    Agents of different kinds are batched by padding, so that one network can act for all of
    them (parameter sharing): observations are zero-padded to the longest (``Box`` spaces of one
    rank), and actions take one space with ``action_mask`` (``[num_agents, ...]``, bool) saying
    which are each agent's: for ``Discrete`` spaces the largest, and an agent given an action
    outside its own is refused (mask the logits: ``logits.masked_fill(~mask, -1e9)``); for ``Box``
    actions the largest box, each agent's action cut to its own shape. Each agent's own spaces are
    in ``agent_observation_spaces`` and ``agent_action_spaces``; for alike agents nothing is padded
    and the mask is all true (``None`` for action spaces other than ``Discrete`` and ``Box``).
    """

    def __init__(self, factory: Callable[..., Any], num_envs: int, seed: int, *, ids: np.ndarray, name: str,
                 label: str, evaluation: bool = False, env_kwargs: dict[str, Any] | None = None,
                 first: Any = None) -> None:   # the interface of VectorEnv, over other envs: no super().__init__
        self._identify(label, num_envs, seed, ids, name)
        kwargs = dict(env_kwargs or {})
        self.envs = [first if (i == 0 and first is not None) else factory(**kwargs) for i in range(self.num_envs)]
        probe = self.envs[0]
        self.agents: list[str] = list(probe.possible_agents)
        spaces = [probe.observation_space(a) for a in self.agents]
        actions = [probe.action_space(a) for a in self.agents]
        self.agent_observation_spaces: dict[str, gym.Space] = dict(zip(self.agents, spaces))
        self.agent_action_spaces: dict[str, gym.Space] = dict(zip(self.agents, actions))
        obs_space = spaces[0] if all(sp == spaces[0] for sp in spaces) else _padded_observations(spaces)
        if not isinstance(obs_space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                                      gym.spaces.MultiBinary)):
            obs_space = None   # a Dict (an observation with its action mask), a Tuple: no one array per agent
        alike = all(sp == actions[0] for sp in actions)
        padded_actions: tuple[gym.Space, np.ndarray | None] | None = _padded_actions(actions)
        if alike and padded_actions is None:   # alike agents of another action space: nothing to pad or mask
            padded_actions = (actions[0], None)
        if obs_space is None or padded_actions is None:
            kinds = ", ".join(f"{a}: {o} / {act}" for a, o, act in zip(self.agents, spaces, actions))
            self.close()
            raise UnknownEnvError(
                f"the agents of {self.env_id} have observation or action spaces that fragflow cannot batch ({kinds})",
                where=user_callsite(),
                fix="fragflow batches array observations (Box of one rank, padded where the agents' differ) and "
                    "Discrete (or Box) actions of one kind; flatten the others (e.g. with SuperSuit's flatten_v0; an "
                    "action mask in a Dict observation: a wrapper that returns obs['observation'], the mask in info) or "
                    "batch each kind of agent in an env of its own")
        self.num_agents = len(self.agents)
        self.single_observation_space = obs_space
        self.single_action_space, self.action_mask = padded_actions
        self._padded = any(sp.shape != obs_space.shape for sp in spaces)
        discrete = self.action_mask is not None and isinstance(self.single_action_space, gym.spaces.Discrete)
        self._action_n = np.array([int(sp.n) for sp in actions]) if discrete and not alike else None
        self._action_cut = None if discrete or alike else [_corner(sp.shape) for sp in actions]
        self._returns = np.zeros((self.num_envs, self.num_agents))
        self._lengths = np.zeros((self.num_envs, self.num_agents), np.int64)
        self._out = np.zeros((self.num_envs, self.num_agents), bool)   # its episode in this one ended, counted
        self._finished: list[tuple[float, int]] = []
        self._fragments(evaluation)

    def _events(self, out: Any) -> tuple[int, list[tuple[float, int]]]:
        return self.num_envs, self.pop_finished()

    @property
    def finished_episodes(self) -> list[tuple[float, int]]:
        """(return, length) of every agent's episode finished and not yet reported."""
        return self._finished

    def pop_finished(self) -> list[tuple[float, int]]:
        done, self._finished = self._finished, []
        return done

    def _obs(self, obs: dict[str, Any], i: int, call: str) -> np.ndarray:
        space: Any = self.single_observation_space
        for a in self.agents:   # (one of another shape was broadcast, or batched as it came: the space says otherwise)
            if a in obs:
                self._check_obs(obs[a], a, i, call)
        if not self._padded:
            return np.stack([np.asarray(obs[a], space.dtype) if a in obs else np.zeros(space.shape, space.dtype)
                             for a in self.agents])
        out = np.zeros((self.num_agents, *space.shape), space.dtype)
        for j, a in enumerate(self.agents):
            if a in obs:
                o = np.asarray(obs[a], space.dtype)
                out[j][_corner(o.shape)] = o
        return out

    def _reset(self) -> np.ndarray:
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._out[:] = False
        seeded, self._seeded = self._seeded, True   # (seeded at the first reset only, as a VectorEnv)
        return np.stack([self._obs(self._reset_one(env, None if seeded else int(self.seed) + int(i)), k, "reset")
                         for k, (env, i) in enumerate(zip(self.envs, self.ids))])

    def _check_obs(self, o: Any, agent: str, i: int, call: str) -> None:
        """Refuse an agent's observation that its own space does not hold: another shape (batched as
        it came where every agent's was so, else a numpy error), or a dtype storing would truncate."""
        space: Any = self.agent_observation_spaces[agent]
        dtype = getattr(o, "dtype", None)
        if not isinstance(dtype, np.dtype):   # (a list, a number, a tensor)
            dtype = np.asarray(o).dtype
        shape, target = np.shape(o), getattr(space, "dtype", None)
        fits = shape == space.shape and (target is None or dtype == target or np.can_cast(dtype, target, "same_kind"))
        if fits and target is not None and dtype != target and dtype.kind in "iu" and target.kind in "iu":
            limits, values = np.iinfo(target), np.asarray(o)   # (300 in an int8 space was stored as 44)
            fits = values.size == 0 or limits.min <= values.min() and values.max() <= limits.max
        if not fits:
            raise ConfigError(f"agent {agent!r} of environment {int(self.ids[i])} was given by the env's {call} an "
                              f"observation of shape {shape} and dtype {dtype}, but its observation space is {space}: "
                              + ("storing it would truncate or wrap its values" if shape == space.shape else
                                 "batching it would change its shape"), where=user_callsite(),
                              fix="return each agent the observations its observation_space(agent) declares (shape "
                                  "and dtype), or declare the space the env returns")

    def _reset_one(self, env: Any, seed: int | None) -> dict[str, Any]:
        """One environment's reset observations; refused where its reset returns them alone (PettingZoo's
        older API: it failed as a KeyError in fragflow's code)."""
        out = env.reset(seed=seed)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict)):
            got = f"{len(out)} values" if isinstance(out, tuple) else f"a {type(out).__name__}"
            raise ConfigError(f"environment {self.env_id}'s reset returned {got}, where a parallel env's reset returns "
                              "(observations, infos), two dicts keyed by agent",
                              where=definition_of(type(env).reset) or user_callsite(),
                              fix="return the observations and an info dict per agent: return obs, {a: {} for a in "
                                  "obs} (PettingZoo's current API)")
        return out[0]

    def _check_step(self, env: Any, live: set[str], out: Any) -> None:
        """Refuse a step that does not return PettingZoo's five dicts (four: its older API), or
        whose rewards or done flags are not a number per agent (None was stored as a NaN reward, a
        string as a flag of its truth)."""
        if not (isinstance(out, tuple) and len(out) == 5):
            got = f"{len(out)} values" if isinstance(out, tuple) else f"a {type(out).__name__}"
            old = " (obs, rewards, dones, infos: PettingZoo's older API)" if isinstance(out, tuple) and \
                len(out) == 4 else ""
            raise ConfigError(f"environment {self.env_id}'s step returned {got}{old}, where a parallel env's step "
                              "returns 5 dicts keyed by agent: observations, rewards, terminations, truncations, infos",
                              where=definition_of(type(env).step) or user_callsite(),
                              fix="return obs, rewards, terminations, truncations, infos: done split into terminated "
                                  "(the episode ended by the task's rules) and truncated (cut off, e.g. at max_cycles)")
        for what, entry, values, kind in (("rewards", "reward", out[1], "a number"),
                                          ("terminations", "terminated flag", out[2], "a bool"),
                                          ("truncations", "truncated flag", out[3], "a bool")):
            if isinstance(values, dict):
                bad = next((a for a, v in values.items()
                            if a in live and type(v) not in _NUMBERS and not a_number(v)), None)
                if bad is None:
                    continue
                got = f"{values[bad]!r:.40} as the {entry} of agent {bad!r}"
            else:
                got = f"{type(values).__name__} {values!r:.40} as its {what}"
            raise ConfigError(f"environment {self.env_id}'s step returned {got}, where a parallel env returns a dict "
                              f"of {kind} per agent", where=definition_of(type(env).step) or user_callsite(),
                              fix="return obs, rewards, terminations, truncations, infos: dicts keyed by agent, a "
                                  "float reward and bool flags for each agent that acted")

    def _step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        a = to_numpy(actions)
        if self.single_action_space.dtype is not None and a.dtype != self.single_action_space.dtype:
            a = self._cast(a, self.single_action_space.dtype, "actions")   # (0.9 for a Discrete space stepped 0)
        n, k = self.num_envs, self.num_agents
        if a.shape[:2] != (n, k) or (self._action_n is not None and ((a >= self._action_n).any() or (a < 0).any())):
            self._refuse(a)
        obs, final = [], []
        reward = np.zeros((n, k), np.float32)
        raw = np.zeros((n, k), np.float64)   # episode returns add the env's rewards as given, not rounded
        terminated = np.zeros((n, k), bool)
        truncated = np.zeros((n, k), bool)
        cut = self._action_cut
        for i, env in enumerate(self.envs):
            live = set(env.agents)
            kept = [agent for j, agent in enumerate(self.agents) if agent in live and self._out[i, j]]
            if kept:
                raise ConfigError(f"agent {kept[0]!r} of environment {int(self.ids[i])} of {self.env_id} ended its "
                                  "episode (terminated or truncated) at an earlier step but is still among the "
                                  "env's agents: each step would count another episode of it, and the environment, "
                                  "whose episode ends when no agent is left, would never reset",
                                  where=definition_of(type(env).step) or user_callsite(),
                                  fix="remove an agent from self.agents at the step that ends its episode, as "
                                      "PettingZoo's parallel API has it (self.agents = [a for a in self.agents if "
                                      "not (terminations[a] or truncations[a])])")
            stepped = env.step({agent: a[i, j] if cut is None else a[i, j][cut[j]]
                                        for j, agent in enumerate(self.agents) if agent in live})
            self._check_step(env, live, stepped)
            o, r, te, tr, _ = stepped
            for j, agent in enumerate(self.agents):
                if agent in live:
                    value = r.get(agent, 0.0)
                    # (an array of one number, checked by _check_step: numpy 2 stores none as an element)
                    raw[i, j] = reward[i, j] = value if type(value) in _NUMBERS else np.asarray(value).item()
                    terminated[i, j], truncated[i, j] = bool(te.get(agent, False)), bool(tr.get(agent, False))
                else:
                    terminated[i, j] = True       # it left the episode earlier
            step_obs = self._obs(o, i, "step")
            self._returns[i] += raw[i]
            self._lengths[i] += np.array([agent in live for agent in self.agents])
            # an agent's episode ends at its own last step (the others may go on for long after), or
            # with the environment's (every agent gone, some perhaps without a last step of their own)
            ended = [j for j, agent in enumerate(self.agents) if agent in live and (terminated[i, j] or truncated[i, j])]
            if not env.agents:
                ended += [j for j in range(k) if j not in ended and self._lengths[i, j] > 0 and not self._out[i, j]]
            for j in ended:   # (an agent of possible_agents not in this episode played none: no episode)
                self._finished.append((float(self._returns[i, j]), int(self._lengths[i, j])))
                self._out[i, j] = True
            if not env.agents:                    # every agent is done: the episode ends here
                self._returns[i], self._lengths[i], self._out[i] = 0.0, 0, False
                final.append(step_obs)
                step_obs = self._obs(self._reset_one(env, None), i, "reset")
            else:
                final.append(step_obs)
            obs.append(step_obs)
        return np.stack(obs), reward, terminated, truncated, {"final_obs": np.stack(final)}

    def _refuse(self, a: np.ndarray) -> None:
        n, k = self.num_envs, self.num_agents
        if a.shape[:2] != (n, k):
            raise ConfigError(f"{self.name}.step got actions of shape {list(a.shape)}, and {self.env_id} takes one per "
                              f"agent of each environment this process steps: [num_envs={n}, num_agents={k}"
                              f"{', ...' if a.ndim > 2 or self.single_action_space.shape else ''}]",
                              where=user_callsite(), fix="give actions with an env axis and an agent axis (an actor "
                              "acting on observations of shape [num_envs, num_agents, ...] keeps both)")
        assert self._action_n is not None
        i, j = (int(x[0]) for x in np.nonzero((a >= self._action_n) | (a < 0)))
        raise ConfigError(f"agent {self.agents[j]!r} of environment {int(self.ids[i])} was given action {int(a[i, j])}, "
                          f"outside its Discrete({int(self._action_n[j])}) (its kind of agent has fewer actions than "
                          f"the padded Discrete({int(self.single_action_space.n)}))",  # type: ignore[attr-defined]
                          where=user_callsite(), fix="sample from logits masked with env.action_mask, e.g. "
                          "logits.masked_fill(~torch.as_tensor(env.action_mask), -1e9)")

    def render(self) -> tuple[Any, ...]:
        return tuple(env.render() for env in self.envs)

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def __repr__(self) -> str:
        return f"<MultiAgentVectorEnv {self.name}: {self.env_id} x{self.num_envs}, {self.num_agents} agents>"
