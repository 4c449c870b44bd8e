"""`benchmarks/sampler_throughput.py`: its in-process engines decode with the options chosen for this
host as a run's engines do (`--decode_options`, default 'auto'), not with the built-in ones."""

import pathlib
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sampler_throughput  # noqa: E402

from jaxrl_agent import models  # noqa: E402
from jaxrl_agent.sampling import engine as engine_lib  # noqa: E402

TINY = models.ModelConfig(architecture="llama", vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)


def _params():
    return models.init_params(TINY, jax.random.PRNGKey(0))


def test_engines_take_the_decode_options_setting(monkeypatch):
    monkeypatch.setattr(sampler_throughput, "DECODE_OPTIONS", "xla_defaults,small_batch")
    engine = sampler_throughput._engine(TINY, _params(), 4, 4, 8)
    assert (engine.decode_choice.large, engine.decode_choice.small, engine.decode_choice.source) == (
        "xla_defaults", "small_batch", "config")
    assert engine._generate_fn is engine._decode_fn(engine_lib.DECODE_OPTION_SETS["xla_defaults"])
    assert engine._generate_small_fn is engine._decode_fn(engine_lib.DECODE_OPTION_SETS["small_batch"])


def test_auto_reads_the_hosts_cached_choice(monkeypatch, tmp_path):
    """'auto' takes what the host-choices cache holds for this shape (written as a run writes it)."""
    from jaxrl_agent.sampling import host_tuning

    path = str(tmp_path / "host_choices.json")
    monkeypatch.setattr(sampler_throughput.launcher_runs, "host_choices_path", lambda: path)
    probe = sampler_throughput._engine(TINY, _params(), 4, 4, 8, decode_compiler_options={})
    host_tuning._write_cache(path, host_tuning.host_key(probe), {"large": "small_batch", "small": "xla_defaults",
                                                                  "other_cpu_share": 0.0})
    monkeypatch.setattr(sampler_throughput, "DECODE_OPTIONS", "auto")
    engine = sampler_throughput._engine(TINY, _params(), 4, 4, 8)
    assert (engine.decode_choice.large, engine.decode_choice.small, engine.decode_choice.source) == (
        "small_batch", "xla_defaults", "cached")
