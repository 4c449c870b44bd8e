"""Agentic RL from a local Qwen3-0.6B Hugging Face checkpoint, for a GPU or TPU host.

Run (no download: point at a folder holding config.json, *.safetensors and tokenizer.json):
  python launch/tpu_run.py --config configs/qwen3_0_6b_agentic.py \
      --config.checkpoint.hf_path=/models/Qwen3-0.6B [--config.mesh.tensor=4]

The architecture, weights and tokenizer come from the folder (the `model` fields below only
describe Qwen3-0.6B for a run without a checkpoint, e.g. throughput checks with random weights);
turns use the checkpoint's own chat template and Qwen3's tool format (the tools in the template's
<tools> block, results as <tool_response> in a user turn), thinking off unless
--config.rollout.enable_thinking=True (then --config.rollout.max_think_tokens caps each think block).
"""

import os

from jaxrl_agent import config_lib


def get_config():
    config = config_lib.load_config(os.path.join(os.path.dirname(__file__), "calculator_tiny.py"))
    config.unlock()
    config.workdir = "runs/qwen3_0_6b_agentic"  # Where checkpoints and metrics go.
    config.tokenizer.kind = "hf"  # The checkpoint's own tokenizer.json.
    config.tokenizer.path = ""  # '' = tokenizer.json in checkpoint.hf_path.
    config.tokenizer.template = "model"  # The checkpoint's own chat template (tokenizer_config.json).
    config.tokenizer.tool_format = "qwen3"  # <tools> block, <tool_call> JSON, <tool_response> in a user turn.
    config.checkpoint.hf_path = ""  # Required: the local Hugging Face folder (--config.checkpoint.hf_path=...).
    config.checkpoint.param_dtype = "bfloat16"  # Parameter dtype after loading.
    config.checkpoint.compute_dtype = "bfloat16"  # Activation dtype (logits stay float32).
    config.learner.master_dtype = "float32"  # float32 master weights and AdamW moments (lr 1e-6 is below bf16's step).
    config.checkpoint.every = 20  # Save every N RL iterations.
    # Qwen3-0.6B's shape (used only without a checkpoint).
    config.model.architecture = "qwen3"  # Hugging Face model_type.
    config.model.vocab_size = 151936  # Qwen3 vocabulary.
    config.model.hidden_size = 1024  # Model width.
    config.model.intermediate_size = 3072  # SwiGLU width.
    config.model.num_layers = 28  # Decoder blocks.
    config.model.num_heads = 16  # Query heads.
    config.model.num_kv_heads = 8  # Key/value heads.
    config.model.head_dim = 128  # Per-head width.
    config.model.rope_theta = 1000000.0  # RoPE base.
    config.model.qk_norm = True  # Qwen3's q/k RMSNorm.
    config.model.max_position_embeddings = 40960  # Longest context of the checkpoint.
    config.model.param_dtype = "bfloat16"  # Parameter storage dtype.
    config.model.dtype = "bfloat16"  # Activation dtype.
    config.model.remat = True  # Recompute blocks in the backward pass (memory for compute).
    config.model.scan_layers = True  # One compiled block for 28 layers.
    config.sampler.max_concurrent_decodes = 128  # KV-cache slots.
    config.sampler.max_prefill_length = 1024  # Longest prompt (power of two).
    config.sampler.max_cache_length = 1024  # Tokens per slot.
    config.sampler.steps_per_call = 8  # Decode steps per generate call.
    config.sampler.prefix_cache_entries = 32  # ~112 MiB each in bfloat16 at this cache length.
    config.sampler.local_engines = 1  # One engine (auto picks 1 off CPU too; two would hold two weight copies).
    config.rollout.include_system_prompt = True  # The environment's instructions (how to answer).
    config.rollout.max_tokens_per_turn = 256  # Longest assistant turn.
    config.rollout.max_context = 1024  # Longest episode (<= learner.row_length).
    config.rollout.schedule = "windowed_fifo"  # Do not wait for the slowest episode.
    config.rollout.token_budget = 512  # Partial rollouts: tokens per episode per iteration.
    config.sft.steps = 50  # A short format warm-up; the checkpoint already knows arithmetic.
    config.sft.batch_size = 32  # Expert episodes per update.
    config.sft.learning_rate = 1e-5  # Fine-tuning a pretrained model.
    config.rl.learning_rate = 1e-6  # RL on a pretrained model.
    config.rl.iterations = 100  # Sample -> learn iterations.
    config.rl.time_budget_minutes = 0.0  # No wall-clock budget (the tiny default's 14 minutes is for 2 CPU cores).
    config.learner.row_length = 1024  # Tokens per packed learner row.
    config.learner.microbatches = 4  # Gradient accumulation.
    # 128 positions x 151,936 vocabulary x 4 bytes = 78 MB of logits per row at a time, not 622 MB.
    # Remat and this chunk hold for 0.6B, 1.7B and 8B (benchmarks/RESULTS.md, "Remat and the logits chunk per size").
    config.learner.logits_chunk = 128
    # Output projection and softmax only at trained positions (RL rows are mostly prompt, tool output
    # and padding; at a 151,936-token vocabulary the projection dominates the step).
    config.learner.target_multiple = 64
    config.smoke.seq_len = 64  # Tokens per row in the forward-pass check.
    # The estimator's own advantages: calculator_tiny's 0.25 was measured on its tiny model alone
    # (and leaning on the successes narrows exploration; losses.weight_negative_advantages).
    config.rl.negative_advantage_weight = 1.0
    return config.lock()
