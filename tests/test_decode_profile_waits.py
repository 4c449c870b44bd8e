"""`benchmarks/decode_profile.py`: the untraced wait after an op is charged to that op inside the
decode loop, and kept apart at the loop's edges (between generate calls), on hand-made events."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_profile  # noqa: E402


def in_loop(name):
    return not name.startswith("edge")


def test_gap_after_an_op_is_charged_to_it():
    # head ends at 10, nothing runs until 40: the 30 us are head's; mlp follows with no gap.
    ops = [(0.0, 10.0, "head"), (40.0, 50.0, "mlp"), (50.0, 55.0, "norm")]
    waits, outside = decode_profile.untraced_waits(ops, in_loop)
    assert waits == {"head": 30.0}
    assert outside == 0.0


def test_overlapping_ops_leave_no_gap_and_the_last_to_end_takes_the_next_gap():
    # a and b overlap (two threads); b ends last (at 20), so the gap 20..25 is b's, not a's.
    ops = [(0.0, 12.0, "a"), (5.0, 20.0, "b"), (25.0, 30.0, "c"), (28.0, 29.0, "d")]
    waits, outside = decode_profile.untraced_waits(ops, in_loop)
    assert waits == {"b": 5.0}
    assert outside == 0.0


def test_gaps_at_the_loops_edges_are_the_hosts():
    # a call: edge op, loop ops, edge op; then the next call after 100 us of host time.
    ops = [(0.0, 1.0, "edge_in"), (3.0, 5.0, "step"), (9.0, 10.0, "edge_out"),
           (110.0, 111.0, "edge_in"), (112.0, 113.0, "step")]
    waits, outside = decode_profile.untraced_waits(ops, in_loop)
    assert waits == {}  # every gap here touches an edge op
    assert outside == 2.0 + 4.0 + 100.0 + 1.0
