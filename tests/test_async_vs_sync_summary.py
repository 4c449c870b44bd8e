"""`benchmarks/async_vs_sync.py --seeds`: the per-schedule summary over seeds (speed-up of mean wall
times, mean success, its standard error and the difference to sync's), against hand-computed values."""

import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import async_vs_sync  # noqa: E402


def row(schedule, seed, wall, success, tasks=192):
    return {"schedule": schedule, "seed": seed, "rl_wall_s": wall, "success": success, "eval_tasks": tasks}


def test_summary_over_two_seeds():
    rows = [row("sync", 0, 300.0, 0.40), row("async", 0, 100.0, 0.45),
            row("sync", 1, 340.0, 0.50), row("async", 1, 120.0, 0.43)]
    sync, fast = async_vs_sync.summarize(rows)
    assert (sync["schedule"], sync["seeds"], fast["schedule"]) == ("sync", 2, "async")
    assert sync["rl_wall_s"] == pytest.approx(320.0) and fast["rl_wall_s"] == pytest.approx(110.0)
    assert sync["speedup"] == pytest.approx(1.0) and fast["speedup"] == pytest.approx(320 / 110)
    # sync: the spread over seeds (0.0707 / sqrt 2 = 0.05) is above the binomial 0.0254.
    assert sync["se"] == pytest.approx(0.05)
    # async: the binomial s.e. over 2 x 192 tasks (0.02533) is above the spread (0.01).
    binomial = math.sqrt(0.44 * 0.56 / 384)
    assert fast["se"] == pytest.approx(binomial)
    assert fast["diff"] == pytest.approx(-0.01)
    assert fast["diff_in_se"] == pytest.approx(-0.01 / math.hypot(binomial, 0.05))
    assert sync["diff"] == 0.0 and sync["diff_in_se"] == 0.0


def test_one_seed_uses_the_binomial_error_and_the_named_baseline():
    rows = [row("windowed", 0, 50.0, 0.5, tasks=100), row("sync", 0, 150.0, 0.5, tasks=100)]
    out = {r["schedule"]: r for r in async_vs_sync.summarize(rows, baseline="sync")}
    assert out["windowed"]["se"] == pytest.approx(0.05)
    assert out["windowed"]["speedup"] == pytest.approx(3.0)
