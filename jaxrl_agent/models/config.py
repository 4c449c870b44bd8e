"""Architecture description of the decoder-only transformer family (Llama-3, Qwen2, Qwen3).

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument of `jax.jit`. It is
the only thing the model code reads; `from_hf_dict` / `to_hf_dict` translate to and from a Hugging
Face `config.json`, and `from_config_dict` builds one from an ml-collections `ConfigDict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

# Hugging Face `model_type` -> the `architectures` entry written by `save_hf`.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint describes a model this package cannot represent exactly."""


def dtype_from_name(name: str | Any):
    """Maps 'float32' / 'bfloat16' / 'float16' (or a dtype) to a jnp dtype."""
    if not isinstance(name, str):
        return jnp.dtype(name).type
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (`rope_type="llama3"` in Hugging Face configs).

    Frequencies with wavelength above `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`; those below `original_max_position_embeddings / high_freq_factor` are
    kept; in between they are interpolated smoothly (Llama 3 report, Meta 2024).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dense decoder-only transformer.

    Attributes:
      architecture: 'llama', 'qwen2' or 'qwen3' (the Hugging Face `model_type`).
      vocab_size: number of token ids V.
      hidden_size: model width H.
      intermediate_size: SwiGLU hidden width I.
      num_layers: number of decoder blocks L.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (grouped-query attention: N % K == 0).
      head_dim: per-head width D (Qwen3 sets it independently of H / N).
      rope_theta: RoPE base.
      rope_scaling: Llama-3 frequency scaling, or None.
      rms_norm_eps: epsilon inside every RMSNorm.
      tie_word_embeddings: the output projection is the transposed input embedding.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
      max_position_embeddings: longest position the model was trained for.
      param_dtype: dtype parameters are stored in.
      dtype: dtype of activations and matmuls; logits and log-softmax are always float32.
      remat: rematerialise each block in the backward pass (memory for compute).
      scan_layers: run the uncached forward as one `nn.scan` over the stacked layers (compile
        time independent of depth) or as an unrolled loop (no stacked residual buffers; ~15%
        faster training steps for the tiny CPU models). Parameters are stacked either way.
    """

    architecture: str = "llama"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    scan_layers: bool = True

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; expected one of "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        dtype_from_name(self.param_dtype)
        dtype_from_name(self.dtype)

    @property
    def jnp_dtype(self):
        return dtype_from_name(self.dtype)

    @property
    def jnp_param_dtype(self):
        return dtype_from_name(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- ml-collections configs
    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a mapping (e.g. `config.model` of an ml-collections config)."""
        values = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config fields {unknown}; expected a subset of {sorted(known)}")
        scaling = values.get("rope_scaling")
        if isinstance(scaling, Mapping) or hasattr(scaling, "to_dict"):
            scaling = dict(scaling.to_dict() if hasattr(scaling, "to_dict") else scaling)
            values["rope_scaling"] = RopeScaling(**scaling) if scaling else None
        return cls(**values)

    # ---------------------------------------------------------------- Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], *, param_dtype: str = "float32",
                     dtype: str | None = None) -> "ModelConfig":
        """Translates a Hugging Face `config.json` dict; rejects what we cannot match exactly."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"config.json has model_type={model_type!r} (architectures="
                f"{hf.get('architectures')}); expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act={act!r} is not supported; expected 'silu'")
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window"):
            raise UnsupportedArchitectureError("use_sliding_window=True is not supported")
        # transformers < 5 keeps `rope_theta` / `rope_scaling` at the top level; 5.x nests both
        # in `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {}) or rope
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif rope_type in ("default", None):
            rope_scaling = None
        else:
            raise UnsupportedArchitectureError(
                f"rope scaling type {rope_type!r} is not supported; expected 'default' or 'llama3'"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            param_dtype=param_dtype,
            dtype=dtype or param_dtype,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` for this architecture (read by `transformers`)."""
        if self.architecture == "qwen2" and not self.attention_bias:
            raise UnsupportedArchitectureError("Qwen2 always has q/k/v bias; attention_bias=False cannot be saved as qwen2")
        if self.architecture != "qwen3" and self.qk_norm:
            raise UnsupportedArchitectureError(f"qk_norm=True cannot be saved as {self.architecture}")
        if self.architecture == "qwen3" and not self.qk_norm:
            raise UnsupportedArchitectureError("Qwen3 always has q/k norm; qk_norm=False cannot be saved as qwen3")
        hf: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if self.architecture != "qwen2":
            hf["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            hf["mlp_bias"] = False
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return hf
