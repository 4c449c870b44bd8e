"""Reward components: how the work was done, not only whether the answer was right.

  * `overlong_penalty(length, max_length, buffer, factor)` — DAPO's soft overlong punishment
    (Yu et al., 2025, eq. 13):  0 if L <= Lmax - B;  factor * ((Lmax - B) - L) / B if
    Lmax - B < L <= Lmax;  -factor if L > Lmax.
  * `CompositeReward` — a weighted sum of named components computed from an episode's record:
    correctness (the environment's verifier), format (tool calls that parsed), efficiency (the
    overlong penalty on sampled tokens, a per-turn cost, a wall-time cost), and any extra
    component (e.g. a judge score). Each component is reported separately.
  * `toggle_phase(iteration, period)` — Kimi k1.5's "Toggle": alternate accuracy phases (no length
    cost) and budget phases (length cost on), `period` iterations each.
  * `length_bias(scores, lengths)` — Pearson correlation between (judge) scores and lengths: a
    judge that rewards verbosity shows a large positive value.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np


def overlong_penalty(length, max_length: int, buffer: int, factor: float = 1.0):
    """DAPO's soft overlong penalty (see module docstring); works on scalars and arrays."""
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_length, got buffer={buffer}, "
                         f"max_length={max_length}")
    length = np.asarray(length, np.float64)
    soft = factor * ((max_length - buffer) - length) / buffer
    value = np.where(length <= max_length - buffer, 0.0, np.where(length <= max_length, soft, -factor))
    return float(value) if value.ndim == 0 else value


def toggle_phase(iteration: int, period: int) -> str:
    """'accuracy' for the first `period` iterations, then 'budget' for `period`, and so on."""
    if period <= 0:
        raise ValueError(f"toggle period={period} must be > 0")
    return "accuracy" if (iteration // period) % 2 == 0 else "budget"


def length_bias(scores: Sequence[float], lengths: Sequence[float]) -> float:
    """Pearson correlation of scores with lengths (0 when either is constant)."""
    s, n = np.asarray(scores, np.float64), np.asarray(lengths, np.float64)
    if s.size < 2 or s.std() == 0 or n.std() == 0:
        return 0.0
    return float(np.corrcoef(s, n)[0, 1])


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
    total: float
    components: dict


@dataclasses.dataclass(frozen=True)
class CompositeReward:
    """total = sum_k weight_k * component_k over the named components below.

    correctness: 1 if the environment verified the answer, else 0.
    format: 1 - (share of the episode's tool calls that failed to parse), 1 with no calls.
    overlong: `overlong_penalty(sampled_tokens, max_tokens, buffer)` (<= 0), only when the
      phase is 'budget' (always, unless `toggle_period` > 0).
    turns: -(turns - 1) (each extra turn costs).
    wall_time: -seconds.
    Extra components (e.g. `judge`) come in `extra` and are weighted by `weights[name]`.
    """

    weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"correctness": 1.0})
    max_tokens: int = 256
    overlong_buffer: int = 64
    toggle_period: int = 0

    def __call__(self, *, success: bool, sampled_tokens: int, turns: int = 1, tool_calls: int = 0,
                 tool_call_errors: int = 0, wall_time_s: float = 0.0, iteration: int = 0,
                 extra: Mapping[str, float] | None = None) -> RewardBreakdown:
        budget_phase = self.toggle_period <= 0 or toggle_phase(iteration, self.toggle_period) == "budget"
        components = {
            "correctness": 1.0 if success else 0.0,
            "format": 1.0 - (tool_call_errors / tool_calls if tool_calls else 0.0),
            "overlong": overlong_penalty(sampled_tokens, self.max_tokens, self.overlong_buffer) if budget_phase
            else 0.0,
            "turns": -float(max(turns - 1, 0)),
            "wall_time": -float(wall_time_s),
            **{k: float(v) for k, v in (extra or {}).items()},
        }
        unknown = sorted(set(self.weights) - set(components))
        if unknown:
            raise ValueError(f"reward weights name unknown components {unknown}; known: {sorted(components)}")
        total = float(sum(w * components[k] for k, w in self.weights.items()))
        return RewardBreakdown(total, components)
