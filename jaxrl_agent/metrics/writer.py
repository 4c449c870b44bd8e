"""The metrics writer: every record to the console, to `metrics.jsonl` and to TensorBoard."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np


class MetricsWriter:
    """Every record goes to a console line, to workdir/metrics.jsonl (one JSON object per record,
    with `stage`, `step` and `time`) and, when enabled, to TensorBoard event files under
    workdir/tensorboard as scalars tagged `<stage>/<key>` (nested dicts flattened with `/`)."""

    def __init__(self, workdir: str, quiet: bool = False, tensorboard: bool = False):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.quiet = quiet
        self._tb = None
        if tensorboard:
            # TensorBoard's own event writer and protos: no TensorFlow session or device involved.
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._pb = (event_pb2, summary_pb2)
            self._tb = EventFileWriter(os.path.join(workdir, "tensorboard"))

    def write(self, stage: str, step: int, metrics: dict[str, Any], *, console: str | None = None) -> None:
        """Writes one record; `console` replaces the full line on the console (the record's file and
        TensorBoard entries are complete either way)."""
        record = {"stage": stage, "step": step, "time": time.time(),
                  **{k: plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            event_pb2, summary_pb2 = self._pb
            values = [summary_pb2.Summary.Value(tag=f"{stage}/{key}", simple_value=value)
                      for key, value in flatten(metrics).items()]
            self._tb.add_event(event_pb2.Event(wall_time=record["time"], step=int(step),
                                               summary=summary_pb2.Summary(value=values)))
            self._tb.flush()
        if not self.quiet and console is not None:
            print(console, flush=True)
        elif not self.quiet:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                             if k not in ("stage", "step", "time") and not isinstance(v, (list, dict)))
            print(f"[{stage} {step}] {shown}", flush=True)

    def read(self) -> list[dict]:
        """Every record written to metrics.jsonl so far (by all processes of a resumed run)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as {'a/b': value}; strings and lists are left out."""
    out = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def plain(value):
    """JSON-able: numbers as float, containers and strings as they are."""
    if isinstance(value, (dict, list, tuple, str)):
        return value
    return float(value)
