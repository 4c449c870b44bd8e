"""Shared by the benchmarks that drive whole runs: the launcher as a subprocess, and its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(workdir: str, flags: list[str], config: str = "calculator_tiny") -> float:
    """Runs `launch/tpu_run.py` on configs/<config>.py in `workdir` with `flags`; wall seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), "--config",
                    os.path.join(ROOT, "configs", f"{config}.py"), f"--config.workdir={workdir}", *flags],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def records(workdir: str) -> list[dict]:
    """The run's metrics.jsonl, one dict per record."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
