"""Rollout collection: G episodes per task, run concurrently, grouped, with group advantages.

`collect_groups` launches every episode of an iteration as its own coroutine (hundreds in flight;
the sampler batches their requests into KV-cache slots), and `postprocess.assign_advantages`
computes each group's advantages. Episode seeds come from `episode_seed`, for training and
evaluation alike.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence


from jaxrl_agent.envs import api as env_api
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout.episode import EpisodeEnv, EpisodeSettings, run_episode
from jaxrl_agent.rollout.scheduler import episode_seed


async def collect_groups(sampler, make_env: Callable[[env_api.Task], EpisodeEnv], tasks: Sequence[env_api.Task],
                         group_size: int, tokenizer, template, settings: EpisodeSettings, *, seed: int = 0,
                         group_indices: Sequence[int] | None = None) -> list[list[Trajectory]]:
    """G episodes of each task, all concurrently. Group g's episodes have seeds
    `episode_seed(seed, group_indices[g], i)` (default: g) — a process evaluating its share of a
    task list passes the tasks' places in the whole list, so each task keeps its seeds."""
    group_indices = range(len(tasks)) if group_indices is None else group_indices

    async def group(g: int, task: env_api.Task):
        return await asyncio.gather(*(
            run_episode(sampler, make_env(task), task, tokenizer, template, settings, seed=episode_seed(seed, g, i),
                        group_id=f"{seed}/{g}", sample_index=i)
            for i in range(group_size)))

    return list(await asyncio.gather(*(group(g, t) for g, t in zip(group_indices, tasks))))
