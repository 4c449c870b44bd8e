"""Start from a Hugging Face Llama-3 / Qwen2 / Qwen3 checkpoint folder (no download: a local path).

Run:
  python launch/tpu_run.py --config configs/hf_model.py \
      --config.checkpoint.hf_path=/path/to/Qwen3-0.6B --config.mesh.tensor=1
"""

import os

import ml_collections

from jaxrl_agent import config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.load_config(os.path.join(os.path.dirname(__file__), "calculator_tiny.py"))
    config.unlock()
    config.workdir = "runs/hf_model"  # Where checkpoints and metrics go.
    config.tokenizer.kind = "hf"  # The checkpoint's own tokenizer.json.
    config.tokenizer.path = ""  # '' = tokenizer.json in checkpoint.hf_path.
    config.tokenizer.template = "model"  # The checkpoint's own chat template (tokenizer_config.json).
    config.checkpoint.param_dtype = "bfloat16"  # Parameter dtype after loading.
    config.checkpoint.compute_dtype = "bfloat16"  # Activation dtype (logits stay float32).
    config.smoke.seq_len = 64  # Tokens per row in the forward-pass check.
    # Output projection and softmax only at trained positions (RL rows are mostly prompt, tool output
    # and padding; at a 151,936-token vocabulary the projection dominates the step).
    config.learner.target_multiple = 64
    config.rl.iterations = 100  # Sample -> learn iterations.
    config.rl.time_budget_minutes = 0.0  # No wall-clock budget (the tiny default's 14 minutes is for 2 CPU cores).
    # The estimator's own advantages: calculator_tiny's 0.25 was measured on its tiny model alone
    # (and leaning on the successes narrows exploration; losses.weight_negative_advantages).
    config.rl.negative_advantage_weight = 1.0
    return config.lock()
