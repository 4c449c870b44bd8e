"""Configs and the launcher, run as a user would (subprocesses)."""

import glob
import os
import pathlib
import subprocess
import sys

import jax
import ml_collections
import pytest

from jaxrl_agent import config_lib, models
from tests import hf_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(glob.glob(str(ROOT / "configs" / "*.py")))


def _run(*args, devices=1):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "tpu_run.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_loads_locked_and_commented(path):
    config = config_lib.load_config(path)
    assert isinstance(config, ml_collections.ConfigDict) and config.is_locked
    with pytest.raises(AttributeError):
        config.no_such_field = 1
    models.ModelConfig.from_config_dict(config.model)
    # Every field assignment in the file carries a comment (derived values: the line above).
    lines = pathlib.Path(path).read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("config.") and " = " in stripped and "ConfigDict()" not in stripped \
                and not stripped.startswith("config = "):
            assert "#" in line or lines[i - 1].strip().startswith("#"), f"{path}:{i + 1} has no comment: {line}"


def test_launcher_runs_tiny_config():
    result = _run("--mode", "smoke", "--config", "configs/calculator_tiny.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "forward pass ok" in result.stdout and "'logits_shape': (2, 32, 120)" in result.stdout


def test_launcher_with_overrides_on_eight_devices():
    result = _run("--mode", "smoke", "--config", "configs/calculator_tiny.py", "--config.mesh.tensor=2", "--config.model.num_layers=2",
                  "--config.smoke.batch_size=4", devices=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'mesh': {'data': 1, 'fsdp': 4, 'tensor': 2}" in result.stdout


@pytest.mark.parametrize("override, named", [
    ("--config.nonexistent=1", "'nonexistent'"),
    ("--config.model.num_layrs=2", "did you mean --config.model.num_layers"),
])
def test_misspelled_override_fails_with_clear_message(override, named):
    result = _run("--mode", "smoke", "--config", "configs/calculator_tiny.py", override)
    assert result.returncode != 0
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_apply_overrides_sets_typed_values_on_a_copy_and_names_bad_ones():
    """`config_lib.apply_overrides`: a loaded config with `--config.a.b=v` / `--config.a.b v`
    overrides applied as the launcher's flags would (values typed like the fields they replace),
    on a copy; a misspelt key, a section, a value of the wrong type or a missing value is named."""
    base = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
    config = config_lib.apply_overrides(base, [
        "--config.rl.learning_rate=3e-4", "--config.rollout.group_size", "8", "--other=1",
        "--config.allocation.dynamic_sampling=True", "--config.sampler.decode_options=builtin", "--config.seed=3"])
    assert config.rl.learning_rate == 3e-4 and isinstance(config.rl.learning_rate, float)
    assert config.rollout.group_size == 8 and config.allocation.dynamic_sampling is True
    assert config.sampler.decode_options == "builtin" and config.seed == 3
    assert base.rollout.group_size == 4 and base.seed == 0  # the loaded config is unchanged
    with pytest.raises(config_lib.ConfigOverrideError, match="did you mean --config.rollout.group_size"):
        config_lib.apply_overrides(base, ["--config.rollout.group_sise=8"])
    with pytest.raises(config_lib.ConfigOverrideError, match="'rollout' is a section"):
        config_lib.apply_overrides(base, ["--config.rollout=8"])
    with pytest.raises(config_lib.ConfigOverrideError, match=r"--config.rollout.group_size='eight': expected int"):
        config_lib.apply_overrides(base, ["--config.rollout.group_size=eight"])
    with pytest.raises(config_lib.ConfigOverrideError, match="expected a value"):
        config_lib.apply_overrides(base, ["--config.seed"])


def test_launcher_reaches_eval_initial_and_names_a_bad_value(tmp_path):
    result = _run("--config", "configs/calculator_tiny.py", "--config.eval.initial=sometimes",
                  f"--config.workdir={tmp_path}")
    assert result.returncode != 0
    assert "eval.initial='sometimes': expected one of auto, true, false" in result.stderr
    assert "Traceback" not in result.stderr


def test_launcher_loads_hf_checkpoint(tmp_path):
    config = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=400)
    models.save_hf(str(tmp_path), config, models.init_params(config, jax.random.PRNGKey(0)))
    hf_reference.train_tiny_hf_tokenizer(tmp_path)
    result = _run("--mode", "smoke", "--config", "configs/hf_model.py", f"--config.checkpoint.hf_path={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'architecture': 'qwen3'" in result.stdout


def test_launcher_reports_bad_checkpoint_path(tmp_path):
    result = _run("--mode", "smoke", "--config", "configs/hf_model.py", f"--config.checkpoint.hf_path={tmp_path}/missing")
    assert result.returncode != 0
    assert "is not a folder" in result.stderr
