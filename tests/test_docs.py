"""docs/: the guide's examples run as written, and the configuration reference is complete."""

import pathlib
import re

from jaxrl_agent import config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guide.md").read_text()


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", GUIDE, flags=re.S)


def test_config_reference_is_the_default_configs_comments():
    """docs/config.md is generated from configs/calculator_tiny.py: every key, its value, its comment."""
    expected = config_lib.reference_markdown(str(ROOT / "configs" / "calculator_tiny.py"))
    assert (ROOT / "docs" / "config.md").read_text() == expected, \
        "docs/config.md is stale: regenerate it with config_lib.reference_markdown('configs/calculator_tiny.py')"
    config = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
    for section, value in config.items():
        keys = value.keys() if hasattr(value, "keys") else [None]
        for key in keys:
            name = f"{section}.{key}" if key else section
            assert f"| `{name}` |" in expected, name


def test_model_api_example_runs():
    block = next(b for b in _python_blocks() if "models.init_params" in b and "decode_step" in b)
    namespace = {}
    exec(compile(block, "docs/guide.md", "exec"), namespace)
    assert namespace["logits"].shape == (1, 4, 128)
    assert namespace["step_logits"].shape == (1, 128)
    assert namespace["packed"].shape == (1, 4, 128)


def test_environment_examples_run():
    blocks = [b for b in _python_blocks() if "envs." in b and "datasets" not in b and "train_and_evaluate" not in b
              and "agent.load" not in b]
    assert len(blocks) == 2
    for block in blocks:
        namespace = {}
        exec(compile(block, "docs/guide.md", "exec"), namespace)
    custom = next(b for b in blocks if "ReverseEnv" in b)
    assert len(custom.strip().splitlines()) <= 40
    assert namespace["final"].info["success"]


def test_deployment_example_runs(tmp_path, monkeypatch):
    """The guide's `agent` example, on a run folder holding only its config (no checkpoint yet:
    `agent.load` then deploys the config's initial parameters)."""
    block = next(b for b in _python_blocks() if "agent.load" in b)
    config = config_lib.load_config(str(ROOT / "configs" / "chain_tiny.py"))
    (tmp_path / "runs" / "chain_tiny").mkdir(parents=True)
    (tmp_path / "runs" / "chain_tiny" / "config.json").write_text(config.to_json())
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block, "docs/guide.md", "exec"), namespace)
    result = namespace["result"]
    assert result.transcript and "Q: Follow the chain from" in result.text()
    assert result.trajectory.longest_segment <= config.rollout.max_context


def test_sampling_example_runs():
    block = next(b for b in _python_blocks() if "LocalSampler" in b)
    namespace = {}
    exec(compile(block, "docs/guide.md", "exec"), namespace)
    completion, later = namespace["completion"], namespace["later"]
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) >= 1
    assert set(completion.versions) == {0} and set(later.versions) == {1}


def test_losses_example_runs():
    block = next(b for b in _python_blocks() if "default_objective_spec" in b)
    namespace = {}
    exec(compile(block, "docs/guide.md", "exec"), namespace)
    assert namespace["objective"].name
