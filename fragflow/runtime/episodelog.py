"""A run's episodes, kept compactly: the driver holds every one (the returns plot, the result's
``episodes``), millions in a long run of short episodes."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any


class EpisodeLog:
    """Episodes as ``(env steps at its end, return, length)``, in three typed arrays: ~25 bytes an
    episode (tracemalloc), where a list of tuples took ~130. Appended, counted, iterated and indexed
    (a slice gives a list) as that list was."""

    __slots__ = ("steps", "returns", "lengths")

    def __init__(self, episodes: Iterable[tuple[int, float, int]] = ()) -> None:
        self.steps = array("q")
        self.returns = array("d")
        self.lengths = array("q")
        self.extend(episodes)

    def append(self, episode: tuple[int, float, int]) -> None:
        steps, ret, length = episode
        self.steps.append(int(steps))
        self.returns.append(float(ret))
        self.lengths.append(int(length))

    def extend(self, episodes: Iterable[tuple[int, float, int]]) -> None:
        for episode in episodes:
            self.append(episode)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[tuple[int, float, int]]:
        return zip(self.steps, self.returns, self.lengths)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return list(zip(self.steps[index], self.returns[index], self.lengths[index]))
        return self.steps[index], self.returns[index], self.lengths[index]

    def __repr__(self) -> str:
        return f"EpisodeLog({len(self)} episodes)"
