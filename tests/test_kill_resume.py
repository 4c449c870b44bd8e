"""A run killed with SIGKILL and resumed loses nothing that was checkpointed and continues the
same schedule (task stream, policy versions, optimizer step, iteration numbering)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.test_trainer import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
ITERATIONS = 5


def _flags(workdir):
    config = tiny_config(workdir)
    flags = [f"--config.workdir={workdir}", f"--config.rl.iterations={ITERATIONS}", "--config.checkpoint.every=1",
             "--config.eval.every=100", "--config.eval.pass_k=0", "--config.metrics.tensorboard=False"]
    skip = {"workdir", "rl.iterations", "eval.every", "eval.pass_k"}
    for section, values in config.items():
        if not hasattr(values, "items"):
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in skip and value != _default(section, key):
                flags.append(f"--config.{name}={value}")
    return flags


def _default(section, key):
    from jaxrl_agent import config_lib

    return config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))[section][key]


def _launch(flags):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"))
    return subprocess.Popen([sys.executable, str(ROOT / "launch" / "tpu_run.py"), "--config",
                             "configs/calculator_tiny.py", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _records(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _task_records(path):
    """A JSONL of calculator task records (Task.to_dict form), plus two malformed lines."""
    from jaxrl_agent import data, envs

    env = envs.make("calculator")
    records = [env.sample_task(500 + i, 1 + i % 3).to_dict() for i in range(40)]
    data.write_jsonl(str(path), records)
    with open(path, "a") as f:
        f.write("not json\n" + json.dumps({"env": "calculator"}) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("tasks", ["procedural", "jsonl"])
def test_sigkill_then_resume_continues_the_same_schedule(tmp_path, tasks):
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    extra = [] if tasks == "procedural" else [f"--config.data.tasks={_task_records(tmp_path / 'tasks.jsonl')}"]
    reference = _launch(_flags(reference_dir) + extra)
    victim = _launch(_flags(killed_dir) + extra)
    # Kill the second run hard once it has logged its second RL iteration (its checkpoint may be
    # complete, in flight or not started: resume must cope with each).
    deadline = time.time() + 600
    while not any(r["stage"] == "rl" and r["step"] >= 2 for r in _records(killed_dir)):
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached RL iteration 2"
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]

    resumed = _launch(_flags(killed_dir) + extra + ["--config.resume=True"])
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]

    records = _records(killed_dir)
    resume = next(r for r in records if r["stage"] == "resume")
    from_iteration = resume["step"]
    assert resume["from_stage"] in ("rl", "sft_done") and 0 <= from_iteration <= 2
    after = [r for r in records[records.index(resume):] if r["stage"] == "rl"]
    assert [r["step"] for r in after] == list(range(from_iteration + 1, ITERATIONS + 1))
    expected = {r["step"]: r for r in _records(reference_dir) if r["stage"] == "rl"}
    for r in after:  # same tasks, versions and optimizer steps as the uninterrupted run
        ref = expected[r["step"]]
        assert (r["task_position"], r["version"], r["learner_step"]) == (ref["task_position"], ref["version"],
                                                                          ref["learner_step"]), r["step"]
        # The exact task sequence: the same records, in the same order, at every iteration.
        assert r.get("task_ids") == ref.get("task_ids"), r["step"]
    if tasks == "jsonl":
        data_record = next(r for r in records if r["stage"] == "data")
        assert data_record["task_records"] == 40
        assert data_record["skipped_records"] == {"not_json": 1, "missing_prompt": 1}
        assert all(len(r["task_ids"]) == 3 for r in after)
    assert any(r["stage"] == "rl_eval" and r["step"] == ITERATIONS for r in records)
