"""Where records go: `metrics.jsonl` (every field), scalar sinks (TensorBoard, Weights & Biases)
and the console, from process 0 only.

Scalar sinks follow `clu.metric_writers`' contract (`write_scalars(step, scalars)`,
`write_texts`, `write_hparams`, `flush`, `close`), so a `clu` writer can be passed in as a sink; the
built-in ones write TensorBoard event files with TensorBoard's own protos (no TensorFlow import)
and log to `wandb` when `metrics.wandb_project` is set (the `[wandb]` extra).

Steps and tags. Every record carries its stage's own counter (`step`: the SFT update, the RL
iteration) and `global_step`, one counter across stages (SFT updates, then `sft.steps` + RL
iteration). Sinks are written at `global_step` under tags that do not repeat the stage: held-out
evaluation is `eval/...` whether it ran before training, after SFT or during RL, so `eval/success`
is one curve from start to end; SFT's and RL's training figures are `sft/...` and `rl/...`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from jaxrl_agent.metrics.console import Console

# Stages whose record keys already name what they are (`eval/...`): their tags carry no prefix.
EVAL_STAGES = ("initial_eval", "sft_eval", "rl_eval")


class ScalarSink(Protocol):
    """`clu.metric_writers.MetricWriter`'s contract (the methods the trainer calls)."""

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...

    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars, texts and hparams as TensorBoard event files under `logdir`."""

    def __init__(self, logdir: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(logdir)

    def _add(self, step: int, summary) -> None:
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        if values:
            self._add(step, self._summary_pb2.Summary(value=values))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        from tensorboard.plugins.text import summary_v2

        for tag, text in texts.items():
            self._add(step, summary_v2.text_pb(tag, text))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from tensorboard.plugins.hparams import summary_v2

        self._add(0, summary_v2.hparams_pb(dict(hparams)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Scalars, texts and hparams to a Weights & Biases run (`pip install "jaxrl_agent[wandb]"`)."""

    def __init__(self, project: str, *, name: str | None = None, directory: str | None = None,
                 mode: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ImportError("metrics.wandb_project is set but wandb is not installed: "
                              'pip install "jaxrl_agent[wandb]" (or set metrics.wandb_project="")') from None
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name or None, dir=directory, mode=mode or None)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._run.log(dict(texts), step=int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._run.config.update(dict(hparams), allow_val_change=True)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def tags(stage: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric leaves as stage-free sink tags (see the module docstring)."""
    prefix = "" if stage in EVAL_STAGES else f"{stage}/"
    return {f"{prefix}{key}": value for key, value in flatten(metrics).items()}


def hparams(config) -> dict[str, Any]:
    """A config's leaves as {'a.b': bool | int | float | str} (the form TensorBoard's hparams take)."""
    out = {}

    def visit(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if hasattr(value, "items"):
                visit(value, name + ".")
            elif isinstance(value, (bool, int, float, str)):
                out[name] = value
            elif value is not None:
                out[name] = str(value)

    visit(config, "")
    return out


class MetricsWriter:
    """A run's records: every field to workdir/metrics.jsonl (one JSON object per record, with
    `stage`, `step`, `global_step` and `time`), numeric leaves to the scalar sinks, and a line (or
    the caller's `console` text) to the console. Only process 0 writes (`process_index` defaults to
    `jax.process_index()`); on other processes every method is a no-op."""

    def __init__(self, workdir: str, quiet: bool = False, tensorboard: bool = False, *,
                 wandb_project: str = "", sinks: Sequence[ScalarSink] = (), process_index: int | None = None,
                 console: Console | None = None):
        if process_index is None:
            import jax

            process_index = jax.process_index()
        self.active = process_index == 0
        self.process_index = process_index
        self.workdir = workdir
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.console = console if console is not None else Console(enabled=self.active and not quiet)
        self.sinks: list[ScalarSink] = []
        if not self.active:
            return
        os.makedirs(workdir, exist_ok=True)
        if tensorboard:
            self.sinks.append(TensorBoardWriter(os.path.join(workdir, "tensorboard")))
        if wandb_project:
            self.sinks.append(WandbWriter(wandb_project, name=os.path.basename(os.path.abspath(workdir)),
                                          directory=workdir))
        self.sinks.extend(sinks)

    @property
    def quiet(self) -> bool:
        return not self.console.enabled

    def write(self, stage: str, step: int, metrics: Mapping[str, Any], *, global_step: int | None = None,
              console: str | None = None) -> None:
        """Writes one record; `console` replaces the default line on the console (the file and the
        sinks get the whole record either way)."""
        if not self.active:
            return
        global_step = step if global_step is None else global_step
        record = {"stage": stage, "step": step, "global_step": global_step, "time": time.time(),
                  **{k: plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = tags(stage, metrics)
        for sink in self.sinks:
            sink.write_scalars(global_step, scalars)
            sink.flush()
        if console is None:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                             if k not in ("stage", "step", "global_step", "time")
                             and not isinstance(v, (list, dict)))
            console = f"[{stage} {step}] {shown}"
        self.console.line(console)

    def write_episodes(self, iteration: int, groups) -> str:
        """Appends every episode of `groups` (lists of `Trajectory`) as one JSON line
        ({"iteration", "trajectory"}) to workdir/episodes.jsonl — every process its own file
        (episodes.p<i>.jsonl for process i > 0), as each trains its own groups. Returns the path."""
        name = "episodes.jsonl" if self.process_index == 0 else f"episodes.p{self.process_index}.jsonl"
        path = os.path.join(self.workdir, name)
        os.makedirs(self.workdir, exist_ok=True)
        with open(path, "a") as f:
            for group in groups:
                for t in group:
                    f.write(json.dumps({"iteration": iteration, "trajectory": t.to_dict()}, default=float) + "\n")
        return path

    def write_config(self, config) -> str | None:
        """workdir/config.json (the resolved config, overrides applied) and the sinks' hparams."""
        if not self.active:
            return None
        path = os.path.join(self.workdir, "config.json")
        with open(path, "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
        flat = hparams(config)
        for sink in self.sinks:
            sink.write_hparams(flat)
            sink.flush()
        return path

    def say(self, text: str) -> None:
        """A message for the person watching (warnings); not a record."""
        if self.active:
            self.console.line(text)

    def read(self) -> list[dict]:
        """Every record in metrics.jsonl so far (all segments of a resumed run); a torn last line
        (a run killed mid-write) is skipped."""
        if not os.path.exists(self.path):
            return []
        records = []
        with open(self.path) as f:
            for line in f:
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        return records

    def close(self) -> None:
        self.console.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
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
