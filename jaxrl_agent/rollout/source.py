"""The task source: which tasks are sampled, how groups are started, and which finished groups the
learner takes.

`ProceduralTasks` is the seeded task stream: each task's environment drawn by the mixture's weights
(`env.mixture`), its level uniformly among that environment's training levels, its seed a running
counter — a pure function of (seed, position), so a checkpointed position resumes the exact stream.

`RolloutSource` owns the `RolloutRunner` (episodes on their event loop) and its lock: it submits
groups — fresh tasks of `group_size` episodes, or the `TaskAllocator`'s choice of pool tasks and
group sizes, over-sampled for DAPO's dynamic sampling — selects the trainable ones as the schedule
says (sync barrier, windowed FIFO, async), keeps the non-sync schedules topped up, and runs
Reinforce-Ada's rounds (`until_mixed`). `next_groups()` is one iteration's groups; `observe()`
feeds the outcomes back to the allocator; `state_dict()` is the stream's and the allocator's state
(the open groups are the replay buffer's).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl_agent.envs import api as env_api
from jaxrl_agent.metrics.records import success as _success
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout import allocation
from jaxrl_agent.rollout.allocation import TaskAllocator
from jaxrl_agent.rollout.scheduler import RolloutRunner, Schedule, windowed_fifo_selectable


class ProceduralTasks:
    """Seeded tasks from the environments' own generators (`Environment.sample_task(seed, level)`).

    Args:
      environments: {name: environment} (used only to generate tasks).
      weights: {name: sampling weight} (normalised here).
      levels: {name: the levels to draw from}.
      seed: the stream's seed.
      shard_index, shard_count: this process's disjoint share of the task seeds (task k of this
        stream has seed k * shard_count + shard_index; e.g. jax.process_index(), jax.process_count()).
    """

    def __init__(self, environments: Mapping[str, env_api.Environment], weights: Mapping[str, float],
                 levels: Mapping[str, Sequence[int]], seed: int = 0, *, shard_index: int = 0, shard_count: int = 1):
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index={shard_index} is not in [0, shard_count={shard_count})")
        self.environments = dict(environments)
        self.names = list(weights)
        p = np.asarray([weights[n] for n in self.names], np.float64)
        self.p = p / p.sum()
        self.levels = {n: tuple(levels[n]) for n in self.names}
        self.rng = np.random.RandomState(seed + 1_000_003 * shard_index)
        self.shard_index, self.shard_count = shard_index, shard_count
        self.next_seed = 0

    @property
    def position(self) -> int:
        """Tasks taken so far (the seed of the next one)."""
        return self.next_seed

    def take(self, n: int) -> list[env_api.Task]:
        tasks = []
        for _ in range(n):
            name = self.names[0] if len(self.names) == 1 else self.names[self.rng.choice(len(self.names), p=self.p)]
            levels = self.levels[name]
            difficulty = levels[self.rng.randint(len(levels))]
            tasks.append(self.environments[name].sample_task(self.next_seed * self.shard_count + self.shard_index,
                                                             difficulty))
            self.next_seed += 1
        return tasks

    def state_dict(self) -> dict:
        from jaxrl_agent.checkpoint import rng_state

        return {"next_seed": self.next_seed, "rng": rng_state(self.rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from jaxrl_agent.checkpoint import set_rng_state

        self.next_seed = int(state["next_seed"])
        set_rng_state(self.rng, state["rng"])


class RolloutSource:
    """Tasks -> submitted groups -> the iteration's trainable groups (see the module docstring).

    Args:
      tasks: the task stream (`take(n)`, `position`, `state_dict()`, `load_state_dict()`):
        `ProceduralTasks` or `data.DatasetTasks`.
      runner: the episodes' runner; this source is its only user.
      schedule: sync / windowed FIFO / async, with its knobs.
      prompts_per_iteration: P, groups the learner takes per iteration.
      group_size: G, episodes per fresh task.
      allocator: a revisited task pool with its allocation rule, or None (a fresh task per group).
      dynamic_sampling: DAPO: sync iterations submit ceil(P / running non-zero share) groups.
      max_group: until_mixed's cap on one task's rollouts in an iteration.
    """

    def __init__(self, tasks, runner: RolloutRunner, schedule: Schedule, *, prompts_per_iteration: int,
                 group_size: int, allocator: TaskAllocator | None = None, dynamic_sampling: bool = False,
                 max_group: int = 16):
        self.tasks, self.runner, self.schedule = tasks, runner, schedule
        self.prompts_per_iteration, self.group_size = prompts_per_iteration, group_size
        self.allocator, self.dynamic_sampling, self.max_group = allocator, dynamic_sampling, max_group
        self.nonzero_share = 1.0  # running share of groups with signal (DAPO over-sampling)

    # ------------------------------------------------------------------ one iteration
    def next_groups(self) -> list[list[Trajectory]]:
        """Blocks until this iteration's groups are trainable; returns them (taken from the runner)."""
        if self.allocator is not None and self.allocator.strategy == "until_mixed":
            return self._until_mixed_groups()
        groups = self.runner.take(self._select_groups())
        if self.schedule.mode != "sync":
            # Refill what was just taken before the update, not after it: otherwise the sampler
            # works through the learner's step with P fewer groups open and runs dry (measured:
            # idle ~1 s of a ~4.5 s asynchronous iteration).
            self._top_up()
        return groups

    def observe(self, groups: Sequence[Sequence[Trajectory]], nonzero_share: float | None) -> None:
        """Outcomes of the iteration's groups: the allocator's posteriors and DAPO's running share."""
        if self.allocator is not None:
            for g in groups:
                self.allocator.observe(g[0].task_id, [_success(t) for t in g])
        if groups and nonzero_share is not None:
            self.nonzero_share = 0.8 * self.nonzero_share + 0.2 * nonzero_share

    def groups_pending(self) -> int:
        return len(self.runner.unfinished()) + len(self.runner.finished())

    def retired_tasks(self) -> int | None:
        return self.allocator.retired_count() if self.allocator is not None else None

    def iteration_stats(self, groups: Sequence[Sequence[Trajectory]], *, suspended: int,
                        with_task_ids: bool) -> dict[str, Any]:
        """The source's part of an iteration's record, read once the runner has moved on to the next
        iteration: the task stream's position (a resumed run must continue it exactly), the task ids
        trained on (`with_task_ids`: dataset tasks), the groups pending, the `suspended` episodes
        (those that spent this iteration's token budget, counted before the runner moved on), the
        replay buffer's figures (under the runner's lock: episodes finish and suspend meanwhile), and
        the allocator's retired tasks."""
        with self.runner.lock:
            replay_stats = self.runner.buffer.stats()
        retired = self.retired_tasks()
        return {**({"allocation/retired_tasks": retired} if retired is not None else {}),
                "task_position": self.tasks.position,
                **({"task_ids": [g[0].task_id for g in groups]} if with_task_ids else {}),
                "groups_pending": self.groups_pending(), "suspended_episodes": suspended,
                **replay_stats, "replay/resumed_partials": self.runner.resumed_partials}

    def apply_controls(self, controls, train_levels: Mapping[str, Sequence[int]]) -> None:
        """Takes the invariants' responses (`invariants.Controls`) that steer submission: DAPO's
        dynamic sampling, and the training levels less the easiest `controls.dropped_levels` (one is
        always kept; the procedural task stream only — dataset tasks have no levels)."""
        self.dynamic_sampling = controls.dynamic_sampling
        if hasattr(self.tasks, "levels"):
            self.tasks.levels = {n: tuple(sorted(levels))[controls.dropped_levels:] or tuple(sorted(levels))[-1:]
                                 for n, levels in train_levels.items()}

    # ------------------------------------------------------------------ submission and selection
    def _submit(self, num_groups: int) -> None:
        if num_groups <= 0:
            return
        if self.allocator is None:
            self.runner.submit(self.tasks.take(num_groups))
        else:
            proposals = self.allocator.propose(num_groups)
            self.runner.submit([t for t, _ in proposals], [n for _, n in proposals])

    def _select_groups(self) -> list[int]:
        runner, schedule, p = self.runner, self.schedule, self.prompts_per_iteration
        if schedule.mode == "sync":
            # A barrier: top up to P open groups (partial rollouts carried over count), then wait
            # until every episode has finished or spent this iteration's token budget.
            wanted = allocation.dynamic_sampling_prompts(p, self.nonzero_share) if self.dynamic_sampling else p
            self._submit(wanted - self.groups_pending())
            runner.wait(runner.quiescent)
            return runner.finished()

        def selectable():
            finished, unfinished = runner.finished_unlocked(), runner.unfinished_unlocked()
            if schedule.mode == "windowed_fifo":
                return windowed_fifo_selectable(finished, unfinished, schedule.window)
            return finished

        # Train as soon as a batch's worth of groups is trainable (or nothing more can finish).
        self._top_up()
        while not runner.wait(lambda: len(selectable()) >= p or runner.quiescent(), timeout=0.2):
            self._top_up()
        with runner.lock:
            return selectable()[:p]

    def _top_up(self) -> None:
        """Non-sync schedules: keeps P + ahead groups open (submitted, not yet taken by the learner)."""
        p = self.prompts_per_iteration
        ahead = self.schedule.groups_in_flight or p
        self._submit(p + ahead - self.groups_pending())

    def _until_mixed_groups(self) -> list[list[Trajectory]]:
        """Reinforce-Ada's sequential sampling under the iteration's budget of P x G rollouts.

        Round 1: min_group rollouts for each of P tasks. Each later round adds min_group rollouts
        to every task whose outcomes are still all equal (`allocation.until_mixed_done`, capped at
        max_group), and when none is left, starts fresh tasks, until the budget is spent. A task's
        rollouts from all rounds form one group.
        """
        runner, allocator = self.runner, self.allocator
        step, cap = allocator.min_group, max(self.max_group, allocator.min_group)
        budget = self.prompts_per_iteration * self.group_size
        merged: dict[str, list] = {}
        tasks: dict[str, Any] = {}
        batch = [task for task, _ in allocator.propose(self.prompts_per_iteration)]
        spent = 0
        while batch:
            indices = runner.submit(batch, [step] * len(batch))
            spent += step * len(batch)
            runner.wait(runner.quiescent)
            for task, group in zip(batch, runner.take(indices)):
                tasks[task.id] = task
                merged.setdefault(task.id, []).extend(group)
            rounds_left = (budget - spent) // step
            batch = [tasks[task_id] for task_id, group in merged.items()
                     if not allocation.until_mixed_done([_success(t) for t in group], cap)][:rounds_left]
            if not batch and rounds_left:
                batch = allocator.draw(rounds_left, exclude=list(merged))
        return list(merged.values())

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {"tasks": self.tasks.state_dict(), "nonzero_share": self.nonzero_share,
                "allocator": self.allocator.state_dict() if self.allocator is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tasks.load_state_dict(state["tasks"])
        self.nonzero_share = float(state.get("nonzero_share", 1.0))
        if self.allocator is not None and state.get("allocator"):
            self.allocator.load_state_dict(state["allocator"])
