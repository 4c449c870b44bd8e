"""The invariants' alarms (hysteresis) and responses (bounded, engage and release), as pure functions."""

import dataclasses

import numpy as np
import pytest

from jaxrl_agent.invariants import alarms, measures, responses
from jaxrl_agent.invariants.alarms import AlarmSpec, AlarmState

ENTROPY = AlarmSpec("entropy", "exploration", "invariants/exploration/entropy_min", "low", threshold=0.02,
                    release=0.03, fire_after=2, release_after=3)
GAP = AlarmSpec("serve_gap", "drift", "invariants/drift/serve_gap_p99", "high", threshold=1e-3, release=1e-4,
                fire_after=1, release_after=2)


def _run(spec, values):
    state, events = AlarmState(), []
    for value in values:
        state, event = alarms.step(spec, state, value)
        events.append((state.active, event))
    return events


def test_an_entropy_collapse_fires_after_fire_after_iterations_and_releases_above_the_release_level():
    events = _run(ENTROPY, [0.05, 0.01, 0.05, 0.01, 0.01, 0.025, 0.025, 0.04, 0.04, 0.02, 0.04, 0.04, 0.04])
    active = [a for a, _ in events]
    # One iteration below the floor is not enough; two in a row fire it.
    assert active[:5] == [False, False, False, False, True] and events[4][1] == alarms.FIRED
    # In the band (0.02 <= v < 0.03) it stays on: no flapping at the threshold.
    assert active[5:7] == [True, True]
    # Three safe iterations release it; a break in the streak restarts the count.
    assert active[7:13] == [True, True, True, True, True, False] and events[12][1] == alarms.RELEASED
    assert [e for _, e in events if e] == [alarms.FIRED, alarms.RELEASED]


def test_a_high_alarm_and_missing_values():
    events = _run(GAP, [1e-6, None, 5e-3, float("nan"), 5e-4, 5e-5, 5e-5])
    assert [a for a, _ in events] == [False, False, True, True, True, True, False]
    assert events[2][1] == alarms.FIRED and events[6][1] == alarms.RELEASED


def test_specs_are_checked():
    with pytest.raises(ValueError, match="release=0.01 must be on the safe side"):
        AlarmSpec("x", "signal", "m", "low", threshold=0.02, release=0.01)
    with pytest.raises(ValueError, match="direction='up'"):
        AlarmSpec("x", "signal", "m", "up", threshold=0.02, release=0.03)
    with pytest.raises(ValueError, match="invariant='speed'"):
        AlarmSpec("x", "speed", "m", "low", threshold=0.02, release=0.03)


def test_step_all_and_the_console_line():
    signal = AlarmSpec("signal", "signal", "invariants/signal/nonzero_share", "low", 0.1, 0.2, fire_after=1)
    specs = (ENTROPY, signal, GAP)
    states, events = alarms.step_all(specs, {}, {"invariants/signal/nonzero_share": 0.05,
                                                 "invariants/exploration/entropy_min": 0.5})
    assert events == {"signal": alarms.FIRED}
    assert alarms.invariant_states(specs, states) == {"exploration": False, "signal": True, "drift": False}
    assert alarms.console_state(specs, states) == "explore ok | signal LOW | drift ok"


BASE = responses.Controls(entropy_coef=0.0, dynamic_sampling=False, dropped_levels=0, max_staleness=2, icepop=False)
BOUNDS = responses.ResponseBounds(entropy_coef_step=0.004, entropy_coef_max=0.01, max_dropped_levels=1,
                                  staleness_min=1)


def _controller(active_per_iteration, **kwargs):
    controls, history = BASE, []
    for active in active_per_iteration:
        controls, events = responses.respond(BASE, controls, active, BOUNDS, **kwargs)
        history.append((controls, events))
    return history


def test_the_exploration_response_raises_the_entropy_bonus_within_its_bound_and_steps_back_when_released():
    on, off = {"exploration": True}, {"exploration": False}
    history = _controller([on] * 5 + [off] * 5)
    coefs = [c.entropy_coef for c, _ in history]
    np.testing.assert_allclose(coefs, [0.004, 0.008, 0.01, 0.01, 0.01, 0.006, 0.002, 0.0, 0.0, 0.0])
    assert max(coefs) <= BOUNDS.entropy_coef_max
    events = [e.get("exploration") for _, e in history]
    assert events == ["engaged", None, None, None, None, None, None, "released", None, None]
    assert all(c.icepop is False and c.dynamic_sampling is False for c, _ in history)  # other knobs untouched


def test_the_signal_response_samples_dynamically_and_sets_aside_at_most_its_levels():
    history = _controller([{"signal": True}] * 3 + [{"signal": False}], all_correct_dominates=True, num_levels=3)
    assert [(c.dynamic_sampling, c.dropped_levels) for c, _ in history] == [(True, 1), (True, 1), (True, 1),
                                                                           (False, 0)]
    assert [e.get("signal") for _, e in history] == ["engaged", None, None, "released"]
    # With one level, none is ever set aside; with all-wrong dominating, none either.
    assert all(c.dropped_levels == 0 for c, _ in _controller([{"signal": True}] * 3, all_correct_dominates=True))
    assert all(c.dropped_levels == 0 for c, _ in _controller([{"signal": True}] * 3, num_levels=3))


def test_the_drift_response_tightens_staleness_not_below_its_floor_and_turns_on_icepop():
    history = _controller([{"drift": True}] * 3 + [{"drift": False}])
    assert [(c.max_staleness, c.icepop) for c, _ in history] == [(1, True), (1, True), (1, True), (2, False)]
    assert [e.get("drift") for _, e in history] == ["engaged", None, None, "released"]
    tight = dataclasses.replace(BASE, max_staleness=1)
    controls, _ = responses.respond(tight, tight, {"drift": True}, BOUNDS)
    assert controls.max_staleness == 1  # staleness_min


