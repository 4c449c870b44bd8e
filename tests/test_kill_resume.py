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


def _kill_after_rl_step(run, workdir, step, timeout_s=600):
    """SIGKILLs `run` once its metrics hold RL iteration `step` (failing if it exits or never gets there)."""
    deadline = time.time() + timeout_s
    while not any(r["stage"] == "rl" and r["step"] >= step for r in _records(workdir)):
        assert run.poll() is None, run.stderr.read()[-3000:]
        assert time.time() < deadline, f"the run never reached RL iteration {step}"
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)
    run.wait()


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
    _kill_after_rl_step(victim, killed_dir, 2)
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


def _episodes(workdir):
    path = workdir / "episodes.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


@pytest.mark.slow
def test_sigkill_during_an_async_run_continues_its_partial_rollouts_from_their_saved_tokens(tmp_path):
    """An asynchronous run with partial rollouts (token budget 8 per episode per iteration) is
    killed with SIGKILL, then resumed: every episode the checkpoint held — suspended ones with their
    tokens, finished ones of unfinished groups — is trained once, the suspended ones continuing from
    their saved ids, log-probs and versions; none lost, none duplicated."""
    from jaxrl_agent import checkpoint

    workdir = tmp_path / "run"
    flags = _flags(workdir) + [
        "--config.rollout.schedule=async", "--config.rollout.token_budget=8", "--config.rollout.max_tokens_per_turn=24",
        "--config.rollout.max_turns=3", "--config.rollout.max_staleness=100", "--config.checkpoint.keep=100",
        "--config.metrics.episodes_log=True", "--config.sft.steps=2"]
    victim = _launch(flags)
    _kill_after_rl_step(victim, workdir, 3)
    before = _episodes(workdir)

    resumed = _launch(flags + ["--config.resume=True", "--config.rl.iterations=9"])
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    records = _records(workdir)
    resume = next(r for r in records if r["stage"] == "resume")
    assert resume["from_stage"] == "rl" and resume["step"] >= 2
    saved_at = resume["step"]
    sft_steps = 2
    checkpointer = checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=100)
    saved = checkpointer.select(sft_steps + saved_at)
    held = saved.replay
    final = checkpointer.select(sft_steps + 9).replay
    checkpointer.close()

    partial = {(f"g{g['index']}", int(i)): p for g in held["groups"] for i, p in g["partial"].items()}
    done = {(f"g{g['index']}", int(i)): t for g in held["groups"] for i, t in g["done"].items()}
    assert partial, "the checkpoint held no suspended episode"
    trained_before = [e["trajectory"] for e in before if e["iteration"] <= saved_at]
    trained_after = [e["trajectory"] for e in _episodes(workdir)[len(before):]]
    keys = [(t["group_id"], t["sample_index"]) for t in trained_before + trained_after]
    assert len(keys) == len(set(keys)), "an episode was trained twice"
    after = {(t["group_id"], t["sample_index"]): t for t in trained_after}
    still_held = {(f"g{g['index']}", int(i)) for g in final["groups"]
                  for i in range(g["size"])}
    for key, p in partial.items():
        if key in still_held:
            continue
        t = after[key]  # not lost: trained after the resume ...
        n = len(p["tokens"])
        assert t["tokens"][:n] == p["tokens"], key  # ... continuing from the saved ids,
        assert t["policy_version"][:n] == p["policy_version"], key  # the saved versions
        assert t["sampler_logprobs"][:n] == p["sampler_logprobs"], key  # and log-probs
        resumed_versions = [v for v, m in zip(t["policy_version"][n:], t["loss_mask"][n:]) if m]
        assert resumed_versions and min(resumed_versions) >= saved.version  # then the restored weights' own
    for key, t in done.items():
        if key not in still_held:
            assert after[key]["tokens"] == t["tokens"] and after[key]["sampler_logprobs"] == t["sampler_logprobs"]
    first_rl = next(r for r in records[records.index(resume):] if r["stage"] == "rl")
    assert first_rl["replay/resumed_partials"] == len(partial)
    assert len(partial) - len(still_held & set(partial)) >= 1
