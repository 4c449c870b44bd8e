"""Rollout scheduling: which finished groups the learner may train on, and when.

Three schedules (config `rollout.schedule`):
  * `sync` — an on-policy barrier: every iteration submits P groups and waits for all of them.
  * `windowed_fifo` (MiniMax-M1) — groups are submitted continuously; a finished group may be
    trained only while its submission index lies within a window W of the oldest unfinished group,
    so fast groups cannot run far ahead of slow ones (which would bias training toward short,
    easy episodes) and the learner still does not wait for the slowest episode.
  * `async` — any finished group is trained as soon as it is complete; tokens sampled more than S
    policy versions ago are dropped (their episode is not trained) or masked out of the loss.

Partial rollouts (Kimi k1.5): with `token_budget > 0` each episode may sample at most that many
tokens per iteration; an episode that exhausts it is suspended, keeping its environment state and
tokens, and resumed in a later iteration on newer weights. Every token keeps the version of the
policy that sampled it, so a resumed episode carries mixed versions.

The selection rules are pure functions (`windowed_fifo_selectable`, `apply_staleness`); the
`RolloutRunner` keeps episodes alive across iterations on one asyncio loop in a background thread
while the learner trains in the caller's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_agent.envs import api as env_api
from jaxrl_agent.replay.buffer import ReplayBuffer
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout.episode import EpisodeEnv, EpisodeSettings, run_episode


def episode_seed(seed: int, group_index: int, sample_index: int) -> int:
    """The seed of episode `sample_index` of group `group_index`: distinct per episode (groups hold
    fewer than 1024 episodes); the training runner and evaluation (`collect_groups`) both use it."""
    return seed + group_index * 1024 + sample_index

SCHEDULES = ("sync", "windowed_fifo", "async")
STALE_POLICIES = ("drop", "mask")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """mode: one of SCHEDULES. window: W for windowed_fifo, in groups. max_staleness: S for async,
    in policy versions. stale_policy: 'drop' or 'mask'. token_budget: tokens per episode per
    iteration (0 = unlimited, i.e. no partial rollouts). groups_in_flight: groups kept submitted
    ahead of the learner by the non-sync schedules."""

    mode: str = "sync"
    window: int = 8
    max_staleness: int = 2
    stale_policy: str = "drop"
    token_budget: int = 0
    groups_in_flight: int = 0

    def __post_init__(self):
        if self.mode not in SCHEDULES:
            raise ValueError(f"rollout.schedule={self.mode!r}; expected one of {SCHEDULES}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.stale_policy={self.stale_policy!r}; expected one of {STALE_POLICIES}")
        for name in ("window", "max_staleness", "token_budget", "groups_in_flight"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 0")
        if self.mode == "windowed_fifo" and self.window < 1:
            raise ValueError(f"rollout.window={self.window} must be >= 1 for windowed_fifo")


def windowed_fifo_selectable(finished: Sequence[int], unfinished: Sequence[int], window: int) -> list[int]:
    """Finished group indices (submission order) that lie within `window` of the oldest unfinished one.

    A group i is selectable iff i < min(unfinished) + window (any i when nothing is unfinished).
    """
    oldest = min(unfinished) if len(unfinished) else math.inf
    return sorted(i for i in finished if i < oldest + window)


def apply_staleness(trajectory: Trajectory, current_version: int, max_staleness: int, policy: str
                    ) -> Trajectory | None:
    """Enforces lag = current_version - token version <= max_staleness on the sampled tokens.

    'drop': a trajectory with any too-stale sampled token is dropped (returns None).
    'mask': too-stale tokens leave the loss (loss_mask 0); a trajectory left with no trained token
    is dropped.
    """
    sampled = trajectory.loss_mask == 1
    stale = sampled & (current_version - trajectory.policy_version > max_staleness)
    if not stale.any():
        return trajectory
    if policy == "drop":
        return None
    mask = np.where(stale, 0, trajectory.loss_mask).astype(trajectory.loss_mask.dtype)
    if not mask.any():
        return None
    return dataclasses.replace(trajectory, loss_mask=mask)


class IterationClock:
    """Per-episode token budgets that refill at every iteration (partial rollouts).

    `grant(episode_budget, wanted, progress)` returns how many tokens the episode may sample now;
    when its budget for the current iteration is spent it calls `on_suspend(episode_budget,
    progress())` — the episode's `PartialRollout`, for the replay buffer — and waits for
    `advance()`. Lives on the runner's loop.
    """

    def __init__(self, token_budget: int, on_suspend: Callable[["EpisodeBudget", Any], None] = lambda b, p: None):
        self.token_budget = token_budget
        self.iteration = 0
        self.suspended = 0
        self._on_suspend = on_suspend
        self._changed = asyncio.Condition()

    async def grant(self, budget: "EpisodeBudget", wanted: int, progress: Callable[[], Any] | None = None) -> int:
        if self.token_budget <= 0:
            return wanted
        async with self._changed:
            while True:
                if budget.iteration != self.iteration:
                    budget.iteration, budget.spent = self.iteration, 0
                left = self.token_budget - budget.spent
                if left > 0:
                    return min(wanted, left)
                self.suspended += 1
                budget.suspensions += 1
                self._on_suspend(budget, progress() if progress is not None else None)
                try:
                    await self._changed.wait()
                finally:
                    self.suspended -= 1

    async def advance(self) -> None:
        async with self._changed:
            self.iteration += 1
            self._changed.notify_all()


@dataclasses.dataclass
class EpisodeBudget:
    """One episode's spending against the clock's per-iteration budget; `slot` = (group, sample)."""

    clock: IterationClock
    iteration: int = 0
    spent: int = 0
    suspensions: int = 0
    slot: tuple[int, int] = (-1, -1)

    async def grant(self, wanted: int, progress: Callable[[], Any] | None = None) -> int:
        return await self.clock.grant(self, wanted, progress)

    def spend(self, tokens: int) -> None:
        self.spent += tokens


class RolloutRunner:
    """Episodes as coroutines on a persistent event loop (background thread), grouped by task; the
    groups live in the replay buffer (`replay.ReplayBuffer`) from submission until taken.

    submit(tasks) -> group indices in submission order; the learner thread then polls
    `finished()` / `unfinished()` / `running_episodes()` and `take(indices)`. A suspended episode's
    `PartialRollout` is written to the buffer as it suspends, so `pending_state()` (the buffer's
    state) holds it, and `restore_pending()` continues it from its tokens.
    """

    def __init__(self, sampler, make_env: Callable[[env_api.Task], EpisodeEnv], tokenizer, template,
                 settings: EpisodeSettings, group_size: int, token_budget: int = 0, seed: int = 0,
                 buffer: ReplayBuffer | None = None):
        self.sampler, self.make_env = sampler, make_env
        self.tokenizer, self.template, self.settings = tokenizer, template, settings
        self.group_size, self.seed = group_size, seed
        self.buffer = buffer if buffer is not None else ReplayBuffer()
        self._episodes: dict[int, list[asyncio.Task]] = {}  # running episodes by group (loop thread)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._running = 0  # episodes sampling or stepping (not finished, not suspended)
        self._errors: list[BaseException] = []
        self.resumed_partials = 0  # episodes continued from a saved PartialRollout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollouts", daemon=True)
        self._thread.start()
        self.clock = self._call(self._make_clock(token_budget))

    async def _make_clock(self, token_budget):
        return IterationClock(token_budget, on_suspend=self._suspended)

    def _suspended(self, budget: EpisodeBudget, partial) -> None:
        """On the loop: a suspending episode's record goes to the buffer before anyone can see the
        runner quiescent (and checkpoint it)."""
        with self._changed:
            index, sample = budget.slot
            if partial is not None and index in self.buffer:
                self._cancel(self.buffer.suspend(index, sample, partial))
            self._changed.notify_all()

    def _cancel(self, evicted: Sequence[int]) -> None:
        """Stops the running episodes of groups the buffer evicted (caller holds the lock, on the loop)."""
        for index in evicted:
            for task in self._episodes.pop(index, ()):
                task.cancel()

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    # ------------------------------------------------------------------ submission
    def submit(self, tasks: Sequence[env_api.Task], sizes: Sequence[int] | None = None) -> list[int]:
        """Starts one group per task, of `sizes[i]` episodes (default: group_size each)."""
        sizes = [self.group_size] * len(tasks) if sizes is None else [int(n) for n in sizes]
        if len(sizes) != len(tasks) or any(n < 1 for n in sizes):
            raise ValueError(f"group sizes {sizes} must be >= 1, one per task ({len(tasks)} tasks)")
        with self._lock:
            indices = [self.buffer.open(task, size) for task, size in zip(tasks, sizes)]
            self._running += sum(sizes)
        self._call(self._start(indices))
        return indices

    async def _start(self, indices: Sequence[int]) -> None:
        """Starts every empty or suspended slot of these groups (on the loop)."""
        with self._lock:
            for index in indices:
                if index in self._episodes or index not in self.buffer:
                    continue  # already running, or evicted meanwhile
                group = self.buffer.group(index)
                self._episodes[index] = [
                    self.loop.create_task(self._episode(index, group.task, i, group.partial.get(i)))
                    for i in range(group.size) if i not in group.done]

    async def _episode(self, index: int, task: env_api.Task, sample: int, partial) -> None:
        budget = EpisodeBudget(self.clock, iteration=self.clock.iteration, slot=(index, sample))
        trajectory, error = None, None
        try:
            trajectory = await run_episode(
                self.sampler, self.make_env(task), task, self.tokenizer, self.template, self.settings,
                seed=episode_seed(self.seed, index, sample), group_id=f"g{index}", sample_index=sample,
                budget=budget, resume=partial)
        except asyncio.CancelledError:
            pass  # its group was evicted, or the runner is closing
        except BaseException as err:  # noqa: BLE001 - surfaced to the learner thread by wait()
            error = err
        # A finished episode is recorded in the same step that stops counting it as running, so
        # `quiescent()` never sees a finished but unrecorded group.
        with self._changed:
            self._running -= 1
            if error is not None:
                self._errors.append(error)
            elif trajectory is not None and index in self.buffer:
                self._cancel(self.buffer.finish(index, sample, trajectory))
                if self.buffer.group(index).finished:
                    self._episodes.pop(index, None)
            self._changed.notify_all()

    # ------------------------------------------------------------------ state (learner thread)
    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def finished_unlocked(self) -> list[int]:
        """Finished group indices; the caller holds `lock` (e.g. inside a `wait` predicate)."""
        return self.buffer.finished_indices()

    def unfinished_unlocked(self) -> list[int]:
        return self.buffer.unfinished_indices()

    def finished(self) -> list[int]:
        with self._lock:
            return self.finished_unlocked()

    def unfinished(self) -> list[int]:
        with self._lock:
            return self.unfinished_unlocked()

    def running_episodes(self) -> int:
        with self._lock:
            return self._running

    def wait(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Blocks until predicate() (evaluated under the runner's lock) holds; raises an episode error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                if self._errors:
                    raise self._errors.pop(0)
                if predicate():
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(timeout=remaining if remaining is not None else 1.0)

    def quiescent(self) -> bool:
        """Every episode is finished or suspended on its token budget (call under wait())."""
        return self._running == 0 or self._running == self.clock.suspended

    def take(self, indices: Sequence[int]) -> list[list[Trajectory]]:
        """The finished groups `indices` still held (a group evicted since it was selected is not)."""
        with self._lock:
            return self.buffer.take([i for i in indices if i in self.buffer])

    def pending_state(self) -> dict:
        """Groups not yet trained, for a checkpoint: the replay buffer's state — finished episodes
        with their trajectories, suspended ones with their partial rollouts."""
        with self._lock:
            return self.buffer.state_dict()

    def restore_pending(self, state: dict, legacy_pending: dict | None = None) -> None:
        """Loads checkpointed groups into the buffer under their own indices and continues them:
        suspended episodes from their partial rollouts, the others from their tasks.
        `legacy_pending`: the open groups of a checkpoint written before they lived in the buffer
        (the task source's `pending`: finished groups kept, unfinished ones restarted from the task)."""
        with self._lock:
            self.buffer.load_state_dict(state)
            if legacy_pending:
                self.buffer.load_pending_groups(legacy_pending)
            unfinished = self.buffer.unfinished_indices()
            for index in unfinished:
                group = self.buffer.group(index)
                self._running += group.size - len(group.done)
                self.resumed_partials += len(group.partial)
        self._call(self._start(unfinished))

    def next_iteration(self) -> None:
        """Refills every episode's token budget: suspended partial rollouts resume."""
        self._call(self.clock.advance())

    def close(self) -> None:
        """Cancels the episodes still in flight (their groups are in `pending_state()` if a
        checkpoint needs them) and stops the loop."""
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing must not raise; the loop is stopped regardless
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
