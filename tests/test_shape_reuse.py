"""ShapeReuse: a new shape runs padded in a compiled larger one until the padding has cost
`compile_calls` calls of it, then it is compiled (ski rental); the learner's batches pad with rows
that train nothing."""

import jax
import numpy as np
import pytest

from jaxrl_agent import learner, replay
from jaxrl_agent.shape_reuse import ShapeReuse


def test_a_new_shape_pads_up_until_its_padding_has_cost_a_compile():
    reuse = ShapeReuse(compile_calls=1.0)
    assert reuse.choose((36, 0)) == (36, 0)  # nothing compiled: compiled now
    assert reuse.choose((40, 0)) == (40, 0)  # nothing larger compiled: compiled
    # 32 rows run as 36 (the least work of those that hold it), each call 36/32 - 1 = 0.125 calls
    # of padding: seven calls spend 0.875 < 1; the eighth would reach 1.0 and compiles 32 instead.
    assert [reuse.choose((32, 0)) for _ in range(8)] == [(36, 0)] * 7 + [(32, 0)]
    assert reuse.padding[(32, 0)] == pytest.approx(0.875)
    assert reuse.choose((32, 0)) == (32, 0) and reuse.padded_calls == 7
    assert reuse.compiled == {(36, 0), (40, 0), (32, 0)}


def test_only_shapes_that_hold_the_wanted_one_in_every_dimension_are_reused():
    reuse = ShapeReuse(compile_calls=100.0)
    for shape in [(8, 64), (16, 16)]:
        reuse.choose(shape)
    assert reuse.choose((8, 32)) == (8, 64)  # (16, 16) has fewer columns: it cannot hold 32
    assert reuse.choose((16, 8)) == (16, 16)
    assert reuse.choose((4, 16)) == (16, 16)  # both hold it: (16, 16) is the less work (256 < 512)
    assert reuse.choose((24, 8)) == (24, 8)  # nothing holds 24 rows: compiled
    assert reuse.choose((4, 16, 1)) == (4, 16, 1)  # another rank is another program


def test_zero_compiles_every_shape_and_a_negative_cost_is_refused():
    reuse = ShapeReuse(compile_calls=0.0)
    assert [reuse.choose((r,)) for r in (40, 36, 32, 36)] == [(40,), (36,), (32,), (36,)]
    assert reuse.padded_calls == 0
    with pytest.raises(ValueError, match=r"compile_calls=-1: expected >= 0"):
        ShapeReuse(compile_calls=-1)


def _batch(rows: int) -> learner.PackedBatch:
    rng = np.random.RandomState(rows)
    z = np.zeros((rows, 16), np.int32)
    return learner.PackedBatch(tokens=rng.randint(1, 9, (rows, 16)).astype(np.int32), segment_ids=z + 1,
                               positions=np.tile(np.arange(16, dtype=np.int32), (rows, 1)), loss_mask=z + 1,
                               advantages=rng.randn(rows, 16).astype(np.float32),
                               sampler_logprobs=z.astype(np.float32) - 1, old_logprobs=z.astype(np.float32) - 1,
                               policy_version=z)


def test_global_batch_pads_to_the_compiled_shape_with_rows_that_train_nothing():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    reuse = ShapeReuse(compile_calls=8.0)
    assert learner.global_batch(_batch(8), mesh, shapes=reuse).tokens.shape == (8, 16)
    small = _batch(4)
    padded = learner.global_batch(small, mesh, shapes=reuse)
    assert padded.tokens.shape == (8, 16)
    host = jax.tree.map(np.asarray, padded)
    np.testing.assert_array_equal(host.tokens[:4], small.tokens)
    assert not host.loss_mask[4:].any() and not host.segment_ids[4:].any() and (host.policy_version[4:] == -1).all()
    # Without the reuse the batch keeps its own shape.
    assert learner.global_batch(small, mesh).tokens.shape == (4, 16)
    assert replay.pad_batch(small, 4).tokens.shape == (4, 16)


def test_an_update_on_a_batch_padded_to_a_compiled_shape_is_the_update_on_the_batch(tmp_path):
    """The padding rows carry no loss: the RL step's new parameters and loss are the same whether
    the batch runs in its own shape or padded up to a compiled larger one."""
    from jaxrl_agent import build
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    mesh = build.build_mesh(config)
    model_config, params = build.build_model(config, mesh)
    batch = _batch(8)  # rows: a multiple of the 8 test devices the batch is split over
    batch = batch.replace(tokens=batch.tokens % model_config.vocab_size)
    reuse = ShapeReuse(compile_calls=8.0)
    reuse.choose((16, 0))  # a 16-row step already compiled
    results = []
    for shapes in (None, reuse):
        state, step_fn = build.build_learner(config, model_config, mesh, jax.tree.map(np.array, params))
        for _ in range(2):  # the first update's learning rate is 0 (the warm-up starts there)
            placed = learner.global_batch(batch, mesh, shapes=shapes)
            state, metrics = step_fn(state, placed)
        results.append((placed.tokens.shape[0], jax.device_get(state.params), float(metrics["loss"])))
    (rows_own, params_own, loss_own), (rows_padded, params_padded, loss_padded) = results
    assert (rows_own, rows_padded) == (8, 16)
    assert loss_padded == pytest.approx(loss_own, rel=1e-5, abs=1e-7) and loss_own != 0.0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params_padded, params_own)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), params_own, jax.device_get(params)))
    assert any(changed)  # the step did update


def test_the_sampler_config_gives_the_engines_of_one_sampler_one_shared_reuse(tmp_path):
    """sampler.shape_reuse_calls / decode_shape_reuse_calls reach the engines `build_engines` makes:
    both lanes hold the same ShapeReuse per program (they share the jitted programs), with the
    configured costs; 0 leaves a program without one."""
    from jaxrl_agent import build, tokenizer
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    config.sampler.local_engines = 2
    config.sampler.shape_reuse_calls, config.sampler.decode_shape_reuse_calls = 16.0, 128.0
    model_config, params = build.build_model(config, build.build_mesh(config))
    first, second = build.build_engines(config, model_config, params, tokenizer.CharTokenizer())
    assert set(first.shape_reuse) == {"prefill", "extend", "decode"}
    assert all(first.shape_reuse[p] is second.shape_reuse[p] for p in first.shape_reuse)
    assert [first.shape_reuse[p].compile_calls for p in ("prefill", "extend", "decode")] == [16.0, 16.0, 128.0]
    config.sampler.shape_reuse_calls = 0.0
    assert set(build.engine_shape_reuse(config)) == {"decode"}
