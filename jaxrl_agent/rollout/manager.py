"""Rollout collection: G episodes per task, run concurrently, grouped, with group advantages.

`collect_groups` launches every episode of an iteration as its own coroutine (hundreds in flight;
the sampler batches their requests into KV-cache slots), then `assign_advantages` computes each
group's advantages with `losses.group_advantages` and reports how many groups carry signal.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import numpy as np

from jaxrl_agent import losses
from jaxrl_agent.envs import api as env_api
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout.episode import EpisodeEnv, EpisodeSettings, run_episode


async def collect_groups(sampler, make_env: Callable[[env_api.Task], EpisodeEnv], tasks: Sequence[env_api.Task],
                         group_size: int, tokenizer, template, settings: EpisodeSettings, *, seed: int = 0
                         ) -> list[list[Trajectory]]:
    async def group(g: int, task: env_api.Task):
        return await asyncio.gather(*(
            run_episode(sampler, make_env(task), task, tokenizer, template, settings, seed=seed + i,
                        group_id=f"{seed}/{g}", sample_index=i)
            for i in range(group_size)))

    return list(await asyncio.gather(*(group(g, t) for g, t in enumerate(tasks))))


def assign_advantages(groups: Sequence[Sequence[Trajectory]], *, normalize_std: bool = False) -> dict[str, float]:
    """Sets `advantage` on every trajectory from its group's rewards; returns signal statistics."""
    if not groups:
        return {"groups": 0, "nonzero_advantage_group_share": 0.0}
    rewards = np.asarray([[t.reward for t in g] for g in groups], np.float32)
    advantages = np.asarray(losses.group_advantages(rewards, normalize_std=normalize_std))
    for g, group in enumerate(groups):
        for i, t in enumerate(group):
            t.advantage = float(advantages[g, i])
    nonzero = np.any(advantages != 0, axis=1)
    return {"groups": len(groups), "nonzero_advantage_group_share": float(nonzero.mean()),
            "reward_mean": float(rewards.mean()), "advantage_abs_mean": float(np.abs(advantages).mean())}
