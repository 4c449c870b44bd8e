"""The tiny default on the long-horizon `chain` environment, with context management.

Follow a chain of log records one `read` at a time; every read adds ~40 tokens, so chains of 3 or
more reads outgrow `rollout.max_context` = 160 tokens. With `rollout.context='none'` those episodes
end at the limit unanswered; `keep_recent` (one kept turn) and `summarize` go on past it.

Run:
  python launch/tpu_run.py --config configs/chain_tiny.py
  python launch/tpu_run.py --config configs/chain_tiny.py --config.rollout.context=summarize
Compare the strategies at equal wall time: benchmarks/context_strategies.py.
"""

import os

import ml_collections

from jaxrl_agent import config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.load_config(os.path.join(os.path.dirname(__file__), "calculator_tiny.py"))
    config.unlock()
    config.workdir = "runs/chain_tiny"  # Where checkpoints and metrics go.
    config.env.name = "chain"  # Follow a chain of records; difficulty = reads.
    config.env.train_difficulties = "1,2,3,4,5,6"  # 1-2 fit in the context; 3-6 need context management.
    config.env.eval_difficulties = "1,2,3,4,5,6"  # Held-out levels (the same).
    config.rollout.max_context = 160  # Tokens per learner sequence (the context the policy sees).
    config.rollout.max_turns = 12  # Assistant turns per episode (reads and the answer; summaries not counted).
    config.rollout.max_tokens_per_turn = 32  # A read or an answer is ~15 tokens, a summary ~10.
    config.rollout.context = "keep_recent"  # Only the latest record matters to go on.
    config.rollout.context_keep_turns = 1  # The latest read and its record.
    config.rollout.context_trigger = 0.6  # Counts the summary request; leaves 64 tokens for the summary.
    config.sampler.max_prefill_length = 256  # A power of two >= rollout.max_context - 1 (a turn's prompt).
    config.sampler.max_cache_length = 256  # >= max_prefill_length and rollout.max_context.
    config.learner.row_length = 160  # >= rollout.max_context.
    config.sft.steps = 300  # The key and value copies emerge after ~150 updates of 32.
    config.sft.batch_size = 32  # Expert episodes per update (~2 s per update on 2 cores).
    # The estimator's own advantages: calculator_tiny's 0.25 was measured on its calculator alone.
    config.rl.negative_advantage_weight = 1.0
    return config.lock()
