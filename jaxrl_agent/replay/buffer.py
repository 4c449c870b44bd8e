"""The replay buffer: validated trajectories waiting for the learner.

`insert` validates each record (`trajectory.validate`) and counts rejections by reason, so bad input
is a recorded, countable event, never a crash and never silent. `take(n)` hands out the oldest
records first. `state_dict()` / `load_state_dict()` make it checkpointable (plain JSON-able data).
Batches are read through `grain` (`as_grain_dataset`), so the learner's input pipeline is the same
kind of object as the task pipeline.
"""

from __future__ import annotations

import collections
from typing import Iterable

import grain

from jaxrl_agent.replay.trajectory import Trajectory, validate


class ReplayBuffer:
    def __init__(self, *, vocab_size: int, max_length: int, capacity: int = 100_000):
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.capacity = capacity
        self._items: collections.deque[Trajectory] = collections.deque()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.inserted = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def insert(self, trajectories: Iterable[Trajectory], *, current_version: int | None = None) -> int:
        """Adds the valid records; returns how many were accepted."""
        accepted = 0
        for t in trajectories:
            try:
                reason = validate(t, vocab_size=self.vocab_size, max_length=self.max_length,
                                  current_version=current_version)
            except Exception as err:  # noqa: BLE001 - a malformed record is rejected, not fatal
                reason = f"invalid_record:{type(err).__name__}"
            if reason is not None:
                self.rejected[reason] += 1
                continue
            if len(self._items) >= self.capacity:
                self._items.popleft()
                self.evicted += 1
            self._items.append(t)
            accepted += 1
        self.inserted += accepted
        return accepted

    def take(self, n: int | None = None) -> list[Trajectory]:
        """Removes and returns the oldest n records (all if None)."""
        n = len(self._items) if n is None else min(n, len(self._items))
        return [self._items.popleft() for _ in range(n)]

    def as_grain_dataset(self, n: int | None = None) -> grain.MapDataset:
        """The next n records (removed from the buffer) as a grain MapDataset."""
        return grain.MapDataset.source(self.take(n))

    def state_dict(self) -> dict:
        return {"items": [t.to_dict() for t in self._items], "rejected": dict(self.rejected),
                "inserted": self.inserted, "evicted": self.evicted}

    def load_state_dict(self, state: dict) -> None:
        self._items = collections.deque(Trajectory.from_dict(d) for d in state["items"])
        self.rejected = collections.Counter(state["rejected"])
        self.inserted = int(state["inserted"])
        self.evicted = int(state["evicted"])
