"""Episodes as coroutines, rollout collection and group advantages."""

from jaxrl_agent.rollout.episode import (
    EpisodeSettings,
    InProcessEnv,
    ServiceEnv,
    expert_trajectory,
    run_episode,
)
from jaxrl_agent.rollout import allocation
from jaxrl_agent.rollout.allocation import TaskAllocator
from jaxrl_agent.rollout.manager import assign_advantages, collect_groups
from jaxrl_agent.rollout.scheduler import RolloutRunner, Schedule, apply_staleness, windowed_fifo_selectable

__all__ = ["EpisodeSettings", "TaskAllocator", "allocation", "InProcessEnv", "RolloutRunner", "Schedule", "ServiceEnv", "apply_staleness",
           "assign_advantages", "collect_groups", "expert_trajectory", "run_episode", "windowed_fifo_selectable"]
