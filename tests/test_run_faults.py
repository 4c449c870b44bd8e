"""A run that survives its parts: non-finite updates stop it after `learner.max_consecutive_skips`,
a resume falls back past a checkpoint that does not restore, a failed checkpoint write stops it
with the previous checkpoint kept, and a torn metrics line does not break the summary."""

import json
import os

import jax.numpy as jnp
import pytest

from jaxrl_agent import checkpoint, losses, trainer
from tests.test_open_trainer import _rl_only
from tests.test_trainer import tiny_config


def _records(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]


# Restoring a checkpoint whose arrays were truncated fails in orbax, whose event loop then closes
# while tensorstore's reads of the other arrays are still finishing on its own (non-Python) threads;
# each of those completions calls the closed loop and is reported as "Exception ignored in: None ...
# RuntimeError: Event loop is closed" (pytest's unraisable-exception warning). The run is not
# affected (it falls back, as these tests assert); only the tests that truncate arrays see it.
_TRUNCATED_RESTORE_NOISE = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


def _nan_loss(logprobs, sampler_logprobs, ref_logprobs, advantages, mask, cfg):
    return jnp.sum(logprobs * mask) * jnp.nan, {}


@pytest.mark.slow
def test_a_run_of_non_finite_updates_stops_the_run(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=5)
    config.rollout.drop_zero_advantage_groups = False  # every iteration trains
    config.rl.minibatches = 2
    config.learner.max_consecutive_skips = 3
    with pytest.raises(trainer.RunStopped, match=r"last 4 learner updates were skipped .*max_consecutive_skips=3"):
        trainer.train_and_evaluate(config, quiet=True, objective=losses.objective_from_loss(_nan_loss, name="nan"))
    records = _records(tmp_path)
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["update_skipped"] for r in rl] == [2.0, 2.0] and rl[-1]["skipped_steps_total"] == 4.0
    assert "update_skipped_flags" not in rl[-1]
    end = next(r for r in records if r["stage"] == "rl_end")
    assert end["reason"] == "non_finite_updates" and end["step"] == 2


def _truncate_arrays(step_dir):
    for folder, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(folder, name)
            if os.sep + "d" + os.sep in path + os.sep and os.path.getsize(path) > 0:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
@_TRUNCATED_RESTORE_NOISE
def test_resume_falls_back_past_a_checkpoint_that_does_not_restore(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=3)
    config.checkpoint.every, config.checkpoint.keep = 1, 3
    trainer.train_and_evaluate(config, quiet=True)
    _truncate_arrays(str(tmp_path / "checkpoints" / "3"))
    config.resume, config.rl.iterations = True, 4
    trainer.train_and_evaluate(config, quiet=True)
    records = _records(tmp_path)
    (skipped,) = [r for r in records if r["stage"] == "checkpoint_skipped"]
    assert skipped["checkpoint_step"] == 3 and skipped["error"]
    resume = next(r for r in records if r["stage"] == "resume")
    assert resume["step"] == 2  # from iteration 2's checkpoint: iteration 3 is run again
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1, 2, 3, 3, 4]


@_TRUNCATED_RESTORE_NOISE
def test_every_checkpoint_broken_is_an_error_not_a_fresh_start(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=1)
    trainer.train_and_evaluate(config, quiet=True)
    for step in os.listdir(tmp_path / "checkpoints"):
        _truncate_arrays(str(tmp_path / "checkpoints" / step))
    config.resume, config.rl.iterations = True, 2
    from jaxrl_agent import build

    with pytest.raises(build.ConfigError, match="no checkpoint in .* restores"):
        trainer.train_and_evaluate(config, quiet=True)


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_run_and_keeps_the_previous_one(tmp_path, monkeypatch):
    config = _rl_only(tiny_config(tmp_path), iterations=3)
    config.checkpoint.every = 1
    real = checkpoint.Checkpointer.save
    calls = []

    def save(self, step, state, run_state):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, step, state, run_state)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    with pytest.raises(trainer.RunStopped, match=r"checkpoint step 2 could not be written .*No space left.*step 1\) is kept"):
        trainer.train_and_evaluate(config, quiet=True)
    monkeypatch.undo()
    failed = next(r for r in _records(tmp_path) if r["stage"] == "checkpoint_failed")
    assert failed["checkpoint_step"] == 2 and failed["kept_step"] == 1
    kept = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=2)
    assert kept.latest().iteration == 1 and kept.skipped == []
    kept.close()
    config.resume = True  # and the run continues from it
    trainer.train_and_evaluate(config, quiet=True)
    assert [r["step"] for r in _records(tmp_path) if r["stage"] == "rl"] == [1, 2, 2, 3]


