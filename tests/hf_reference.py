"""Tiny random Hugging Face reference models (transformers + torch CPU), for parity tests only."""

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3")


def make_hf_model(arch: str, *, tie: bool = False, llama3_rope: bool = False, seed: int = 0,
                  num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None):
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    rope = {"rope_type": "default", "rope_theta": 5000.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope, head_dim=head_dim or 8)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters=rope)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_parameters=rope, head_dim=head_dim or 16)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the parity test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def train_tiny_hf_tokenizer(folder):
    """A 400-id byte-level BPE tokenizer.json (+ tokenizer_config.json) trained on a toy corpus."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "Q: 17*23+5=? answer 396"] * 50
    hf.train_from_iterator(corpus, trainer)
    hf.save(str(folder / "tokenizer.json"))
    from tests import real_vocab  # a Qwen3-style chat template (configs/qwen3_0_6b_agentic.py renders with it)

    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": real_vocab.template_text("qwen3_style.jinja")}))