def test_measures():
    assert measures.identical_group_share([[[1, 2], [1, 2]], [[1, 2], [1, 3]], [[4]]]) == 0.5
    shares = measures.outcome_shares_by_difficulty([("calculator/1/0", [True, True]), ("calculator/1/1", [True, False]),
                                                    ("calculator/3/2", [False, False]), ("data-7", [True, True])])
    assert shares == {"all_correct/d1": 0.5, "all_wrong/d1": 0.0, "all_correct/d3": 0.0, "all_wrong/d3": 1.0,
                      "all_correct": 0.5, "all_wrong": 0.25}
    assert measures.advantage_magnitude([1.0, -1.0, 0.5]) == pytest.approx(2.5 / 3)
    gap = measures.gap_stats(np.array([0.0, -1.0, -2.0, -3.0]), np.array([0.0, -1.1, -2.0, -5.0]),
                             np.array([1, 1, 1, 0]))
    assert gap["max"] == pytest.approx(0.1) and gap["mean"] == pytest.approx(0.1 / 3)
    assert measures.gap_stats(np.zeros(3), np.ones(3), np.zeros(3)) == {"mean": 0.0, "p99": 0.0, "max": 0.0}
    assert measures.lag_quantiles(np.array([0, 0, 1, 4]))["max"] == 4.0


def test_distill_only_groups_stay_out_of_the_learning_signal_measures():
    """`rl.distill_envs` groups have advantage 0 by construction: counting them would read as a
    weaker signal (and all-correct ones would set levels aside) where the RL groups are fine."""
    import types

    def group(env, level, successes, advantages):
        return [types.SimpleNamespace(env=env, task_id=f"{env}/{level}/0", tokens=[i], advantage=a, success=s)
                for i, (s, a) in enumerate(zip(successes, advantages))]

    rl = group("chain", 1, [1.0, 0.0], [1.0, -1.0])
    distilled = group("calculator", 1, [1.0, 1.0], [0.0, 0.0])
    measure = lambda **kw: measures.iteration_invariants([rl, distilled], rl + distilled, {}, group_size=2,
                                                         success=lambda t: t.success, lags=np.zeros(0), **kw)
    left_out = measure(distill_only_envs=frozenset({"calculator"}))
    assert left_out["invariants/signal/all_correct"] == 0.0 and left_out["invariants/signal/all_wrong"] == 0.0
    assert left_out["invariants/signal/advantage_magnitude"] == pytest.approx(1.0)
    counted = measure()  # without the setting both groups count (what the trainer did before)
    assert counted["invariants/signal/all_correct"] == 0.5
    assert counted["invariants/signal/advantage_magnitude"] == pytest.approx(0.5)


def test_the_plot_shades_the_iterations_an_alarm_was_on():
    from jaxrl_agent import plot

    records = [{"stage": "rl", "global_step": s, "invariants/alarm/serve_gap": float(on), "invariants/alarm/lag": 0.0}
               for s, on in zip(range(10, 16), [0, 1, 1, 0, 0, 1])]
    assert plot._alarm_spans(records, ("serve_gap", "lag")) == [(10.5, 12.5), (14.5, 15.5)]
    assert plot._alarm_spans(records, ("entropy",)) == []
    assert plot.invariants_path("/w/curves.png") == "/w/invariants.png"
    assert plot.invariants_path("/w/run.png") == "/w/run_invariants.png"


def test_the_monitor_step_logs_each_alarm_and_response_event_once_and_its_state_round_trips():
    from jaxrl_agent.invariants import monitor

    settings = monitor.Settings(specs=(ENTROPY, GAP), base=BASE, bounds=BOUNDS, respond=True, entropy_floor=0.02)
    state = monitor.MonitorState.initial(settings)
    stages = []
    for entropy in [0.01, 0.01, 0.01]:
        record = {"invariants/exploration/entropy_min": entropy, "sampled_entropy/calculator": entropy,
                  "invariants/drift/serve_gap_p99": 1e-6}
        outcome = monitor.step(settings, state, record)
        state = outcome.state
        stages.append([(e.stage, e.record.get("event")) for e in outcome.events])
        assert outcome.metrics["guard/entropy_collapse"] == 1.0 and outcome.warnings
    # Fires on the second iteration below the floor; the response engages on that same iteration.
    assert stages == [[], [("alarm", "fired"), ("response", "engaged")], []]
    assert outcome.metrics["invariants/alarm/entropy"] == 1.0 and outcome.metrics["invariants/alarm/serve_gap"] == 0.0
    assert outcome.metrics["controls/entropy_coef"] == pytest.approx(0.008)  # two steps of 0.004
    assert outcome.state_line == "explore LOW | signal ok | drift ok"
    assert monitor.MonitorState.from_dict(state.to_dict(), settings) == state
    # A checkpoint written before the monitor existed starts it fresh; responses off move no knob.
    assert monitor.MonitorState.from_dict({}, settings) == monitor.MonitorState.initial(settings)
    quiet = dataclasses.replace(settings, respond=False)
    outcome = monitor.step(quiet, monitor.MonitorState.initial(quiet), record)
    outcome = monitor.step(quiet, outcome.state, record)
    assert [e.stage for e in outcome.events] == ["alarm"] and outcome.state.controls == BASE
    assert not any(k.startswith("controls/") for k in outcome.metrics)