@pytest.mark.slow
def test_a_torn_last_metrics_line_does_not_break_the_summary(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=1)
    trainer.train_and_evaluate(config, quiet=True)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": "rl", "step": 2, "succ')  # a kill mid-write
    config.resume, config.rl.iterations = True, 2
    trainer.train_and_evaluate(config, quiet=True)
    summaries = []
    for line in open(tmp_path / "metrics.jsonl"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["stage"] == "summary":
            summaries.append(record)
    assert len(summaries) == 2 and "gain_points" in summaries[-1]


@pytest.mark.slow
def test_a_run_on_one_sampler_server_survives_its_death(tmp_path):
    """sampler.num_servers=1: the server is SIGKILLed after the first RL iteration; the supervisor
    restarts it on its port with the latest weights, and the run finishes every iteration on-policy."""
    import signal
    import threading
    import time

    config = tiny_config(tmp_path)
    config.sampler.num_servers, config.sft.steps, config.rl.iterations = 1, 2, 4
    config.eval.pass_k, config.eval.every, config.metrics.tensorboard = 0, 100, False
    killed = []

    def kill_after_first_iteration():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if (tmp_path / "metrics.jsonl").exists() and any(
                    r["stage"] == "rl" for r in _records(tmp_path)):
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                    except OSError:
                        continue
                    if b"sampler-server" in cmdline and str(tmp_path).encode() in cmdline:
                        os.kill(int(pid), signal.SIGKILL)
                        killed.append(int(pid))
                        return
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_after_first_iteration, daemon=True)
    watcher.start()
    trainer.train_and_evaluate(config, quiet=True)
    watcher.join(timeout=5)
    assert killed
    rl = [r for r in _records(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert rl[-1]["sampler_server_restarts"] >= 1
    assert all(r["policy_lag_max"] <= 1 for r in rl[1:])
    assert rl[-1]["drift/sampler_abs_diff_max"] < 0.05  # the restarted server has the learner's weights


def test_a_sampler_server_that_dies_while_starting_is_started_again(tmp_path, monkeypatch):
    """Killed before it listens (the soak's chaos can): started again, up to startup_attempts."""
    import subprocess
    import sys

    from jaxrl_agent import build

    config = tiny_config(tmp_path)
    listening = "print('sampler server listening on 127.0.0.1:1', flush=True); import time; time.sleep(60)"
    commands = iter([[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", listening]])
    spawned = []

    def spawn(self, port, index):
        spawned.append(subprocess.Popen(next(commands), stdout=subprocess.PIPE, text=True))
        return spawned[-1]

    monkeypatch.setattr(build.SamplerServers, "_spawn", spawn)
    servers = build.SamplerServers(config, 1, str(tmp_path), supervise=False)
    try:
        assert servers.addresses == ["127.0.0.1:1"] and len(spawned) == 2 and spawned[0].returncode == 3
    finally:
        servers.close()
    commands = iter([[sys.executable, "-c", "raise SystemExit(3)"]] * 2)
    spawned.clear()
    with pytest.raises(RuntimeError, match="exited with 3"):
        build.SamplerServers(config, 1, str(tmp_path), supervise=False, startup_attempts=2)
    assert len(spawned) == 2
