"""Episodes as coroutines, scheduling, the task source, and pure post-processing of finished groups."""

from jaxrl_agent.rollout.episode import (
    EpisodeSettings,
    InProcessEnv,
    ServiceEnv,
    expert_trajectory,
    run_episode,
)
from jaxrl_agent.rollout import allocation, context, delegation
from jaxrl_agent.rollout.context import CONTEXT_STRATEGIES, ContextSettings
from jaxrl_agent.rollout.delegation import DelegationLimits, SubAgents
from jaxrl_agent.rollout.allocation import TaskAllocator
from jaxrl_agent.rollout import postprocess, source
from jaxrl_agent.rollout.manager import collect_groups
from jaxrl_agent.rollout.postprocess import PostprocessSettings, RewardShaping, assign_advantages
from jaxrl_agent.rollout.scheduler import (RolloutRunner, Schedule, apply_staleness, episode_seed,
                                           windowed_fifo_selectable)

__all__ = ["CONTEXT_STRATEGIES", "ContextSettings", "DelegationLimits", "EpisodeSettings", "InProcessEnv", "PostprocessSettings", "RewardShaping", "RolloutRunner", "Schedule",
           "ServiceEnv", "TaskAllocator", "allocation", "apply_staleness", "assign_advantages", "collect_groups", "context", "delegation",
           "episode_seed", "expert_trajectory", "postprocess", "run_episode", "source", "SubAgents", "windowed_fifo_selectable"]
