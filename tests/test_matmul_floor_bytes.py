"""`benchmarks/matmul_floor.py`: the bytes a decode step must read (its bandwidth floor's numerator),
counted by hand for a tiny model."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import matmul_floor  # noqa: E402

from jaxrl_agent import models  # noqa: E402


def test_decode_bytes_count_every_weight_once_and_the_attended_cache():
    config = models.ModelConfig(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=12,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    embedding = 16 * 8  # tied: the head is its transpose, read once
    layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 12 + 2 * 8  # q, k, v, o, gate/up/down, two norms
    final_norm = 8
    cache = 2 * 2 * 1 * 1 * 5 * 4  # rows x (keys, values) x layers x KV heads x positions x head_dim
    assert matmul_floor.decode_bytes(config, rows=2, cache_length=5) == 4 * (embedding + layer + final_norm + cache)
