"""Decode options chosen on the host: measured once, cached by host and shape, the fastest per
row count, overridable; they change speed, never tokens (tests/sampling/test_engine.py)."""

import json

import jax
import pytest

from jaxrl_agent import models, tokenizer as tok
from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams, host_tuning
from jaxrl_agent.sampling import engine as engine_lib

TOKENIZER = tok.CharTokenizer()
CONFIG = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=1, hidden_size=32, num_heads=2,
                            num_kv_heads=1, head_dim=16, intermediate_size=64)
PARAMS = models.init_params(CONFIG, jax.random.PRNGKey(0))


def _engine(slots=32, **kwargs):
    return AgentEngine(CONFIG, PARAMS, TOKENIZER, max_concurrent_decodes=slots, max_prefill_length=16,
                       max_cache_length=64, steps_per_call=2, stop_token_ids=[], **kwargs)


@pytest.fixture(autouse=True)
def _host_load_unknown(monkeypatch):
    """Other processes' CPU share reads as unknown (no re-measurement) unless a test says otherwise:
    the tests beside these (pytest-xdist) would otherwise make it vary from run to run."""
    monkeypatch.setattr(host_tuning, "_host_busy_seconds", lambda: None)


def _fake_times(monkeypatch, fastest):
    """decode_step_seconds that makes `fastest[regime]` the fastest set; counts its calls."""
    calls = []

    def timed(self, options, rows, **_):
        regime = "small" if rows <= engine_lib.SMALL_DECODE_ROWS else "large"
        name = next(n for n, o in engine_lib.DECODE_OPTION_SETS.items() if o == options)
        calls.append((regime, name))
        return 0.001 if name == fastest[regime] else 0.002

    monkeypatch.setattr(AgentEngine, "decode_step_seconds", timed)
    return calls


def test_auto_picks_the_fastest_set_per_row_count_then_reads_it_from_the_cache(tmp_path, monkeypatch):
    cache = str(tmp_path / "host_choices.json")
    calls = _fake_times(monkeypatch, {"large": "xla_defaults", "small": "fast_minmax"})
    engine = _engine()
    choice = host_tuning.tune_engine(engine, "auto", cache_path=cache)
    assert (choice.large, choice.small, choice.source) == ("xla_defaults", "fast_minmax", "measured")
    assert engine.decode_choice is choice and choice.describe() == "large=xla_defaults small=fast_minmax (measured)"
    # every set at both row counts, in every round
    assert sorted(set(calls)) == sorted((r, n) for r in ("large", "small") for n in engine_lib.DECODE_OPTION_SETS)
    assert choice.milliseconds["large"]["xla_defaults"] == pytest.approx(1.0)
    saved = json.load(open(cache))
    assert list(saved) == [host_tuning.host_key(engine)]
    assert saved[host_tuning.host_key(engine)]["small"] == "fast_minmax"
    # The engine decodes with the chosen sets.
    assert engine._generate_fn is engine._decode_fn(engine_lib.DECODE_OPTION_SETS["xla_defaults"])
    assert engine._generate_small_fn is engine._decode_fn(engine_lib.DECODE_OPTION_SETS["fast_minmax"])

    calls.clear()
    again = host_tuning.tune_engine(_engine(), "auto", cache_path=cache)
    assert (again.large, again.small, again.source) == ("xla_defaults", "fast_minmax", "cached") and not calls
    # Another decode shape is another key: measured for itself.
    other = host_tuning.tune_engine(_engine(slots=8), "auto", cache_path=cache)
    assert other.source == "measured" and calls and {r for r, _ in calls} == {"small"}  # 8 slots: one regime
    assert len(json.load(open(cache))) == 2


def test_settings_other_than_auto_measure_nothing(tmp_path, monkeypatch):
    calls = _fake_times(monkeypatch, {"large": "xla_defaults", "small": "xla_defaults"})
    cache = str(tmp_path / "host_choices.json")
    for setting, expected in (("builtin", ("fast_minmax", "small_batch", "builtin")),
                              ("small_batch", ("small_batch", "small_batch", "config")),
                              ("xla_defaults,fast_minmax", ("xla_defaults", "fast_minmax", "config"))):
        choice = host_tuning.choose_decode_options(_engine(), setting, cache_path=cache)
        assert (choice.large, choice.small, choice.source) == expected
    assert not calls
    with pytest.raises(ValueError, match="sampler.decode_options='eigen'"):
        host_tuning.choose_decode_options(_engine(), "eigen")


def test_a_damaged_or_unwritable_cache_is_measured_again_not_fatal(tmp_path, monkeypatch, caplog):
    _fake_times(monkeypatch, {"large": "fast_minmax", "small": "small_batch"})
    damaged = tmp_path / "host_choices.json"
    damaged.write_text("{not json")
    assert host_tuning.choose_decode_options(_engine(), "auto", cache_path=str(damaged)).source == "measured"
    assert "unreadable" in caplog.text
    assert host_tuning.choose_decode_options(_engine(), "auto", cache_path=str(damaged)).source == "cached"
    blocked = tmp_path / "file"
    blocked.write_text("")
    choice = host_tuning.choose_decode_options(_engine(), "auto", cache_path=str(blocked / "host_choices.json"))
    assert choice.source == "measured" and "could not write" in caplog.text


