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
    """Sets `advantage` on every trajectory from its group's rewards; returns signal statistics.

    Groups may differ in size (adaptive allocation gives tasks different numbers of rollouts; the
    staleness bound may drop part of a group): groups of equal size are computed together.
    """
    if not groups:
        return {"groups": 0, "nonzero_advantage_group_share": 0.0}
    nonzero = np.zeros(len(groups), bool)
    by_size: dict[int, list[int]] = {}
    for g, group in enumerate(groups):
        by_size.setdefault(len(group), []).append(g)
    all_rewards, all_advantages = [], []
    for size, members in by_size.items():
        rewards = np.asarray([[t.reward for t in groups[g]] for g in members], np.float32)
        advantages = np.asarray(losses.group_advantages(rewards, normalize_std=normalize_std))
        for row, g in enumerate(members):
            for i, t in enumerate(groups[g]):
                t.advantage = float(advantages[row, i])
            nonzero[g] = bool(np.any(advantages[row] != 0))
        all_rewards.append(rewards.ravel())
        all_advantages.append(advantages.ravel())
    rewards, advantages = np.concatenate(all_rewards), np.concatenate(all_advantages)
    return {"groups": len(groups), "nonzero_advantage_group_share": float(nonzero.mean()),
            "reward_mean": float(rewards.mean()), "advantage_abs_mean": float(np.abs(advantages).mean())}
