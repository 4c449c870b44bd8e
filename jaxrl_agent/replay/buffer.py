"""The replay buffer: every group from its submission until the learner takes it.

A group is a task and its G episode slots. Each slot is empty (its episode is running, or not yet
started), holds a finished episode's `Trajectory`, or holds a suspended episode's `PartialRollout`
(partial rollouts: an episode that spent its token budget for this iteration, kept with its tokens,
log-probs and per-token policy versions until a later iteration continues it). Groups stay here
across iterations — the asynchronous schedules' leftovers, windowed FIFO's wait for the oldest —
and `state_dict()` is all of it, so a resume continues each partial episode from its saved tokens
and keeps each finished one: none is lost, none is sampled twice.

Capacity is in tokens (`capacity_tokens`; 0 = unbounded): the tokens of the finished and suspended
episodes held. Before an insert that would take the buffer over it, whole groups are evicted,
oldest first (submission order) — a group's advantages need all its episodes — until it fits (an
episode whose own group is the oldest goes with it); the caller stops
the evicted groups' running episodes. Evictions are counted (`evicted_groups`, `evicted_tokens`),
so memory stays bounded whatever the episode lengths, and what was lost to it is on the record.

`admit(trajectories, ...)` is the learner's gate: it validates each post-processed record
(`trajectory.validate`) and counts rejections by reason, so bad input is a recorded, countable
event, never a crash and never silent. The learner reads the admitted trajectories as a `grain`
dataset of packed minibatches (`replay.minibatch_dataset`), the same kind of object as the task
pipeline.

The buffer is not thread-safe: `rollout.RolloutRunner`, its only writer, holds its lock around
every call. Each process has its own buffer (its own groups), saved in its own part of the run state.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Sequence

from jaxrl_agent.envs import api as env_api
from jaxrl_agent.replay.trajectory import PartialRollout, Trajectory, validate


@dataclasses.dataclass
class Group:
    """One task's episode slots: `done[i]` finished, `partial[i]` suspended, neither = running."""

    index: int
    task: env_api.Task
    size: int
    done: dict[int, Trajectory] = dataclasses.field(default_factory=dict)
    partial: dict[int, PartialRollout] = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.done) == self.size

    @property
    def tokens(self) -> int:
        return sum(t.length for t in self.done.values()) + sum(p.length for p in self.partial.values())

    def trajectories(self) -> list[Trajectory]:
        return [self.done[i] for i in range(self.size)]


