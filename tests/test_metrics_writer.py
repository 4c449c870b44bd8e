"""The metrics writer: one global step, stage-free tags, sinks with clu's contract, process-0 only,
config.json, the wandb sink, the console."""

import inspect
import io
import json
import sys
import types

import ml_collections
import pytest

from jaxrl_agent import metrics
from jaxrl_agent.metrics import writer as writer_lib


class RecordingSink:
    def __init__(self):
        self.scalars, self.hparams, self.closed = [], [], False

    def write_scalars(self, step, scalars):
        self.scalars.append((step, dict(scalars)))

    def write_texts(self, step, texts):
        pass

    def write_hparams(self, hparams):
        self.hparams.append(dict(hparams))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def _config():
    config = ml_collections.ConfigDict({"rl": {"objective": "ppo", "kl_coef": 0.0}, "seed": 3, "workdir": "w"})
    return config


def test_records_carry_both_steps_and_sinks_get_stage_free_tags(tmp_path):
    sink = RecordingSink()
    w = metrics.MetricsWriter(str(tmp_path), sinks=[sink], process_index=0, console=metrics.Console(enabled=False))
    w.write("initial_eval", 0, {"eval/success": 0.1})
    w.write("sft_eval", 200, {"eval/success": 0.5}, global_step=200)
    w.write("rl", 7, {"loss": 1.5, "finish_reasons": {"answer": 3}, "task_ids": ["a"]}, global_step=207)
    w.write("rl_eval", 7, {"eval/success": 0.6}, global_step=207)
    records = w.read()
    assert [(r["stage"], r["step"], r["global_step"]) for r in records] == \
        [("initial_eval", 0, 0), ("sft_eval", 200, 200), ("rl", 7, 207), ("rl_eval", 7, 207)]
    assert records[2]["task_ids"] == ["a"]  # the file keeps what the sinks cannot
    assert [(s, v) for s, v in sink.scalars if "eval/success" in v] == \
        [(0, {"eval/success": 0.1}), (200, {"eval/success": 0.5}), (207, {"eval/success": 0.6})]
    assert sink.scalars[2] == (207, {"rl/loss": 1.5, "rl/finish_reasons/answer": 3.0})
    path = w.write_config(_config())
    assert json.load(open(path))["rl"]["objective"] == "ppo"
    assert sink.hparams == [{"rl.objective": "ppo", "rl.kl_coef": 0.0, "seed": 3, "workdir": "w"}]
    w.close()
    assert sink.closed


def test_only_process_zero_writes(tmp_path):
    sink, out = RecordingSink(), io.StringIO()
    w = metrics.MetricsWriter(str(tmp_path / "run"), tensorboard=True, sinks=[sink], process_index=1,
                              console=metrics.Console(enabled=True, stream=out))
    w.write("rl", 1, {"loss": 1.0})
    w.say("warning: something")
    assert w.write_config(_config()) is None
    w.close()
    assert not (tmp_path / "run").exists() and sink.scalars == [] and out.getvalue() == ""
    assert metrics.MetricsWriter(str(tmp_path / "run"), process_index=1).console.enabled is False


def test_sinks_have_clus_metric_writer_contract():
    """Our sinks implement every method of clu.metric_writers.MetricWriter the trainer calls, with
    its parameter names (so a clu writer can be passed as a sink and ours used where clu's are)."""
    pytest.importorskip("clu")
    from clu.metric_writers import interface

    for name in ("write_scalars", "write_texts", "write_hparams", "flush", "close"):
        theirs = list(inspect.signature(getattr(interface.MetricWriter, name)).parameters)
        for ours in (writer_lib.TensorBoardWriter, writer_lib.WandbWriter, writer_lib.ScalarSink):
            assert list(inspect.signature(getattr(ours, name)).parameters) == theirs, (ours, name)


def test_wandb_sink_logs_at_the_global_step(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        config = types.SimpleNamespace(update=lambda values, allow_val_change: calls.append(("config", values)))

        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = metrics.MetricsWriter(str(tmp_path / "runs" / "mine"), wandb_project="proj", process_index=0,
                              console=metrics.Console(enabled=False))
    w.write_config(_config())
    w.write("rl_eval", 3, {"eval/success": 0.25}, global_step=203)
    w.close()
    assert calls[0] == ("init", {"project": "proj", "name": "mine", "dir": str(tmp_path / "runs" / "mine"),
                                 "mode": None})
    assert ("config", {"rl.objective": "ppo", "rl.kl_coef": 0.0, "seed": 3, "workdir": "w"}) in calls
    assert ("log", 203, {"eval/success": 0.25}) in calls and calls[-1] == ("finish",)


def test_wandb_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r'pip install "jaxrl_agent\[wandb\]"'):
        writer_lib.WandbWriter("proj")


def test_console_prints_lines_and_draws_a_bar_only_when_asked():
    out = io.StringIO()
    console = metrics.Console(stream=out)  # progress=None: a bar only on a terminal; StringIO is not one
    console.bar("rl", 3)
    console.advance(1, {"success": 0.5})
    console.line("[rl 1/3] success=0.500")
    console.close()
    assert out.getvalue() == "[rl 1/3] success=0.500\n"
    out = io.StringIO()
    console = metrics.Console(stream=out, progress=True)
    console.bar("rl", 3)
    console.advance(1, {"success": 0.5})
    console.detail("eval 1/2")
    console.line("[rl 1/3] success=0.500")
    console.close()
    text = out.getvalue()
    assert "rl" in text and "1/3" in text and "success=0.5" in text and "[rl 1/3] success=0.500\n" in text


def test_a_torn_last_line_is_skipped_on_read(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path), process_index=0, console=metrics.Console(enabled=False))
    w.write("rl", 1, {"loss": 1.0})
    with open(w.path, "a") as f:
        f.write('{"stage": "rl", "st')
    assert [r["step"] for r in w.read()] == [1]


def test_metrics_config_keys_are_validated(monkeypatch):
    import importlib.util
    import pathlib

    from jaxrl_agent import build, config_lib

    config = config_lib.load_config(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "calculator_tiny.py"))
    config.metrics.progress = "sometimes"
    with pytest.raises(build.ConfigError, match=r"metrics.progress='sometimes': expected one of \('auto', 'on', 'off'\)"):
        build.validate_config(config)
    config.metrics.progress = "auto"
    config.metrics.wandb_project = "proj"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(build.ConfigError, match=r'needs wandb: pip install "jaxrl_agent\[wandb\]"'):
        build.validate_config(config)
