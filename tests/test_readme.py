"""README's code examples run as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_model_api_example_runs():
    block = next(b for b in _python_blocks() if "models.init_params" in b)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (1, 4, 128)
    assert namespace["step_logits"].shape == (1, 128)
    assert namespace["packed"].shape == (1, 4, 128)


def test_environment_examples_run():
    blocks = [b for b in _python_blocks() if "envs." in b and "datasets" not in b and "train_and_evaluate" not in b]
    assert len(blocks) == 2
    for block in blocks:
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)
    custom = next(b for b in blocks if "ReverseEnv" in b)
    assert len(custom.strip().splitlines()) <= 40
    assert namespace["final"].info["success"]


def test_sampling_example_runs():
    block = next(b for b in _python_blocks() if "LocalSampler" in b)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    completion, later = namespace["completion"], namespace["later"]
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) >= 1
    assert set(completion.versions) == {0} and set(later.versions) == {1}


def test_research_script_example_runs(tmp_path, monkeypatch):
    """README's "Bring your own" script: a pure loss, a reward component and a task file, trained."""
    import json

    block = next(b for b in _python_blocks() if "objective_from_loss" in b and "train_and_evaluate" in b)
    assert len([line for line in block.splitlines() if line.strip()]) <= 20
    monkeypatch.chdir(tmp_path)
    block = block.replace('"configs/calculator_tiny.py"', repr(str(ROOT / "configs" / "calculator_tiny.py")))
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    records = [json.loads(line) for line in open(namespace["path"])]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and all("reward/brevity" in r for r in rl)
    assert next(r for r in records if r["stage"] == "data")["task_records"] == 64
    assert all(len(r["task_ids"]) == 8 for r in rl)