def test_the_cache_lies_beside_the_compilation_cache(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert host_tuning.host_choices_path("/x/jaxrl_agent/xla/") == "/x/jaxrl_agent/host_choices.json"
    assert host_tuning.host_choices_path("") is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/y/cache")
    assert host_tuning.host_choices_path("/x/xla") == "/y/host_choices.json"


def test_others_cpu_share_counts_the_host_busy_time_not_this_processes(monkeypatch):
    """share = (host busy s - own CPU s) / (wall s x CPUs), clipped to [0, 1]."""
    clock = {"host": 100.0, "own": 10.0, "wall": 0.0}
    monkeypatch.setattr(host_tuning, "_host_busy_seconds", lambda: clock["host"])
    monkeypatch.setattr(host_tuning, "_own_cpu_seconds", lambda: clock["own"])
    monkeypatch.setattr(host_tuning.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(host_tuning.os, "cpu_count", lambda: 4)
    probe = host_tuning.CpuShareOfOthers().start()
    clock.update(host=106.0, own=13.0, wall=2.0)  # 6 busy CPU-seconds on the host, 3 of them ours, in 2 s
    assert probe.share() == pytest.approx(3.0 / (2.0 * 4))
    clock.update(host=104.0, own=15.0)  # less than our own work (and clock skew): never below 0
    assert probe.share() == 0.0
    clock.update(host=200.0)
    assert probe.share() == 1.0
    monkeypatch.setattr(host_tuning, "_host_busy_seconds", lambda: None)
    assert host_tuning.CpuShareOfOthers().start().share() is None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_busy_process_beside_this_one_reads_as_load(monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.undo()  # the real /proc/stat
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        __import__("time").sleep(0.5)  # the child is running
        share = host_tuning.other_cpu_share(1.0)
    finally:
        busy.kill()
        busy.wait()
    # one of the host's CPUs kept busy by another process (other tests may add to it, never remove)
    assert share is not None and share >= 0.7 / os.cpu_count(), share


def test_should_remeasure_only_a_choice_measured_under_load_when_the_host_is_quieter():
    busy = host_tuning.BUSY_SHARE
    assert not host_tuning.should_remeasure(0.1, 0.0)  # measured quiet: kept
    assert not host_tuning.should_remeasure(busy, 0.0)  # at the threshold: quiet enough
    assert host_tuning.should_remeasure(0.6, 0.05)
    assert host_tuning.should_remeasure(0.6, busy)  # at most half the old share and not busy itself
    assert not host_tuning.should_remeasure(0.6, 0.4)  # still busy now
    assert not host_tuning.should_remeasure(0.4, 0.21)  # not half as busy: no better a measurement
    assert not host_tuning.should_remeasure(None, 0.0) and not host_tuning.should_remeasure(0.6, None)


def test_a_choice_cached_under_load_is_measured_again_once_the_host_is_quiet(tmp_path, monkeypatch):
    cache = str(tmp_path / "host_choices.json")
    engine = _engine()
    key = host_tuning.host_key(engine)
    loaded = {"large": "xla_defaults", "small": "small_batch", "milliseconds": {}, "other_cpu_share": 0.6}
    json.dump({key: loaded}, open(cache, "w"))
    calls = _fake_times(monkeypatch, {"large": "fast_minmax", "small": "small_batch"})
    # Still busy now: the cached choice stands (and says how it was measured).
    monkeypatch.setattr(host_tuning, "other_cpu_share", lambda seconds=0.25: 0.5)
    kept = host_tuning.choose_decode_options(engine, "auto", cache_path=cache)
    assert (kept.large, kept.source, kept.other_cpu_share) == ("xla_defaults", "cached", 0.6) and not calls
    assert kept.describe() == ("large=xla_defaults small=small_batch (cached, measured under load: "
                               "other processes 60% of the CPU)")
    # Quiet now: measured again, the new choice and its load replace the old.
    monkeypatch.setattr(host_tuning, "other_cpu_share", lambda seconds=0.25: 0.0)
    monkeypatch.setattr(host_tuning.CpuShareOfOthers, "share", lambda self: 0.05)  # during the new measurement
    again = host_tuning.choose_decode_options(engine, "auto", cache_path=cache)
    assert (again.large, again.small, again.source) == ("fast_minmax", "small_batch", "measured again") and calls
    saved = json.load(open(cache))[key]
    assert saved["large"] == "fast_minmax" and saved["other_cpu_share"] == again.other_cpu_share
    assert again.other_cpu_share == 0.05
    # Measured quiet: read from the cache from now on, the host's load never probed.
    monkeypatch.setattr(host_tuning, "other_cpu_share", lambda seconds=0.25: pytest.fail("probed"))
    assert host_tuning.choose_decode_options(engine, "auto", cache_path=cache).source == "cached"


def test_a_real_measurement_on_this_host_chooses_sets_that_decode_the_same_tokens(tmp_path):
    """Not faked: each set timed here; whatever wins, the tuned engine's tokens are the built-in one's."""
    prompts = [TOKENIZER.encode(p) for p in ("Q: 2+3", "Q: 10*4", "hello")]
    sampling = SamplingParams(temperature=0.0, max_tokens=5)
    with LocalSampler(_engine()) as sampler:
        want = sampler.generate_many(prompts, sampling)
    engine = _engine()
    choice = host_tuning.tune_engine(engine, "auto", cache_path=str(tmp_path / "host_choices.json"))
    assert choice.source == "measured" and choice.seconds > 0
    assert set(choice.milliseconds) == {"large", "small"}
    assert all(ms > 0 for by_name in choice.milliseconds.values() for ms in by_name.values())
    with LocalSampler(engine) as sampler:
        got = sampler.generate_many(prompts, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
