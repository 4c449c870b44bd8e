"""Hugging Face parity and checkpoint round-trip / error tests."""

import json
import os

import jax
import numpy as np
import pytest

from jaxrl_agent import models, sharding
from tests import hf_reference as ref

pytest.importorskip("torch", reason="parity tests need the torch CPU build from the test extra")


def _tokens(seed=0, shape=(3, 13)):
    return np.random.RandomState(seed).randint(0, 97, shape)


@pytest.mark.parametrize("arch", ref.ARCHS)
@pytest.mark.parametrize("variant", [{}, {"tie": True}, {"llama3_rope": True}, {"num_kv_heads": 1}])
def test_logits_match_transformers(tmp_path, arch, variant):
    hf_model = ref.make_hf_model(arch, **variant)
    hf_model.save_pretrained(tmp_path)
    config, params = models.load_hf(str(tmp_path))
    assert config.architecture == arch
    assert config.tie_word_embeddings == bool(variant.get("tie"))
    assert (config.rope_scaling is not None) == bool(variant.get("llama3_rope"))
    assert config.qk_norm == (arch == "qwen3")
    assert config.attention_bias == (arch == "qwen2")
    for seed in range(2):
        tokens = _tokens(seed)
        expected = ref.hf_logits(hf_model, tokens)
        ours = np.asarray(models.forward(config, params, tokens))
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Guards the parity test above: ignoring the scaling would give different logits."""
    hf_model = ref.make_hf_model("llama", llama3_rope=True)
    hf_model.save_pretrained(tmp_path)
    config, params = models.load_hf(str(tmp_path))
    tokens = _tokens(0, (1, 200))
    scaled = models.forward(config, params, tokens)
    unscaled = models.forward(config.replace(rope_scaling=None), params, tokens)
    assert np.abs(np.asarray(scaled) - np.asarray(unscaled)).max() > 3e-4  # 3x the parity tolerance


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf_model = ref.make_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    config, params = models.load_hf(str(tmp_path))
    tokens = _tokens()
    np.testing.assert_allclose(models.forward(config, params, tokens), ref.hf_logits(hf_model, tokens), atol=1e-4)


@pytest.mark.parametrize("arch", ref.ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_exact(tmp_path, arch, dtype):
    config = models.ModelConfig(
        architecture=arch, attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tie_word_embeddings=arch == "qwen3", param_dtype=dtype, dtype=dtype,
        rope_scaling=models.RopeScaling() if arch == "llama" else None,
    )
    params = models.init_params(config, jax.random.PRNGKey(3))
    # Non-trivial norms and biases so that a swapped or dropped tensor cannot go unnoticed.
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape, x.dtype), params)
    models.save_hf(str(tmp_path), config, params)
    loaded_config, loaded = models.load_hf(str(tmp_path), dtype=dtype)
    assert loaded_config == config
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_sharded_round_trip(tmp_path):
    config = models.ModelConfig()
    params = models.init_params(config, jax.random.PRNGKey(0))
    models.save_hf(str(tmp_path), config, params, max_shard_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, loaded = models.load_hf(str(tmp_path))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_our_checkpoint_loads_in_transformers(tmp_path):
    import torch
    import transformers

    config = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=97)
    params = models.init_params(config, jax.random.PRNGKey(1))
    models.save_hf(str(tmp_path), config, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = _tokens()
    np.testing.assert_allclose(models.forward(config, params, tokens), ref.hf_logits(hf_model, tokens), atol=1e-4)


def test_load_places_parameters_on_mesh(tmp_path):
    hf_model = ref.make_hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    config, params = models.load_hf(str(tmp_path))
    params = sharding.place_params(params, mesh)
    q = params["layers"]["attn"]["q_proj"]["kernel"]  # [L, H=32, N=4, D=8]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    tokens = _tokens(0, (4, 9))
    np.testing.assert_allclose(models.forward(config, params, tokens), ref.hf_logits(hf_model, tokens), atol=1e-4)


# ------------------------------------------------------------------------------ broken checkpoints
def _saved_tiny(tmp_path, **overrides):
    config = models.ModelConfig(**overrides)
    params = models.init_params(config, jax.random.PRNGKey(0))
    models.save_hf(str(tmp_path), config, params)
    return config, params


def _rewrite_tensors(tmp_path, edit):
    from safetensors.numpy import load_file, save_file

    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(tmp_path):
    _saved_tiny(tmp_path)
    _rewrite_tensors(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(models.CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*\(256, 64\)"):
        models.load_hf(str(tmp_path))


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    _saved_tiny(tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)

    _rewrite_tensors(tmp_path, edit)
    with pytest.raises(models.CheckpointError) as err:
        models.load_hf(str(tmp_path))
    message = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "(48, 64)" in message and "(32, 64)" in message


def test_unexpected_tensor_is_rejected(tmp_path):
    _saved_tiny(tmp_path)

    def edit(t):
        t["model.layers.0.mlp.experts.0.weight"] = np.zeros((4, 4), np.float32)

    _rewrite_tensors(tmp_path, edit)
    with pytest.raises(models.UnsupportedArchitectureError, match="experts"):
        models.load_hf(str(tmp_path))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "mixtral"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_unsupported_architecture(tmp_path, change, message):
    _saved_tiny(tmp_path)
    cfg_file = tmp_path / "config.json"
    hf = json.loads(cfg_file.read_text())
    hf.update(change)
    cfg_file.write_text(json.dumps(hf))
    with pytest.raises(models.UnsupportedArchitectureError, match=message):
        models.load_hf(str(tmp_path))


def test_missing_files(tmp_path):
    with pytest.raises(models.CheckpointError, match="config.json"):
        models.load_hf(str(tmp_path))
    _saved_tiny(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(models.CheckpointError, match="model.safetensors"):
        models.load_hf(str(tmp_path))
