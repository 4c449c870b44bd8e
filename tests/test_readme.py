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
