"""docs/losses.md: every public loss is in the table, and the composition example runs."""

import pathlib
import re

import numpy as np

from jaxrl_agent import losses

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text()


def test_every_public_function_is_documented():
    functions = [n for n in losses.__all__ if n[0].islower()]
    missing = [n for n in functions if f"`{n}" not in DOC]
    assert not missing, f"docs/losses.md lacks {missing}"


def test_custom_objective_example_runs_in_at_most_15_lines():
    block = re.search(r"```python\n(.*?)```", DOC, flags=re.S).group(1)
    assert len([line for line in block.splitlines() if line.strip()]) <= 15
    namespace = {}
    exec(compile(block, "docs/losses.md", "exec"), namespace)
    loss, metrics, grad = namespace["loss"], namespace["metrics"], namespace["grad"]
    assert np.isfinite(float(loss)) and grad.shape == (2, 4)
    np.testing.assert_allclose(metrics["length/mean_length"], 4.0)
    # IcePop keeps all tokens here (ratio e^0.2 is inside [0.5, 2]); the KL term is reported.
    assert float(metrics["masked_token_share"]) == 0.0 and "kl_k3/loss" in metrics
    assert np.all(np.asarray(grad) != 0)
