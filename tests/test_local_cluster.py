"""Several processes, one job, through `launch/local_cluster.py` (`jax.distributed` on localhost):
a 2-process run trains and reports once, from process 0; killing one process stops the job
promptly, naming it, instead of hanging."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "launch" / "local_cluster.py"
TINY = ["--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
        "--config.sampler.max_concurrent_decodes=8", "--config.rollout.prompts_per_iteration=2",
        "--config.rollout.group_size=2", "--config.rollout.max_tokens_per_turn=32", "--config.sft.steps=3",
        "--config.sft.batch_size=4", "--config.eval.tasks_per_difficulty=2", "--config.env.eval_difficulties=1",
        "--config.eval.every=0", "--config.rl.time_budget_minutes=0", "--config.metrics.tensorboard=False",
        "--config.rollout.drop_zero_advantage_groups=False"]  # every group trains (a tiny policy earns nothing)


def _cluster(workdir, *extra, processes=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return [sys.executable, str(CLUSTER), f"-n={processes}", "--local_devices=2", "--", "--config", str(ROOT / "configs" / "calculator_tiny.py"),
            f"--config.workdir={workdir}", *TINY, *extra], env


def _children(pid):
    """Pids whose parent is `pid`, oldest first."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                kids.append((int(stat[19]), int(entry)))
    return [p for _, p in sorted(kids)]


@pytest.mark.slow  # two training processes on 2 cores (~2 min); CI's slow pass runs it
def test_a_two_process_run_trains_and_reports_once_from_process_zero(tmp_path):
    command, env = _cluster(tmp_path / "run", "--config.rl.iterations=2")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    stages = [r["stage"] for r in records]
    assert stages.count("start") == 1 and stages.count("rl") == 2, stages  # one writer
    start = records[stages.index("start")]
    assert start["processes"] == 2 and start["devices"] == 4  # 2 simulated CPU devices each
    rl = [r for r in records if r["stage"] == "rl"]
    assert all(r["trained_tokens"] > 0 and r["learner_step"] > 0 for r in rl), rl  # the global step ran
    # The job's numbers: each process sampled 1 of the 2 prompts (x 2 samples); the record sums them.
    assert all(r["rollouts"] == 4 and sum(r["finish_reasons"].values()) == 4 for r in rl), rl
    assert any(r["stage"] == "rl_eval" for r in records)
    assert (tmp_path / "run" / "checkpoints").exists()
    assert "metrics written to" in done.stdout and "[1] metrics written" not in done.stderr


@pytest.mark.slow  # ~1 min; CI's slow pass runs it
def test_killing_one_process_stops_the_job_within_a_minute_and_a_restart_resumes(tmp_path):
    command, env = _cluster(tmp_path / "run", "--config.rl.iterations=1000", "--config.checkpoint.every=1")
    cluster = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and cluster.poll() is None:
        # Past RL iteration 2: iteration 1's checkpoint is written (it follows that iteration's record).
        if metrics.exists() and any(json.loads(line)["stage"] == "rl" and json.loads(line)["step"] >= 2
                                    for line in open(metrics)):
            break
        time.sleep(1)
    assert cluster.poll() is None, cluster.communicate()[1][-3000:]
    workers = _children(cluster.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    killed = time.monotonic()
    out, err = cluster.communicate(timeout=120)
    assert time.monotonic() - killed < 60
    assert cluster.returncode != 0
    assert "process 1 killed by signal 9" in err and "--config.resume=True" in err
    assert all(not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in workers)
    # The restart, as the message says: both processes continue from the last checkpoint.
    done_steps = [json.loads(line)["step"] for line in open(metrics) if json.loads(line)["stage"] == "rl"]
    command, env = _cluster(tmp_path / "run", f"--config.rl.iterations={max(done_steps) + 1}", "--config.resume=True")
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-4000:]
    records = [json.loads(line) for line in open(metrics)]
    resumed = [r for r in records if r["stage"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["from_stage"] == "rl"
    assert any(r["stage"] == "rl" and r["step"] == max(done_steps) + 1 for r in records)


def _slurm_port():
    """A free port in the range jax derives from SLURM_JOB_ID (61440 + job id % 4096), and that id."""
    import random
    import socket

    for _ in range(100):
        job_id = random.randrange(4096)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job_id))
            except OSError:
                continue
        return job_id
    raise AssertionError("no free port in jax's SLURM range")


@pytest.mark.slow  # two training processes on 2 cores (~1 min); CI's slow pass runs it
def test_distributed_reads_slurm_variables_as_on_a_cluster(tmp_path):
    """README's SLURM command: `srun ... python launch/tpu_run.py --distributed`, every process
    finding the coordinator, the job size and its place in SLURM's variables. Here two local
    processes get the variables srun would set."""
    job_id = _slurm_port()
    workdir = tmp_path / "run"
    processes = []
    for rank in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_NODES="1")
        processes.append(subprocess.Popen(
            [sys.executable, str(ROOT / "launch" / "tpu_run.py"), "--distributed", "--config",
             str(ROOT / "configs" / "calculator_tiny.py"), f"--config.workdir={workdir}", "--config.rl.iterations=1",
             *TINY], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=900) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    start = next(r for r in records if r["stage"] == "start")
    assert start["processes"] == 2 and start["devices"] == 4
    assert [r["rollouts"] for r in records if r["stage"] == "rl"] == [4]  # both processes' episodes
