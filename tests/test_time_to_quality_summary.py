"""`benchmarks/time_to_quality.py`: RL seconds with evaluations left out, success by a time, the first
crossing, and the per-arm means, on hand-made records."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import time_to_quality as ttq  # noqa: E402


def records(eval_seconds=5.0):
    """Start evaluation at t=100 (success 0.40); RL iterations of 2 s; an evaluation of
    `eval_seconds` after iterations 2 and 4."""
    rs = [{"stage": "start", "step": 0, "time": 90.0},
          {"stage": "initial_eval", "step": 0, "time": 100.0, "eval/success": 0.40}]
    t = 100.0
    for i in range(1, 5):
        t += 2.0
        rs.append({"stage": "rl", "step": i, "time": t})
        if i % 2 == 0:
            t += eval_seconds
            rs.append({"stage": "rl_eval", "step": i, "time": t, "eval/success": 0.40 + 0.06 * i})
    return rs


def test_rl_seconds_leave_evaluations_out():
    for eval_seconds in (0.5, 30.0):  # the evaluation's length never moves the RL clock
        start, curve = ttq.rl_curve(records(eval_seconds))
        assert start == pytest.approx(0.40)
        assert [(i, round(t, 6), round(s, 6)) for i, t, s in curve] == [(2, 4.0, 0.52), (4, 8.0, 0.64)]


def test_success_by_a_time_and_the_first_crossing():
    _, curve = ttq.rl_curve(records())
    assert ttq.success_by(curve, 3.9) is None
    assert ttq.success_by(curve, 4.0) == pytest.approx(0.52)
    assert ttq.success_by(curve, 100.0) == pytest.approx(0.64)
    assert ttq.first_reaching(curve, 0.52) == (2, pytest.approx(4.0))  # an exact hit counts
    assert ttq.first_reaching(curve, 0.60) == (4, pytest.approx(8.0))
    assert ttq.first_reaching(curve, 0.65) is None


def test_run_row_and_the_summary_over_seeds():
    fast = ttq.run_row(records(), "a", 0, [4.0, 8.0], points=20)  # 0.40 + 0.20 first at iteration 4
    assert fast["reached"] == (4, pytest.approx(8.0))
    assert fast["median_iteration_s"] == pytest.approx(2.0)  # gaps 2, 7 (an evaluation's), 2
    slow = dict(fast, seed=1, reached=None, at={4.0: None, 8.0: 0.50}, median_iteration_s=3.0)
    (arm,) = ttq.summarize([fast, slow], [4.0, 8.0])
    assert arm["seeds"] == 2 and arm["reached"] == 1
    assert arm["seconds_to_points"] == pytest.approx(8.0)  # over the seeds that reached it
    assert arm["at"][4.0] == pytest.approx(0.52)  # only the seed that had evaluated by then
    assert arm["at"][8.0] == pytest.approx((0.64 + 0.50) / 2)
    assert arm["median_iteration_s"] == pytest.approx((fast["median_iteration_s"] + 3.0) / 2)


@pytest.mark.parametrize("arm", sorted(ttq.ARMS))
def test_every_arm_names_config_keys_with_valid_values(arm):
    """An arm's flags reach real keys of the default config with values its validation accepts (a
    typo would otherwise surface only after the benchmark's SFT run)."""
    from jaxrl_agent import build, config_lib

    path = str(ROOT / "configs" / "calculator_tiny.py")
    flags, spacing = ttq.ARMS[arm]
    assert spacing > 0
    config_lib.check_overrides(["--config", path, *flags])
    build.validate_config(config_lib.apply_overrides(config_lib.load_config(path), flags))
