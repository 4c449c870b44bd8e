"""Hugging Face checkpoint import / export (`config.json` + safetensors, single or sharded).

`load_hf(path, dtype=...) -> (ModelConfig, params)` reads a model folder written by
`transformers` (`model.safetensors`, or shards listed in `model.safetensors.index.json`) and
converts torch's `[out, in]` Linear weights into our stacked `[L, in, heads, head_dim]` layout.
Every tensor is checked against the shape the config implies; a missing tensor, a wrong shape, an
unexpected tensor or an unsupported architecture raises an error naming it. Parameters come back
as host (numpy) arrays: placing them on devices is the build step's job
(`jaxrl_agent.sharding.place_params`), so `models/` never imports the learner's layers.

`save_hf(path, config, params)` writes the same format back; load(save(p)) == p exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_agent.models.config import ModelConfig, UnsupportedArchitectureError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or inconsistent with its config."""


@dataclasses.dataclass(frozen=True)
class _TensorRule:
    """How one Hugging Face tensor maps onto one of our parameters.

    `hf_shape(cfg)` is the torch-layout shape, `to_ours` converts one (per-layer) tensor to our
    layout and `to_hf` converts back. Per-layer tensors are stacked along a new leading axis.
    """

    ours: tuple[str, ...]
    hf_name: str  # may contain '{i}' for the layer index
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    when: Callable[[ModelConfig], bool] = lambda cfg: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


def _ident(x, cfg):
    return x


def _linear_in(heads_attr: str | None):
    """torch Linear [heads*D, H] -> kernel [H, heads, D] (or [H, out] with heads_attr None)."""
    def to_ours(w, cfg):
        if heads_attr is None:
            return w.T
        return w.T.reshape(cfg.hidden_size, getattr(cfg, heads_attr), cfg.head_dim)

    def to_hf(k, cfg):
        return k.reshape(k.shape[0], -1).T

    return to_ours, to_hf


def _bias(heads_attr: str):
    return (
        lambda b, cfg: b.reshape(getattr(cfg, heads_attr), cfg.head_dim),
        lambda b, cfg: b.reshape(-1),
    )


def _rules() -> list[_TensorRule]:
    q_in, q_out = _linear_in("num_heads")
    kv_in, kv_out = _linear_in("num_kv_heads")
    plain_in, plain_out = _linear_in(None)
    qb_in, qb_out = _bias("num_heads")
    kvb_in, kvb_out = _bias("num_kv_heads")
    attn = "model.layers.{i}.self_attn."
    mlp = "model.layers.{i}.mlp."
    biased = lambda cfg: cfg.attention_bias
    return [
        _TensorRule(("embed", "embedding"), "model.embed_tokens.weight",
                    lambda c: (c.vocab_size, c.hidden_size), _ident, _ident),
        _TensorRule(("layers", "input_norm", "scale"), "model.layers.{i}.input_layernorm.weight",
                    lambda c: (c.hidden_size,), _ident, _ident),
        _TensorRule(("layers", "post_attn_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight",
                    lambda c: (c.hidden_size,), _ident, _ident),
        _TensorRule(("layers", "attn", "q_proj", "kernel"), attn + "q_proj.weight",
                    lambda c: (c.num_heads * c.head_dim, c.hidden_size), q_in, q_out),
        _TensorRule(("layers", "attn", "k_proj", "kernel"), attn + "k_proj.weight",
                    lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), kv_in, kv_out),
        _TensorRule(("layers", "attn", "v_proj", "kernel"), attn + "v_proj.weight",
                    lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), kv_in, kv_out),
        _TensorRule(("layers", "attn", "q_proj", "bias"), attn + "q_proj.bias",
                    lambda c: (c.num_heads * c.head_dim,), qb_in, qb_out, biased),
        _TensorRule(("layers", "attn", "k_proj", "bias"), attn + "k_proj.bias",
                    lambda c: (c.num_kv_heads * c.head_dim,), kvb_in, kvb_out, biased),
        _TensorRule(("layers", "attn", "v_proj", "bias"), attn + "v_proj.bias",
                    lambda c: (c.num_kv_heads * c.head_dim,), kvb_in, kvb_out, biased),
        _TensorRule(("layers", "attn", "o_proj", "kernel"), attn + "o_proj.weight",
                    lambda c: (c.hidden_size, c.num_heads * c.head_dim),
                    lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
                    lambda k, c: k.reshape(-1, k.shape[-1]).T),
        _TensorRule(("layers", "attn", "q_norm", "scale"), attn + "q_norm.weight",
                    lambda c: (c.head_dim,), _ident, _ident, lambda c: c.qk_norm),
        _TensorRule(("layers", "attn", "k_norm", "scale"), attn + "k_norm.weight",
                    lambda c: (c.head_dim,), _ident, _ident, lambda c: c.qk_norm),
        _TensorRule(("layers", "mlp", "gate_proj", "kernel"), mlp + "gate_proj.weight",
                    lambda c: (c.intermediate_size, c.hidden_size), plain_in, plain_out),
        _TensorRule(("layers", "mlp", "up_proj", "kernel"), mlp + "up_proj.weight",
                    lambda c: (c.intermediate_size, c.hidden_size), plain_in, plain_out),
        _TensorRule(("layers", "mlp", "down_proj", "kernel"), mlp + "down_proj.weight",
                    lambda c: (c.hidden_size, c.intermediate_size), plain_in, plain_out),
        _TensorRule(("final_norm", "scale"), "model.norm.weight",
                    lambda c: (c.hidden_size,), _ident, _ident),
        _TensorRule(("lm_head",), "lm_head.weight",
                    lambda c: (c.vocab_size, c.hidden_size), lambda w, c: w.T, lambda k, c: k.T,
                    lambda c: not c.tie_word_embeddings),
    ]


