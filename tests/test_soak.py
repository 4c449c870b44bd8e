"""The fault-injection soak (`benchmarks/soak.py`), short: a few minutes of chaos on a run with a
short SFT and fewer tasks per iteration. Every kind of fault is injected at least once (the soak's
own check) and survived, and the run's checks hold; the 10-minute run is in benchmarks/RESULTS.md."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_survives_every_fault(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "2.5", "--sft_minutes", "1", "--tail_minutes", "1.5",
               "--interval", "3", "6", "--max_trainer_kills", "1", "--hang_every", "10", "--seed", "1",
               "--workdir", str(tmp_path / "run"), "--logdir", str(tmp_path / "logs"),
               "--override", "sft.steps=20", "--override", "sft.warmup_steps=5",
               "--override", "eval.tasks_per_difficulty=4", "--override", "rollout.prompts_per_iteration=16",
               "--override", "checkpoint.every=2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "| SIGKILL trainer + resume | 1 | 1 |" in done.stdout, report
    for check in ("task stream exact across restarts", "every kind of fault injected", "no sandbox process left"):
        assert f"| {check} | yes |" in done.stdout, report
