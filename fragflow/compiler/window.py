"""The trace window: which calls of a traced loop the graph's rates come from, and when tracing
may stop.

An *update* is a call of the primary learner (the first learner fragment called); rates are calls
per update. The window is cut at a *phase point*, the same place in every trip of the training
loop: the first step of a training env after the primary learner ran (with no env, the first actor
call; with neither, or with none for ``max_total`` updates, the end of each primary learner call). Window 0 runs to the first phase point,
window 1 from there on, so window 1 holds whole trips, including what follows the learner in a trip
(a second learner call, a minibatch loop of them, a log, an evaluation), and its counts divided by
its updates are per-update rates.

>>> w, stops = TraceWindow(max_updates=2), []
>>> for trip in range(4):
...     stops.append(w.call("env.step", "env", False))
...     if stops[-1]:
...         break
...     for _ in range(2):                                   # the learner twice per trip
...         _ = w.call("learn", "learner", False), w.learned("learn", primary=True)
>>> stops, w.updates, w.window_updates
([False, False, True], 4, [2, 2])
"""

from __future__ import annotations

from collections import Counter


class TraceWindow:
    def __init__(self, max_updates: int = 2, max_total: int = 200) -> None:
        self.max_updates = max_updates
        self.max_total = max_total            # updates to trace at most while fragments are still unseen
        self.updates = 0
        self.window_updates = [0, 0]          # primary learner calls in each window
        self._phase_role: str | None = None   # what a phase point is a call of (None: the learner's end)
        self._after_update = False            # the primary learner ran since the last phase point
        self._roles: set[str] = set()         # roles called before the first update (env: not evaluation)
        self._tail: Counter[str] = Counter()  # calls from the trip's first update to its phase point
        self._tails: list[Counter[str]] = []    # one per phase point passed
        self.unseen = False                   # fragments the loop must still call before tracing stops
        self._since_phase = 0                 # updates since the last phase point

    @property
    def window(self) -> int:
        """0 until the first phase point, 1 from there on."""
        return 1 if self._tails else 0

    def call(self, name: str, role: str, evaluation: bool) -> bool:
        """A fragment is about to be called: True where tracing stops before it (a phase point once
        enough has been traced)."""
        stop = False
        if role in ("env", "actor") and not evaluation:
            if self.updates == 0:
                self._roles.add(role)
            elif self._after_update and role == self._phase_role:
                stop = self._phase()
        if not stop and self._after_update:
            self._tail[name] += 1
        return stop

    def learned(self, name: str, primary: bool) -> bool:
        """A learner call returned (``primary``: an update); True where tracing stops after it."""
        if not primary:
            return False
        if self.updates == 0:
            self._phase_role = next((r for r in ("env", "actor") if r in self._roles), None)
        self.updates += 1
        self.window_updates[self.window] += 1
        if not self._after_update:
            self._tail[name] += 1
            self._after_update = True
            self._since_phase = 0
        self._since_phase += 1
        if self._phase_role is not None and self._since_phase >= self.max_total:
            # no env step (actor call) after this many updates: a loop that learns without stepping from
            # here on (an offline phase after collecting a dataset, an env made for its spaces and reset
            # only): each learner call's end is the phase point, as with no env at all
            self._phase_role = None
        return self._phase() if self._phase_role is None else False

    def _phase(self) -> bool:
        self._after_update = False
        self._tails.append(self._tail)
        self._tail = Counter()
        if len(self._tails) == 1:   # the steady window opens
            return False
        # two trips where the last two differ in what they call (an actor step every other update)
        return (self.updates >= self.max_updates and (not self.unseen or self.updates >= self.max_total)
                and (len(self._tails) >= 3 or self._tails[-1] == self._tails[-2]))
