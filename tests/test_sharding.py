"""Mesh and partitioning: 8 simulated CPU devices (tests/conftest.py) == 1 device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_agent import models, sharding


def _setup():
    config = models.ModelConfig(architecture="qwen3", qk_norm=True, num_heads=4, num_kv_heads=2)
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 10), 0, config.vocab_size)
    return config, params, tokens


def test_eight_device_forward_matches_single_device_and_is_really_sharded():
    assert jax.device_count() >= 8, "tests/conftest.py asks for 8 simulated CPU devices"
    config, params, tokens = _setup()
    expected = models.forward(config, params, tokens)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    sharded_params = sharding.shard_params(params, mesh)
    q = sharded_params["layers"]["attn"]["q_proj"]["kernel"]  # [L, H, N, D] = [2, 64, 4, 16]
    assert q.sharding.spec == P(None, "fsdp", "tensor")
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 2, 16)}
    embed = sharded_params["embed"]["embedding"]  # [V, H]
    assert embed.sharding.spec == P("tensor", "fsdp")
    down = sharded_params["layers"]["mlp"]["down_proj"]["kernel"]
    assert down.sharding.spec == P(None, "tensor", "fsdp")
    assert sharded_params["final_norm"]["scale"].sharding.spec == P()

    fn = sharding.sharded_forward(config, mesh, params)
    logits = fn(sharded_params, jax.device_put(tokens, sharding.batch_sharding(mesh)))
    assert logits.sharding.spec == P(("data", "fsdp"))
    assert len(logits.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5, rtol=0)


def test_indivisible_dimensions_fall_back_to_replication():
    config = models.ModelConfig(num_heads=4, num_kv_heads=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4, devices=jax.devices()[:8])
    specs = sharding.param_partition_specs(params, mesh)
    assert specs["layers"]["attn"]["k_proj"]["kernel"] == P(None, "fsdp")  # 1 KV head
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")


def test_make_mesh_fills_one_axis_and_rejects_bad_sizes():
    mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=1, devices=jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    with pytest.raises(ValueError, match="does not fit 8 devices"):
        sharding.make_mesh(data=3, fsdp=-1, tensor=1, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(data=-1, fsdp=-1, tensor=1)


def test_unknown_parameter_has_no_rule():
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="no partition rule matches parameter 'mystery/weight'"):
        sharding.param_partition_specs({"mystery": {"weight": jnp.zeros((2, 2))}}, mesh)
