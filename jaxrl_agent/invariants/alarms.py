"""Alarms with hysteresis over the invariants' metrics: pure state machines, one per watched metric.

An alarm watches one number per RL iteration. It *fires* once the value has been past its
`threshold` for `fire_after` consecutive iterations, and *releases* once the value has been back on
the safe side of `release` (a stricter level than the threshold: the band between them is the
hysteresis) for `release_after` consecutive iterations. So a value hovering at the threshold
neither flaps the alarm on and off nor, once it has stayed past it, leaves it silent.

  direction='low':  past = value < threshold,  safe = value >= release   (release >= threshold)
  direction='high': past = value > threshold,  safe = value <= release   (release <= threshold)

An iteration without the value (None or NaN: e.g. no group finished) leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

FIRED, RELEASED = "fired", "released"


@dataclasses.dataclass(frozen=True)
class AlarmSpec:
    """What one alarm watches. `invariant`: 'exploration', 'signal' or 'drift' (the console and the
    responses group alarms by it); `metric`: the record key whose value it reads."""

    name: str
    invariant: str
    metric: str
    direction: str  # 'low' or 'high'
    threshold: float
    release: float
    fire_after: int = 2
    release_after: int = 3

    def __post_init__(self):
        if self.direction not in ("low", "high"):
            raise ValueError(f"alarm {self.name!r}: direction={self.direction!r}, expected 'low' or 'high'")
        if self.invariant not in ("exploration", "signal", "drift"):
            raise ValueError(f"alarm {self.name!r}: invariant={self.invariant!r}, expected 'exploration', "
                             "'signal' or 'drift'")
        ordered = self.release >= self.threshold if self.direction == "low" else self.release <= self.threshold
        if not ordered:
            raise ValueError(f"alarm {self.name!r}: release={self.release} must be on the safe side of "
                             f"threshold={self.threshold} ({'>=' if self.direction == 'low' else '<='}) for hysteresis")
        if self.fire_after < 1 or self.release_after < 1:
            raise ValueError(f"alarm {self.name!r}: fire_after={self.fire_after} and "
                             f"release_after={self.release_after} must be >= 1")


@dataclasses.dataclass(frozen=True)
class AlarmState:
    """`active`: the alarm is on. `streak`: consecutive iterations counted toward the other state."""

    active: bool = False
    streak: int = 0


def _past(spec: AlarmSpec, value: float) -> bool:
    return value < spec.threshold if spec.direction == "low" else value > spec.threshold


def _safe(spec: AlarmSpec, value: float) -> bool:
    return value >= spec.release if spec.direction == "low" else value <= spec.release


def step(spec: AlarmSpec, state: AlarmState, value: float | None) -> tuple[AlarmState, str | None]:
    """The alarm after one iteration's value, and the event: FIRED, RELEASED or None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return state, None
    value = float(value)
    if not state.active:
        streak = state.streak + 1 if _past(spec, value) else 0
        if streak >= spec.fire_after:
            return AlarmState(active=True, streak=0), FIRED
        return AlarmState(active=False, streak=streak), None
    streak = state.streak + 1 if _safe(spec, value) else 0
    if streak >= spec.release_after:
        return AlarmState(active=False, streak=0), RELEASED
    return AlarmState(active=True, streak=streak), None


def step_all(specs: tuple[AlarmSpec, ...], states: Mapping[str, AlarmState], record: Mapping[str, float]
             ) -> tuple[dict[str, AlarmState], dict[str, str]]:
    """Every alarm after one iteration's record: (new states by name, events by name)."""
    new_states, events = {}, {}
    for spec in specs:
        new_states[spec.name], event = step(spec, states.get(spec.name, AlarmState()), record.get(spec.metric))
        if event is not None:
            events[spec.name] = event
    return new_states, events


def invariant_states(specs: tuple[AlarmSpec, ...], states: Mapping[str, AlarmState]) -> dict[str, bool]:
    """Per invariant, whether any of its alarms is active."""
    out = {"exploration": False, "signal": False, "drift": False}
    for spec in specs:
        out[spec.invariant] = out[spec.invariant] or states.get(spec.name, AlarmState()).active
    return out


def console_state(specs: tuple[AlarmSpec, ...], states: Mapping[str, AlarmState]) -> str:
    """One line: `explore ok | signal LOW | drift ok` (the alarms' words: LOW, HIGH)."""
    words = {"exploration": "ok", "signal": "ok", "drift": "ok"}
    for spec in specs:
        if states.get(spec.name, AlarmState()).active:
            words[spec.invariant] = "LOW" if spec.direction == "low" else "HIGH"
    return f"explore {words['exploration']} | signal {words['signal']} | drift {words['drift']}"
