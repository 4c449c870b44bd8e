"""The invariants' alarms in a run: each condition built, the alarm firing (a record, a console
state, the flag on the RL record), and the drift alarm on a train/serve gap injected by perturbing
the sampler's weights."""

import json

import jax
import numpy as np
import pytest
import jax.numpy as jnp

from jaxrl_agent import trainer
from tests.test_trainer import tiny_config


def _records(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_entropy_and_signal_alarms_fire_when_their_condition_holds(tmp_path):
    config = tiny_config(tmp_path)
    config.rl.iterations, config.eval.every = 3, 0
    # An "entropy collapse" and a "signal below the floor" by thresholds no run can meet.
    config.invariants.entropy_floor, config.invariants.entropy_release = 100.0, 200.0
    config.invariants.signal_floor, config.invariants.signal_release = 1.01, 1.02
    config.invariants.fire_after = 2
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    alarms = [r for r in records if r["stage"] == "alarm"]
    # fire_after=2: quiet on iteration 1, on from iteration 2, one 'fired' record each, no flapping.
    assert [r["invariants/alarm/entropy"] for r in rl] == [0.0, 1.0, 1.0]
    assert [r["invariants/alarm/signal"] for r in rl] == [0.0, 1.0, 1.0]
    assert sorted((r["alarm"], r["event"], r["step"]) for r in alarms) == [("entropy", "fired", 2),
                                                                          ("signal", "fired", 2)]
    assert all(r["invariants/alarm/serve_gap"] == 0.0 for r in rl)


def test_a_perturbed_sampler_fires_the_drift_alarm_and_policy_movement_stays_apart(tmp_path, monkeypatch):
    config = tiny_config(tmp_path)
    config.rl.iterations, config.eval.every = 3, 0
    config.invariants.fire_after = 1
    push = trainer.Run.push_weights

    def push_perturbed(self, params):  # the learner keeps its parameters; the sampler gets others
        push(self, params)
        noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(0), x.shape, x.dtype), params)
        self.sampler.update_weights(noisy, self.version)

    monkeypatch.setattr(trainer.Run, "push_weights", push_perturbed)
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    # Every push since SFT's went to the sampler perturbed (the unperturbed gap is <= 1e-5:
    # tests/test_trainer.py), so every iteration samples from other weights than the learner's.
    assert all(r["invariants/drift/serve_gap_p99"] > 1e-2 for r in rl)
    assert [r["invariants/alarm/serve_gap"] for r in rl] == [1.0, 1.0, 1.0]
    fired = [r for r in records if r["stage"] == "alarm" and r["invariant"] == "drift"]
    assert [(r["alarm"], r["event"], r["step"]) for r in fired] == [("serve_gap", "fired", 1)]
    # The policy's movement is its own figure: the same order on every iteration, gap or not.
    assert all(0 < r["invariants/drift/policy_kl"] < 1e-2 for r in rl)


def test_responses_engage_within_their_bounds_and_reach_the_parts_they_steer(tmp_path):
    config = tiny_config(tmp_path)
    config.rl.iterations, config.eval.every = 4, 0
    config.env.train_difficulties = "1,2"
    config.invariants.respond = True
    config.invariants.entropy_floor, config.invariants.entropy_release = 100.0, 200.0  # always "collapsed"
    config.invariants.signal_floor, config.invariants.signal_release = 1.01, 1.02  # always "no signal"
    config.invariants.fire_after = 1
    config.invariants.entropy_coef_step, config.invariants.entropy_coef_max = 0.004, 0.01
    config.invariants.max_dropped_levels = 1  # the curriculum too (off by default)
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    # The bonus the learner applied lags the controller by one iteration (decided after the metrics).
    np.testing.assert_allclose([r["controls/entropy_coef"] for r in rl], [0.004, 0.008, 0.01, 0.01])
    np.testing.assert_allclose([r["controls/entropy_bonus"] for r in rl], [0.0, 0.004, 0.008, 0.01], rtol=1e-6)
    assert all(r["controls/dynamic_sampling"] == 1.0 and r["controls/icepop"] == 0.0 for r in rl)
    assert all(0 <= r["controls/dropped_levels"] <= 1 for r in rl)
    responses = [(r["invariant"], r["event"], r["step"]) for r in records if r["stage"] == "response"]
    assert ("exploration", "engaged", 1) in responses and ("signal", "engaged", 1) in responses
    assert not any(event == "released" for _, event, _ in responses)


@pytest.mark.slow
def test_an_alarm_that_releases_in_a_run_releases_its_response(tmp_path, monkeypatch):
    """Entropy scripted per iteration (collapsed twice, then healthy): the alarm fires and
    releases, and the entropy bonus rises, then steps back to the config's value, with a
    'response' record at each end."""
    from jaxrl_agent.metrics import records as records_lib

    scripted = iter([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    measure = records_lib.invariants.iteration_invariants

    def scripted_invariants(*args, **kwargs):
        out = measure(*args, **kwargs)
        out["invariants/exploration/entropy_min"] = next(scripted)
        return out

    monkeypatch.setattr(records_lib.invariants, "iteration_invariants", scripted_invariants)
    config = tiny_config(tmp_path)
    config.rl.iterations, config.eval.every = 7, 0
    config.invariants.respond = True
    config.invariants.entropy_floor, config.invariants.entropy_release = 0.5, 0.6
    config.invariants.signal_floor = config.invariants.serve_gap_ceiling = config.invariants.lag_ceiling = 0  # off
    config.invariants.fire_after, config.invariants.release_after = 1, 2
    config.invariants.entropy_coef_step, config.invariants.entropy_coef_max = 0.004, 0.01
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["invariants/alarm/entropy"] for r in rl] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose([r["controls/entropy_coef"] for r in rl], [0.004, 0.008, 0.01, 0.006, 0.002, 0, 0],
                               atol=1e-12)
    events = [(r["stage"], r.get("alarm") or r.get("invariant"), r["event"], r["step"]) for r in records
              if r["stage"] in ("alarm", "response")]
    assert events == [("alarm", "entropy", "fired", 1), ("response", "exploration", "engaged", 1),
                      ("alarm", "entropy", "released", 4), ("response", "exploration", "released", 6)]
