"""Every notebook's code cells run on CPU (install cells, the lines starting with '!' or '%', are skipped)."""

import glob
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(glob.glob(str(ROOT / "notebooks" / "*.ipynb")))


def _run_notebook(path):
    nb = json.loads(pathlib.Path(path).read_text())
    assert "colab-badge" in "".join(nb["cells"][0]["source"]), "first cell carries the Colab badge"
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
        exec(compile(source, f"{path}#cell{i}", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: pathlib.Path(p).name)
def test_notebook_runs(path):
    namespace = _run_notebook(path)
    if path.endswith("01_model_and_losses.ipynb"):
        assert float(np.max(np.abs(namespace["logits"] - namespace["full"]))) < 1e-5
        assert np.isfinite(float(namespace["loss"]))
    if path.endswith("02_rl_loop.ipynb"):
        stages = [r["stage"] for r in namespace["records"]]
        assert stages.count("rl") == 3 and "rl_eval" in stages
        assert pathlib.Path(namespace["png"]).exists()
