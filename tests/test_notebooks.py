"""The notebooks: each opens in Colab from its own path, installs itself on a fresh runtime, says
which runtime it is on, and ships with its outputs; in CI each runs in a real Jupyter kernel
(`-m notebooks`; tests/notebook_kernel.py)."""

import json
import pathlib
import re
import sys
import tomllib
import types

import pytest

from tests import notebook_kernel

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REPOSITORY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _source(cell):
    return "".join(cell["source"])


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_model_and_losses.ipynb", "02_rl_loop.ipynb",
                                           "03_your_env_and_loss.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_badge_install_cell_runtime_cell_and_saved_outputs(path, monkeypatch, tmp_path):
    cells = _cells(path)
    owner_repo = REPOSITORY.removeprefix("https://github.com/")
    badge = re.search(r"\]\((https://colab\.research\.google\.com/(?!assets/)[^)]*)\)", _source(cells[0]))
    assert badge and badge.group(1) == f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/{path.name}"
    assert not any(line.lstrip().startswith(("!", "%")) for c in cells if c["cell_type"] == "code"
                   for line in c["source"]), "shell magics do not run outside IPython; the install cell is Python"
    install = _source(cells[1])
    assert f'REPOSITORY = "{REPOSITORY}"' in install
    # The install cell on a fresh Colab runtime: clones the repository into /content and installs it.
    commands = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr("subprocess.run", lambda command, **kwargs: commands.append(command) or
                        types.SimpleNamespace(returncode=0, stdout="", stderr=""))
    monkeypatch.setattr("pathlib.Path.exists", lambda self: False)
    namespace = {}
    exec(compile(install, f"{path.name}#install", "exec"), namespace)
    assert commands[0] == ["git", "clone", "--depth=1", REPOSITORY, "/content/jaxrl_agent"]
    assert commands[1][1:] == ["-m", "pip", "install", "-q", "-e", "/content/jaxrl_agent"]
    assert str(namespace["ROOT"]) == "/content/jaxrl_agent" and "/content/jaxrl_agent" in sys.path
    sys.path.remove("/content/jaxrl_agent")
    monkeypatch.undo()
    # A cell that names the runtime; every code cell saved with its outputs, plots inline.
    assert "jax.devices()" in _source(cells[2])
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "saved without running"
    assert "devices: [" in "".join("".join(o.get("text", "")) for o in code[1]["outputs"])
    if path.name != "01_model_and_losses.ipynb":
        assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]), "no inline plot"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_jupyter_kernel(path):
    nb = notebook_kernel.execute(path)
    text = notebook_kernel.stream_text(nb)
    assert "jaxrl_agent installed from" in text and "devices: [" in text
    if path.name == "01_model_and_losses.ipynb":
        assert float(re.search(r"max \|prefill - forward\| = (\S+)", text).group(1)) < 1e-5
        assert re.search(r"loss -?\d", text)
    else:
        assert notebook_kernel.images(nb) >= 1
    if path.name == "03_your_env_and_loss.ipynb":
        before, after = map(float, re.search(r"after SFT (\S+) -> after RL (\S+)", text).groups())
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
