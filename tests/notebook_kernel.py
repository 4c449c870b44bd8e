"""Runs notebooks in a real Jupyter kernel (nbclient + ipykernel), as Colab or Jupyter would.

  python tests/notebook_kernel.py [notebooks/NAME.ipynb ...]   # re-executes and saves the outputs

The kernel is this interpreter (`sys.executable`), whatever kernelspecs the machine has installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _this_interpreter_as_python3():
    with tempfile.TemporaryDirectory() as jupyter_path:
        kernel = pathlib.Path(jupyter_path) / "kernels" / "python3"
        kernel.mkdir(parents=True)
        (kernel / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3", "language": "python"}))
        saved = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = jupyter_path + (os.pathsep + saved if saved else "")
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = saved


def execute(path, timeout: int = 900):
    """The executed notebook (nbformat node); raises nbclient's CellExecutionError on a failing cell."""
    import nbformat
    from nbclient import NotebookClient

    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    with _this_interpreter_as_python3():
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def stream_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))


if __name__ == "__main__":
    import nbformat

    for name in sys.argv[1:] or sorted(str(p) for p in (ROOT / "notebooks").glob("*.ipynb")):
        executed = execute(name)
        nbformat.write(executed, name)
        print(f"executed and saved {name}: {images(executed)} image(s)")
