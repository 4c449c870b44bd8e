"""One RL iteration of the invariants: alarms, then (opt-in) responses, as a pure step.

    outcome = monitor.step(settings, state, record, num_levels=...)

reads an iteration's record (`metrics.iteration_record`, which already holds the invariants'
measures) and returns the new `MonitorState` (alarm states and controls), the metrics to add to
the record (`invariants/alarm/<name>`, `controls/*`, `guard/*`), the console's one-line state
(`explore ok | signal LOW | drift ok`), warnings, and the events to log — an `alarm` record when
an alarm fires or releases, a `response` record when an invariant's response engages or releases.
The trainer writes them and puts `outcome.state.controls` into the parts they steer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxrl_agent.invariants import alarms, responses
from jaxrl_agent.invariants.alarms import AlarmSpec, AlarmState
from jaxrl_agent.invariants.responses import Controls, ResponseBounds


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the config (`invariants.*`) sets: the alarms, the knobs' own values, the responses'
    bounds, whether responses act, and the exploration guards' floors."""

    specs: tuple[AlarmSpec, ...] = ()
    base: Controls = Controls()
    bounds: ResponseBounds = ResponseBounds()
    respond: bool = False
    entropy_floor: float = 0.0
    distinct_solutions_floor: float = 0.0


@dataclasses.dataclass(frozen=True)
class MonitorState:
    alarms: Mapping[str, AlarmState]
    controls: Controls

    @classmethod
    def initial(cls, settings: Settings) -> "MonitorState":
        return cls(alarms={}, controls=settings.base)

    def to_dict(self) -> dict:
        """For `RunState.invariants` (a resumed run continues its alarms and controls exactly)."""
        return {"alarms": {n: [a.active, a.streak] for n, a in self.alarms.items()},
                "controls": dataclasses.asdict(self.controls)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], settings: Settings) -> "MonitorState":
        """The inverse of `to_dict`; missing parts (checkpoints written before them) start fresh."""
        names = {f.name for f in dataclasses.fields(Controls)}
        controls = settings.base
        if "controls" in d:
            controls = Controls(**{k: v for k, v in dict(d["controls"]).items() if k in names})
        return cls(alarms={n: AlarmState(bool(a), int(k)) for n, (a, k) in d.get("alarms", {}).items()},
                   controls=controls)


@dataclasses.dataclass(frozen=True)
class Event:
    stage: str  # 'alarm' or 'response'
    record: dict
    console: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    state: MonitorState
    metrics: dict  # to add to the iteration's record
    state_line: str
    warnings: tuple[str, ...]
    events: tuple[Event, ...]


def exploration_guards(record: Mapping[str, Any], *, entropy_floor: float, distinct_solutions_floor: float
                       ) -> dict[str, float]:
    """Exploration collapse flags: `guard/entropy_collapse` = 1 when some environment's mean
    sampled-token entropy is below the floor, `guard/solution_collapse` = 1 when tasks average
    fewer distinct solutions (tool-call sequences) than the floor."""
    flags = {}
    entropies = [v for k, v in record.items() if k.startswith("sampled_entropy/")]
    if entropies and min(entropies) < entropy_floor:
        flags["guard/entropy_collapse"] = 1.0
    if record.get("groups") and record["distinct_solutions"] < distinct_solutions_floor:
        flags["guard/solution_collapse"] = 1.0
    return flags


def step(settings: Settings, state: MonitorState, record: Mapping[str, Any], *, num_levels: int = 1) -> Outcome:
    """The invariants after one iteration's record. num_levels: training levels the curriculum
    may set aside from (the fewest any environment trains on)."""
    metrics: dict[str, float] = {}
    warnings = []
    guards = exploration_guards(record, entropy_floor=settings.entropy_floor,
                                distinct_solutions_floor=settings.distinct_solutions_floor)
    for name in guards:
        entropies = [v for k, v in record.items() if k.startswith("sampled_entropy/")]
        warnings.append(f"warning: {name} (entropy {min(entropies) if entropies else float('nan'):.4f}, distinct "
                        f"solutions per task {record.get('distinct_solutions', float('nan')):.2f})")
    metrics.update(guards)
    alarm_states, alarm_events = alarms.step_all(settings.specs, state.alarms, record)
    metrics.update({f"invariants/alarm/{name}": float(a.active) for name, a in alarm_states.items()})
    controls, response_events = state.controls, {}
    if settings.respond:
        controls, response_events = responses.respond(
            settings.base, state.controls, alarms.invariant_states(settings.specs, alarm_states), settings.bounds,
            num_levels=num_levels, all_correct_dominates=record.get("invariants/signal/all_correct", 0.0)
            > record.get("invariants/signal/all_wrong", 0.0))
        metrics.update({f"controls/{k}": float(v) for k, v in dataclasses.asdict(controls).items()})
    state_line = alarms.console_state(settings.specs, alarm_states)
    events = []
    for spec in settings.specs:
        if spec.name in alarm_events:
            value = record.get(spec.metric)
            events.append(Event("alarm", {"alarm": spec.name, "invariant": spec.invariant,
                                          "event": alarm_events[spec.name], "metric": spec.metric, "value": value,
                                          "threshold": spec.threshold, "release": spec.release},
                                f"alarm {spec.name} {alarm_events[spec.name]}: {spec.metric}={value:.4g} (threshold "
                                f"{spec.threshold:g}, release {spec.release:g}) — {state_line}"))
    for invariant, event in response_events.items():
        knobs = dataclasses.asdict(controls)
        events.append(Event("response", {"invariant": invariant, "event": event, **knobs},
                            f"response {invariant} {event}: {knobs}"))
    return Outcome(state=MonitorState(alarms=alarm_states, controls=controls), metrics=metrics,
                   state_line=state_line, warnings=tuple(warnings), events=tuple(events))
