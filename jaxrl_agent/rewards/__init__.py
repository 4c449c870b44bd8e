"""Composite rewards with named components, DAPO's overlong penalty, and a rubric LLM judge."""

from jaxrl_agent.rewards.components import (
    CompositeReward,
    RewardBreakdown,
    length_bias,
    overlong_penalty,
    toggle_phase,
)
from jaxrl_agent.rewards.judge import RubricJudge, judge_groups, judge_prompt, parse_judge_score

__all__ = ["CompositeReward", "RewardBreakdown", "RubricJudge", "judge_groups", "judge_prompt", "length_bias", "overlong_penalty",
           "parse_judge_score", "toggle_phase"]
