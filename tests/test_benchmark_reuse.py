"""Benchmarks that reuse an earlier invocation's folders (`delegation.py --sft_from`,
`forgetting.py --stages_from`) stop, naming every differing key, when that folder ran other settings."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import launcher_runs  # noqa: E402


def test_matching_settings_pass():
    launcher_runs.require_same_settings("--sft_from", "/w/a", {"sft.steps": (400, 400), "seed": (0, 0)})


def test_differing_settings_name_each_key_with_then_and_now():
    with pytest.raises(SystemExit) as err:
        launcher_runs.require_same_settings("--stages_from", "/w/b",
                                            {"sft.steps": (270, 400), "seed": (0, 0), "lr": (5e-4, 1e-3)})
    message = str(err.value)
    assert message.startswith("--stages_from /w/b: trained with other settings")
    assert "'sft.steps': (270, 400)" in message and "'lr': (0.0005, 0.001)" in message
    assert "seed" not in message
