"""Episodes as coroutines, rollout collection and group advantages."""

from jaxrl_agent.rollout.episode import (
    EpisodeSettings,
    InProcessEnv,
    ServiceEnv,
    expert_trajectory,
    run_episode,
)
from jaxrl_agent.rollout.manager import assign_advantages, collect_groups

__all__ = ["EpisodeSettings", "InProcessEnv", "ServiceEnv", "assign_advantages", "collect_groups",
           "expert_trajectory", "run_episode"]