class ReplayBuffer:
    def __init__(self, *, capacity_tokens: int = 0):
        if capacity_tokens < 0:
            raise ValueError(f"replay.capacity_tokens={capacity_tokens}: expected >= 0 (0 = unbounded)")
        self.capacity_tokens = capacity_tokens
        self._groups: dict[int, Group] = {}
        self.next_index = 0  # groups opened so far: the next group's index
        self.tokens = 0  # held now (finished + suspended episodes)
        self.peak_tokens = 0
        self.evicted_groups = 0
        self.evicted_tokens = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.admitted = 0

    # ------------------------------------------------------------------ groups
    def open(self, task: env_api.Task, size: int) -> int:
        """A new group of `size` empty slots; returns its index (submission order)."""
        if size < 1:
            raise ValueError(f"group size {size} must be >= 1")
        index = self.next_index
        self.next_index += 1
        self._groups[index] = Group(index, task, size)
        return index

    def __contains__(self, index: int) -> bool:
        return index in self._groups

    def group(self, index: int) -> Group:
        return self._groups[index]

    def suspend(self, index: int, sample: int, partial: PartialRollout) -> list[int]:
        """Slot `sample` of group `index` now holds a suspended episode (replacing its earlier
        snapshot). Returns the groups evicted to make room (this one among them if it was the oldest)."""
        group = self._slot(index, sample)
        old = group.partial.pop(sample, None)
        self.tokens -= old.length if old is not None else 0
        return self._insert(group, partial.length, lambda: group.partial.__setitem__(sample, partial))

    def finish(self, index: int, sample: int, trajectory: Trajectory) -> list[int]:
        """Slot `sample` of group `index` holds its finished episode (its snapshot, if any, is
        dropped). Returns the groups evicted to make room (this one among them if it was the oldest)."""
        group = self._slot(index, sample)
        if sample in group.done:
            raise ValueError(f"episode {sample} of group {index} finished twice")
        old = group.partial.pop(sample, None)
        self.tokens -= old.length if old is not None else 0
        return self._insert(group, trajectory.length, lambda: group.done.__setitem__(sample, trajectory))

    def _slot(self, index: int, sample: int) -> Group:
        if index not in self._groups:
            raise KeyError(f"group {index} is not in the replay buffer (taken or evicted)")
        group = self._groups[index]
        if not 0 <= sample < group.size:
            raise ValueError(f"episode {sample} of group {index}: expected 0 <= sample < {group.size}")
        return group

    def _insert(self, group: Group, tokens: int, store) -> list[int]:
        """Evicts the oldest groups until `tokens` more fit, then stores them (unless their own
        group was evicted), so the tokens held never exceed the capacity."""
        evicted = []
        while self.capacity_tokens and self.tokens + tokens > self.capacity_tokens and self._groups:
            oldest = self._groups.pop(min(self._groups))
            held = oldest.tokens
            self.tokens -= held
            self.evicted_groups += 1
            self.evicted_tokens += held
            evicted.append(oldest.index)
            if oldest is group:
                self.evicted_tokens += tokens  # the incoming episode goes with its group
                return evicted
        store()
        self.tokens += tokens
        self.peak_tokens = max(self.peak_tokens, self.tokens)
        return evicted

    def finished_indices(self) -> list[int]:
        return sorted(i for i, g in self._groups.items() if g.finished)

    def unfinished_indices(self) -> list[int]:
        return sorted(i for i, g in self._groups.items() if not g.finished)

    def partial_episodes(self) -> int:
        return sum(len(g.partial) for g in self._groups.values())

    def __len__(self) -> int:
        return len(self._groups)

    def take(self, indices: Sequence[int]) -> list[list[Trajectory]]:
        """Removes finished groups; returns each one's trajectories in slot order."""
        groups = [self._groups[i] for i in indices]
        unfinished = [g.index for g in groups if not g.finished]
        if unfinished:
            raise ValueError(f"groups {unfinished} are not finished: only finished groups can be taken")
        for g in groups:
            del self._groups[g.index]
            self.tokens -= g.tokens
        return [g.trajectories() for g in groups]

    # ------------------------------------------------------------------ the learner's gate
    def admit(self, trajectories: Iterable[Trajectory], *, vocab_size: int, max_length: int,
              current_version: int | None = None) -> list[Trajectory]:
        """The records that may be trained on; the others are counted in `rejected` by reason."""
        admitted = []
        for t in trajectories:
            try:
                reason = validate(t, vocab_size=vocab_size, max_length=max_length, current_version=current_version)
            except Exception as err:  # noqa: BLE001 - a malformed record is rejected, not fatal
                reason = f"invalid_record:{type(err).__name__}"
            if reason is None:
                admitted.append(t)
            else:
                self.rejected[reason] += 1
        self.admitted += len(admitted)
        return admitted

    def stats(self) -> dict:
        """The buffer's numbers for an iteration record."""
        return {"replay/groups": len(self._groups), "replay/tokens": self.tokens,
                "replay/peak_tokens": self.peak_tokens, "replay/partial_episodes": self.partial_episodes(),
                "replay/evicted_groups": self.evicted_groups, "replay/evicted_tokens": self.evicted_tokens,
                "replay_rejected": dict(self.rejected)}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"next_index": self.next_index, "peak_tokens": self.peak_tokens,
                "evicted_groups": self.evicted_groups, "evicted_tokens": self.evicted_tokens,
                "rejected": dict(self.rejected), "admitted": self.admitted,
                "groups": [{"index": g.index, "task": g.task.to_dict(), "size": g.size,
                            "done": {str(i): t.to_dict() for i, t in sorted(g.done.items())},
                            "partial": {str(i): p.to_dict() for i, p in sorted(g.partial.items())}}
                           for g in sorted(self._groups.values(), key=lambda g: g.index)]}

    def load_state_dict(self, state: dict) -> None:
        self._groups = {}
        for entry in state.get("groups", ()):
            group = Group(int(entry["index"]), env_api.Task.from_dict(entry["task"]), int(entry["size"]),
                          done={int(i): Trajectory.from_dict(d) for i, d in entry["done"].items()},
                          partial={int(i): PartialRollout.from_dict(d) for i, d in entry["partial"].items()})
            self._groups[group.index] = group
        self.next_index = max([int(state.get("next_index", 0)), *(i + 1 for i in self._groups)])
        self.tokens = sum(g.tokens for g in self._groups.values())
        self.peak_tokens = max(int(state.get("peak_tokens", 0)), self.tokens)
        self.evicted_groups = int(state.get("evicted_groups", 0))
        self.evicted_tokens = int(state.get("evicted_tokens", 0))
        self.rejected = collections.Counter(state.get("rejected", {}))
        self.admitted = int(state.get("admitted", state.get("inserted", 0)))

    def load_pending_groups(self, pending: dict) -> None:
        """Adds groups saved by checkpoints that kept them with the task source (`source.pending`:
        finished groups with their trajectories; unfinished ones as tasks, restarted from the task)."""
        for entry in pending.get("groups", ()):
            index = int(entry["index"])
            group = Group(index, env_api.Task.from_dict(entry["task"]), int(entry["size"]))
            if entry.get("trajectories") is not None:
                group.done = {i: Trajectory.from_dict(d) for i, d in enumerate(entry["trajectories"])}
            self._groups[index] = group
            self.tokens += group.tokens
        self.next_index = max(self.next_index, int(pending.get("next_index", 0)))
