"""Post-processing of finished groups: pure functions from groups to new, frozen trajectories.

One downward pass per iteration, in this order (`postprocess`):
  1. reward shaping — the configured composite components (`RewardShaping`): weights over the
     environment's named components, DAPO's overlong penalty (with Kimi's Toggle), per-turn and
     wall-time costs, a researcher's `reward_fn`; every component is kept by name;
  2. staleness — the async schedule's bound on policy lag (`apply_staleness`);
  3. advantages — group-relative, by the configured estimator (rewards [G, N] -> [G, N]);
  4. the zero-advantage filter — all-equal groups carry no gradient (DAPO's dynamic sampling).
Nothing here mutates a record it is given; each function returns new trajectories (and metrics).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxrl_agent import losses
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout.scheduler import apply_staleness

Group = Sequence[Trajectory]
AdvantageFn = Callable[[np.ndarray], Any]  # rewards [G, N] -> advantages [G, N]


def dr_grpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """r - mean(r) within each group (Dr. GRPO; Liu et al. 2025): the default estimator."""
    return np.asarray(losses.group_advantages(rewards, normalize_std=False))


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """How a trajectory's reward is recomputed from its named components.

    weights: {component: weight} over the environment's components (e.g. correctness, format,
      efficiency) and the library's (`rewards.CompositeReward`: overlong, turns, wall_time; plus
      `judge` and `custom`); empty = keep the environment's reward and add the library's
      components that are switched on (the overlong penalty when overlong_factor > 0). A weight
      naming a component the episode does not have raises (the config names no such component).
    overlong_factor, overlong_buffer, max_context: DAPO's soft overlong penalty on sampled tokens
      (0 = off); toggle_period: Kimi k1.5's Toggle (penalty only in 'budget' phases; 0 = always).
    reward_fn: a researcher's `fn(trajectory) -> float | {name: float}`, recorded as component
      'custom' (a float) or under its names (a dict); with no weights a float replaces the reward.
    """

    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    overlong_factor: float = 0.0
    overlong_buffer: int = 32
    max_context: int = 128
    toggle_period: int = 0
    reward_fn: Callable[[Trajectory], Any] | None = None

    @property
    def active(self) -> bool:
        return bool(self.weights) or self.overlong_factor > 0 or self.reward_fn is not None


def shape_reward(t: Trajectory, shaping: RewardShaping, iteration: int) -> Trajectory:
    """A new trajectory whose reward and components follow `shaping` (see RewardShaping).

    With weights, the reward is `rewards.CompositeReward`'s weighted sum over the library's
    components (overlong, turns, wall_time; correctness and format from the episode) with the
    environment's own, the judge's and reward_fn's components taking precedence by name.
    """
    from jaxrl_agent import rewards as rewards_lib

    if not shaping.active:
        return t
    extra: dict[str, float] = {}
    replaced = None
    if shaping.reward_fn is not None:
        try:
            value = shaping.reward_fn(t)
            if isinstance(value, Mapping):
                extra.update({str(k): float(v) for k, v in value.items()})
            else:
                extra["custom"] = replaced = float(value)
        except Exception:  # noqa: BLE001 - a reward function's bug is a recorded failure, not a crash
            extra.update(custom=0.0, reward_fn_error=1.0)
            replaced = 0.0
    if shaping.weights:
        composite = rewards_lib.CompositeReward(weights=dict(shaping.weights), max_tokens=shaping.max_context,
                                                overlong_buffer=shaping.overlong_buffer,
                                                toggle_period=shaping.toggle_period)
        breakdown = composite(success=bool(t.reward_components.get("success", 0.0)),
                              sampled_tokens=t.generated_tokens, turns=len(t.turns),
                              wall_time_s=float(sum(turn.get("sample_seconds", 0.0) for turn in t.turns)),
                              iteration=iteration, extra={**t.reward_components, **extra})
        reward, components = breakdown.total, breakdown.components
    else:
        components = {**t.reward_components, **extra}
        reward = replaced if replaced is not None else float(t.reward)
        if shaping.overlong_factor > 0:
            budget_phase = shaping.toggle_period <= 0 or \
                rewards_lib.toggle_phase(iteration, shaping.toggle_period) == "budget"
            components["overlong"] = float(rewards_lib.overlong_penalty(
                t.generated_tokens, shaping.max_context, shaping.overlong_buffer, shaping.overlong_factor)) \
                if budget_phase else 0.0
            reward += components["overlong"]
    return dataclasses.replace(t, reward=float(reward), reward_components=components)


def shape_rewards(groups: Sequence[Group], shaping: RewardShaping, iteration: int) -> list[list[Trajectory]]:
    return [[shape_reward(t, shaping, iteration) for t in g] for g in groups]


def apply_staleness_to_groups(groups: Sequence[Group], current_version: int, max_staleness: int,
                              policy: str) -> tuple[list[list[Trajectory]], int]:
    """`apply_staleness` on every trajectory; returns (groups left non-empty, trajectories dropped)."""
    kept_groups, dropped = [], 0
    for g in groups:
        kept = [apply_staleness(t, current_version, max_staleness, policy) for t in g]
        dropped += sum(t is None for t in kept)
        kept = [t for t in kept if t is not None]
        if kept:
            kept_groups.append(kept)
    return kept_groups, dropped


def assign_advantages(groups: Sequence[Group], advantage_fn: AdvantageFn = dr_grpo_advantages
                      ) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """New trajectories with `advantage` from their group's rewards, and signal statistics.

    Groups may differ in size (adaptive allocation gives tasks different numbers of rollouts; the
    staleness bound may drop part of a group): groups of equal size are computed together; a group
    of one has advantage 0 (nothing to compare with).
    """
    if not groups:
        return [], {"groups": 0, "nonzero_advantage_group_share": 0.0}
    out: list[list[Trajectory] | None] = [None] * len(groups)
    nonzero = np.zeros(len(groups), bool)
    by_size: dict[int, list[int]] = {}
    for g, group in enumerate(groups):
        by_size.setdefault(len(group), []).append(g)
    all_rewards, all_advantages = [], []
    for size, members in by_size.items():
        rewards = np.asarray([[t.reward for t in groups[g]] for g in members], np.float32)
        advantages = np.zeros_like(rewards) if size < 2 else np.asarray(advantage_fn(rewards), np.float32)
        for row, g in enumerate(members):
            out[g] = [dataclasses.replace(t, advantage=float(advantages[row, i])) for i, t in enumerate(groups[g])]
            nonzero[g] = bool(np.any(advantages[row] != 0))
        all_rewards.append(rewards.ravel())
        all_advantages.append(advantages.ravel())
    rewards, advantages = np.concatenate(all_rewards), np.concatenate(all_advantages)
    return out, {"groups": len(groups), "nonzero_advantage_group_share": float(nonzero.mean()),
                 "reward_mean": float(rewards.mean()), "advantage_abs_mean": float(np.abs(advantages).mean()),
                 # 0 for group-centred estimators; > 0 where rl.negative_advantage_weight < 1 scales the failures.
                 "advantage_mean": float(advantages.mean())}


def drop_zero_advantage_groups(groups: Sequence[Group]) -> list[list[Trajectory]]:
    """The groups with some non-zero advantage (all-equal groups carry no gradient)."""
    return [list(g) for g in groups if any(t.advantage != 0 for t in g)]


@dataclasses.dataclass(frozen=True)
class PostprocessSettings:
    shaping: RewardShaping = RewardShaping()
    advantage_fn: AdvantageFn = dr_grpo_advantages
    drop_zero_advantage_groups: bool = True
    # The async schedule's staleness bound (None = not enforced: sync and windowed FIFO).
    max_staleness: int | None = None
    stale_policy: str = "drop"
    # `rl.distill_envs`: environments whose episodes carry no policy-gradient term (advantage 0, left
    # out of the signal statistics): all trained by the distillation term when `distill` is on, else
    # not trained at all (sampled for their outcomes in the records only).
    distill_only_envs: frozenset[str] = frozenset()
    distill: bool = True


@dataclasses.dataclass(frozen=True)
class Processed:
    """What post-processing hands on: every shaped group (for metrics and allocation), the groups
    after staleness with advantages, the trajectories to train on, and the signal metrics."""

    shaped_groups: list[list[Trajectory]]
    groups: list[list[Trajectory]]
    trainable: list[Trajectory]
    metrics: dict[str, float]


def postprocess(groups: Sequence[Group], settings: PostprocessSettings, *, iteration: int,
                current_version: int) -> Processed:
    """Shaping -> staleness -> advantages -> filter, as one pure pass (see the module docstring).

    Groups of `settings.distill_only_envs` skip the advantages and the filter: their trajectories
    get advantage 0 (no policy-gradient term) and, with `settings.distill`, are all trained, for the
    distillation term that covers them (`rl.distill_envs`); without it none of them is trained. The
    signal statistics are the other groups'."""
    shaped = shape_rewards(groups, settings.shaping, iteration)
    stale_dropped = 0
    kept = shaped
    if settings.max_staleness is not None:
        kept, stale_dropped = apply_staleness_to_groups(shaped, current_version, settings.max_staleness,
                                                        settings.stale_policy)
    distilled = [[dataclasses.replace(t, advantage=0.0) for t in g] for g in kept
                 if g[0].env in settings.distill_only_envs]
    kept = [g for g in kept if g[0].env not in settings.distill_only_envs]
    with_advantages, signal = assign_advantages(kept, settings.advantage_fn)
    trained_groups = drop_zero_advantage_groups(with_advantages) if settings.drop_zero_advantage_groups \
        else with_advantages
    metrics = {**signal, "stale_dropped": stale_dropped}
    if settings.distill_only_envs:
        metrics["distill_only_groups"] = len(distilled)
    trained_groups = trained_groups + distilled if settings.distill else trained_groups
    return Processed(shaped, with_advantages + distilled, [t for g in trained_groups for t in g], metrics)
