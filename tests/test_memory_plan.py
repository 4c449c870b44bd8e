"""The memory plan (`jaxrl_agent.memory_plan`): its exact parts equal what the learner really holds,
its sharding divides what it should, and (slow) the whole plan is within 10% of XLA's compiled peak
on tiny shapes the counts were not fitted on (`benchmarks/memory_plan.py --check`)."""

import pathlib
import subprocess
import sys

import jax
import pytest

from jaxrl_agent import learner, memory_plan, models

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_plan as plan_benchmark  # noqa: E402  (benchmarks/memory_plan.py)


@pytest.mark.parametrize("changes", [
    dict(architecture="qwen3", qk_norm=True, tie_word_embeddings=True),
    dict(architecture="llama", tie_word_embeddings=False),
    dict(architecture="qwen2", attention_bias=True, tie_word_embeddings=False),
])
def test_parameter_count_equals_the_initialised_model(changes):
    config = models.ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
                                num_kv_heads=2, head_dim=12, **changes)
    shapes = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    assert sum(memory_plan.parameter_count(config)) == sum(x.size for x in jax.tree.leaves(shapes))


def test_the_state_parts_equal_the_compiled_arguments():
    """Parameters, master copy, moments and batch are exact: together they are the step's arguments."""
    model, settings = plan_benchmark.tiny((2, 128, 1024, 64, 128, 2, 4, 2, 16, 32, 16), "bfloat16")
    plan = memory_plan.learner_memory(model, **settings).parts
    exact = sum(plan[p] for p in ("parameters", "master", "optimizer", "reference", "batch"))
    assert plan["master"] > 0 and plan["optimizer"] == 2 * plan["master"]  # float32 master and moments
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda p: learner.init_state(p, learner.make_optimizer(
        learning_rate=1e-6, warmup_steps=1, total_steps=10), master_dtype="float32"), params)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    batch_bytes = 8 * 2 * 128 * 4 + 2 * 32 * 4
    assert abs(exact - (state_bytes + batch_bytes)) <= 64  # the scalars (step, counts, rng)


def test_sharding_divides_the_state_and_the_rows():
    model = plan_benchmark.qwen3("Qwen3-1.7B")
    one_plan = memory_plan.learner_memory(model, rows=8, row_length=1024, targets=256, logits_chunk=128,
                                          master_dtype="float32")
    four_plan = memory_plan.learner_memory(model, rows=8, row_length=1024, targets=256, logits_chunk=128,
                                           master_dtype="float32", shards=4, batch_shards=4)
    one, four = one_plan.parts, four_plan.parts
    for part in ("parameters", "master", "optimizer", "gradients"):
        assert abs(four[part] * 4 - one[part]) <= 4, part
    assert four_plan.activations < one_plan.activations / 3  # a quarter of the rows, plus one gathered block
    assert memory_plan.learner_memory(model, rows=8, row_length=1024, master_dtype="").parts["master"] == 0


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="remat"):
        memory_plan.learner_memory(models.ModelConfig(), rows=1, row_length=64)
    with pytest.raises(ValueError, match="rows=6 do not split over batch_shards=4"):
        memory_plan.learner_memory(models.ModelConfig(remat=True), rows=6, row_length=64, batch_shards=4)


def test_sampler_plan_is_the_cache_it_allocates():
    model = plan_benchmark.qwen3("Qwen3-0.6B")
    plan = memory_plan.sampler_memory(model, slots=128, cache_length=1024, prefix_cache_entries=32).parts
    per_slot = 28 * 2 * 8 * 128 * 1024 * 2  # layers x (k, v) x kv heads x head_dim x positions x bfloat16
    assert plan["kv_cache"] == 128 * per_slot and plan["prefix_cache"] == 32 * per_slot
    assert per_slot / 2**20 == pytest.approx(112, abs=0.5)  # the config's "~117 MiB each" (in MB)
    two = memory_plan.sampler_memory(model, slots=128, cache_length=1024, prefix_cache_entries=32, engines=2).parts
    assert two["parameters"] == 2 * plan["parameters"] and two["kv_cache"] == plan["kv_cache"]  # a weight copy each


@pytest.mark.slow  # ~40 s of compiling eight tiny learner steps; CI's slow pass runs it
def test_the_plan_is_within_ten_percent_of_the_compiled_peak():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_plan.py"), "--check"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("| float32 |") == 4 and done.stdout.count("| bfloat16 |") == 4