# Tensors that may appear in a checkpoint and carry nothing we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def _np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class _SafetensorsReader:
    """Reads tensors by name from one file or from shards listed in an index."""

    def __init__(self, path: str):
        single = os.path.join(path, SINGLE_FILE)
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        elif os.path.exists(single):
            with safe_open(single, framework="np") as f:
                self._files = {name: single for name in f.keys()}
        else:
            raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        for name, file in self._files.items():
            if not os.path.exists(file):
                raise CheckpointError(f"shard {file} (holding tensor {name!r}) does not exist")
        self._handles: dict[str, Any] = {}

    def names(self) -> set[str]:
        return set(self._files)

    def get(self, name: str) -> np.ndarray:
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="np")
        return self._handles[file].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="np")
        return tuple(self._handles[file].get_slice(name).get_shape())


def read_hf_config(path: str, *, dtype: str = "float32", compute_dtype: str | None = None) -> ModelConfig:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise CheckpointError(f"{path} has no {CONFIG_FILE}")
    with open(config_path) as f:
        hf = json.load(f)
    return ModelConfig.from_hf_dict(hf, param_dtype=dtype, dtype=compute_dtype)


def _set(tree: dict, path: tuple[str, ...], value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def load_hf(
    path: str,
    dtype: str = "float32",
    *,
    compute_dtype: str | None = None,
) -> tuple[ModelConfig, dict]:
    """Loads a Hugging Face Llama / Qwen2 / Qwen3 folder.

    Args:
      path: folder with `config.json` and `model.safetensors` (or a sharded index).
      dtype: parameter dtype name ('float32', 'bfloat16', 'float16').
      compute_dtype: activation dtype; defaults to `dtype`.

    Returns:
      (config, params): params are numpy arrays in the layout of `jaxrl_agent.models.init_params`.

    Raises:
      UnsupportedArchitectureError, CheckpointError (names the tensor and both shapes).
    """
    config = read_hf_config(path, dtype=dtype, compute_dtype=compute_dtype)
    reader = _SafetensorsReader(path)
    target = _np_dtype(dtype)
    available = reader.names()
    used: set[str] = set()
    params: dict = {}
    for rule in _rules():
        if not rule.when(config):
            continue
        names = [rule.hf_name.format(i=i) for i in range(config.num_layers)] if rule.per_layer else [rule.hf_name]
        expected = rule.hf_shape(config)
        layers = []
        for name in names:
            if name not in available:
                raise CheckpointError(
                    f"checkpoint {path} is missing tensor {name!r} (expected shape {expected} for "
                    f"{config.architecture})"
                )
            found = reader.shape(name)
            if found != expected:
                raise CheckpointError(
                    f"tensor {name!r} has shape {found}, expected {expected} from {CONFIG_FILE}"
                )
            layers.append(rule.to_ours(reader.get(name), config).astype(target))
            used.add(name)
        value = np.stack(layers) if rule.per_layer else layers[0]
        _set(params, rule.ours, value)
    unexpected = sorted(
        n for n in available - used
        if not n.endswith(_IGNORABLE_SUFFIXES) and not (n == "lm_head.weight" and config.tie_word_embeddings)
    )
    if unexpected:
        raise UnsupportedArchitectureError(
            f"checkpoint {path} has tensors this {config.architecture} model has no place for: "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    return config, params


def save_hf(path: str, config: ModelConfig, params, *, max_shard_bytes: int | None = None) -> None:
    """Writes `config.json` and safetensors (sharded with an index when over `max_shard_bytes`)."""
    os.makedirs(path, exist_ok=True)
    hf_config = config.to_hf_dict()
    tensors: dict[str, np.ndarray] = {}
    for rule in _rules():
        if not rule.when(config):
            continue
        try:
            value = np.asarray(jax.device_get(_get(params, rule.ours)))
        except KeyError:
            raise CheckpointError(f"params have no entry {'/'.join(rule.ours)} required by the config") from None
        per_layer = value if rule.per_layer else value[None]
        if rule.per_layer and value.shape[0] != config.num_layers:
            raise CheckpointError(
                f"parameter {'/'.join(rule.ours)} has {value.shape[0]} layers, expected {config.num_layers}"
            )
        for i, layer_value in enumerate(per_layer):
            name = rule.hf_name.format(i=i)
            tensor = np.ascontiguousarray(rule.to_hf(layer_value, config))
            if tensor.shape != rule.hf_shape(config):
                raise CheckpointError(
                    f"parameter for {name!r} has shape {tensor.shape}, expected {rule.hf_shape(config)}"
                )
            tensors[name] = tensor
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)
