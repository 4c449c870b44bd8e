"""`benchmarks/rl_iteration_ab.py`'s pure parts: the order variants run in, and a run's medians."""

import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_iteration_ab  # noqa: E402


def test_every_other_round_runs_the_variants_in_reverse():
    variants = [("base", "/b", []), ("new", ".", []), ("third", ".", ["x=1"])]
    orders = [[v[0] for v in rl_iteration_ab.round_order(variants, i)] for i in range(4)]
    assert orders == [["base", "new", "third"], ["third", "new", "base"]] * 2
    assert [v[0] for v in variants] == ["base", "new", "third"]  # the given list is left as it was


def test_run_medians_skip_the_compiling_iterations_and_read_each_field():
    times = [0.0, 5.0, 9.0, 10.0, 11.5, 12.5]  # intervals 5, 4 (skipped), then 1, 1.5, 1
    records = [{"stage": "start", "time": -1.0}]
    for i, t in enumerate(times):
        records.append({"stage": "rl", "time": t, "sample_seconds": 10.0 * (i + 1), "learn_seconds": float(i),
                        "sampler_admit_seconds": 0.5, **({"sampler_decode_seconds": 0.25} if i != 5 else {})})
    records.append({"stage": "summary", "time": 13.0, "gain_points": 21.5})
    row = rl_iteration_ab.run_medians(records, skip=2)
    # The records after the first skip + 1 (i = 3, 4, 5): medians of 40, 50, 60 and of 3, 4, 5.
    assert row["iteration s"] == 1.0 and row["sample s"] == 50.0 and row["learn s"] == 4.0
    assert row["admit s"] == 0.5 and math.isnan(row["decode s"])  # one record lacks it: NaN, not an error
    assert row["gain"] == 21.5
    assert math.isnan(rl_iteration_ab.run_medians(records[:-1], skip=2)["gain"])  # no summary
