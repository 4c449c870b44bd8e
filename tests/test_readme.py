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
    blocks = [b for b in _python_blocks() if "envs." in b and "datasets" not in b]
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
