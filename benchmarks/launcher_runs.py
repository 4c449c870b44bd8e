"""Shared by the benchmarks that drive whole runs: the launcher as a subprocess, and its metrics."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(workdir: str, flags: list[str], config: str = "calculator_tiny") -> float:
    """Runs `launch/tpu_run.py` on configs/<config>.py in `workdir` with `flags`; wall seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), "--config",
                    os.path.join(ROOT, "configs", f"{config}.py"),
                    f"--config.workdir={workdir}", *flags],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def host_choices_path() -> str | None:
    """Where runs of the default config cache their host choices (beside its compilation cache,
    or JAX_COMPILATION_CACHE_DIR's): benchmarks that build engines themselves share the runs'."""
    sys.path.insert(0, ROOT)
    from jaxrl_agent import config_lib
    from jaxrl_agent.sampling import host_tuning

    config = config_lib.load_config(os.path.join(ROOT, "configs", "calculator_tiny.py"))
    return host_tuning.host_choices_path(config.get("compilation_cache_dir", ""))


def require_same_settings(flag: str, folder: str, expected: dict[str, tuple]) -> None:
    """Stops the benchmark when an earlier invocation's `folder`, reused through `flag`, ran other
    settings: `expected` maps each config key to (what it ran, what this invocation asks)."""
    differ = {k: v for k, v in expected.items() if v[0] != v[1]}
    if differ:
        raise SystemExit(f"{flag} {folder}: trained with other settings (key: (then, now)): {differ}")


def chosen(flag: str, value: str, known) -> list[str]:
    """The comma-separated names of `value` (a `flag`'s), each one of `known`; exits naming the others."""
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; expected some of {list(known)}")
    return names


def records(workdir: str) -> list[dict]:
    """The run's metrics.jsonl, one dict per record."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def standard_error(p: float, n: int) -> float:
    """The binomial standard error of a success rate `p` over `n` tasks."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def sft_elapsed_seconds(workdir: str) -> float:
    """The run time its SFT checkpoint records (what `rl.time_budget_minutes` counts on resume)."""
    sys.path.insert(0, ROOT)
    from jaxrl_agent import checkpoint

    saved = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=10)
    try:
        return float(saved.latest().elapsed_seconds)
    finally:
        saved.close()
