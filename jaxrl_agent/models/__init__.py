"""The Llama-3 / Qwen2 / Qwen3 dense transformer family: pure forward and KV-cache decode,
Hugging Face checkpoint import and export. Knows nothing of RL."""

from jaxrl_agent.models.config import (
    ModelConfig,
    RopeScaling,
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
)
from jaxrl_agent.models.hf_checkpoint import CheckpointError, load_hf, read_hf_config, save_hf
from jaxrl_agent.models.transformer import (
    KVCache,
    Transformer,
    count_params,
    decode_step,
    extend,
    forward,
    init_cache,
    init_params,
    positions_from_segments,
    prefill,
    rope_inverse_frequencies,
    token_logprobs,
    token_logprobs_and_entropy,
    unstack_layers,
)

__all__ = [
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "SUPPORTED_ARCHITECTURES",
    "Transformer",
    "UnsupportedArchitectureError",
    "count_params",
    "decode_step",
    "extend",
    "forward",
    "init_cache",
    "init_params",
    "load_hf",
    "positions_from_segments",
    "prefill",
    "read_hf_config",
    "rope_inverse_frequencies",
    "save_hf",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "unstack_layers",
]
