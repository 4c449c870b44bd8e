"""Responses to the invariants' alarms: a pure controller over the run-time knobs (`Controls`).

Each invariant's response engages while one of its alarms is active and releases when none is,
moving only its own knobs, always within `ResponseBounds`:

  exploration  an entropy bonus, added to the objective's, rises by `entropy_coef_step` per
               iteration up to `entropy_coef_max` (the knob that acts on any objective; the
               sampling temperature stays, since learner and sampler must describe one
               distribution); released, it steps back down to the config's value.
  signal       dynamic over-sampling (DAPO) is switched on; when all-correct groups dominate the
               groups without signal, the easiest training level is set aside (an automatic
               curriculum toward harder tasks; at most `max_dropped_levels`, at least one level is
               always kept); released, both return to the config's.
  drift        the staleness bound tightens by one version (not below `staleness_min`) and IcePop
               masking (Ling Team 2025: tokens whose learner/sampler ratio leaves
               [icepop_low, icepop_high] carry no gradient) turns on; released, both return.

`respond(base, controls, active, bounds, ...)` returns the new controls and, per invariant, the
event 'engaged' / 'released' on the iteration its knobs leave / regain the config's values.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

ENGAGED, RELEASED = "engaged", "released"


@dataclasses.dataclass(frozen=True)
class Controls:
    """The knobs responses move. With nothing engaged they equal the config's values."""

    entropy_coef: float = 0.0  # the bonus added to the objective's own entropy term
    dynamic_sampling: bool = False
    dropped_levels: int = 0  # easiest training levels set aside by the curriculum
    max_staleness: int = 2
    icepop: bool = False


@dataclasses.dataclass(frozen=True)
class ResponseBounds:
    entropy_coef_step: float = 0.002
    entropy_coef_max: float = 0.02
    max_dropped_levels: int = 1
    staleness_min: int = 0

    def __post_init__(self):
        for name in ("entropy_coef_step", "entropy_coef_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"invariants response bound {name}={getattr(self, name)}: expected >= 0")
        if self.max_dropped_levels < 0 or self.staleness_min < 0:
            raise ValueError(f"max_dropped_levels={self.max_dropped_levels} and staleness_min={self.staleness_min}: "
                             "expected >= 0")


def _toward(value: float, target: float, step: float) -> float:
    if value < target:
        return min(target, value + step)
    return max(target, value - step)


def _knobs(controls: Controls, invariant: str) -> tuple:
    if invariant == "exploration":
        return (controls.entropy_coef,)
    if invariant == "signal":
        return controls.dynamic_sampling, controls.dropped_levels
    return controls.max_staleness, controls.icepop


def respond(base: Controls, controls: Controls, active: Mapping[str, bool], bounds: ResponseBounds, *,
            all_correct_dominates: bool = False, num_levels: int = 1) -> tuple[Controls, dict[str, str]]:
    """One iteration of the controller.

    base: the config's values. controls: the current ones. active: per invariant, whether one of
    its alarms is on (`alarms.invariant_states`). all_correct_dominates: this iteration's groups
    without signal are mostly all-correct (too easy) rather than all-wrong. num_levels: training
    levels the curriculum may set aside from (one is always kept).
    """
    c = controls
    top = max(bounds.entropy_coef_max, base.entropy_coef) if active.get("exploration") else base.entropy_coef
    c = dataclasses.replace(c, entropy_coef=_toward(c.entropy_coef, top, bounds.entropy_coef_step))
    if active.get("signal"):
        most = min(bounds.max_dropped_levels, max(num_levels - 1, 0))
        dropped = min(c.dropped_levels + 1, most) if all_correct_dominates else c.dropped_levels
        c = dataclasses.replace(c, dynamic_sampling=True, dropped_levels=dropped)
    else:
        c = dataclasses.replace(c, dynamic_sampling=base.dynamic_sampling, dropped_levels=base.dropped_levels)
    if active.get("drift"):
        c = dataclasses.replace(c, max_staleness=max(bounds.staleness_min, min(c.max_staleness, base.max_staleness - 1)),
                                icepop=True)
    else:
        c = dataclasses.replace(c, max_staleness=base.max_staleness, icepop=base.icepop)
    events = {}
    for invariant in ("exploration", "signal", "drift"):
        was, now, rest = _knobs(controls, invariant), _knobs(c, invariant), _knobs(base, invariant)
        if was == rest and now != rest:
            events[invariant] = ENGAGED
        elif was != rest and now == rest:
            events[invariant] = RELEASED
    return c, events

