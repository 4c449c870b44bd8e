"""Several processes, one job (`jax.distributed` on localhost, gloo collectives on CPU): the
learner's global batch is every process's rows, so 2 processes x 4 devices train exactly as
1 process x 8 devices on the same trajectories."""

import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "distributed_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # three processes compile the same step (~1 min on 2 cores); CI's slow pass runs it
def test_two_processes_of_four_devices_train_as_one_process_of_eight(tmp_path):
    one = subprocess.run([sys.executable, str(WORKER), "--local_devices=8", f"--out={tmp_path / 'one.npz'}"],
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--processes=2", f"--process_id={i}", "--local_devices=4",
                               f"--port={port}", f"--out={tmp_path / 'two.npz'}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "process 1 of 2: 4 local devices of 8" in outputs[1][0]
    single, double = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    leaves = [k for k in single.files if k.startswith("arr_")]
    assert len(leaves) == len([k for k in double.files if k.startswith("arr_")]) > 0
    assert float(single["moved"]) > 1e-3  # the updates moved the parameters: the comparison is not vacuous
    for key in leaves:
        np.testing.assert_allclose(double[key], single[key], atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(double["loss"]), float(single["loss"]), rtol=1e-5)
