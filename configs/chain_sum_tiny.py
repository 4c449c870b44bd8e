"""The tiny default as an orchestrator with frozen sub-agents, on the composite `chain_sum` tasks.

Add the values at the ends of two or three chains of a log. Inline, every read of every chain stays
in the transcript: past level 1 it outgrows `rollout.max_context` = 240 tokens and the episode ends
unanswered. With `rollout.delegate='initial'` the policy calls `delegate` with a chain's first key,
one call per chain in one reply; each runs a frozen copy of the SFT policy on that chain (a `chain`
task, in a fresh context) and only its value comes back. The mixture trains the `chain` skill the
sub-agents use in SFT; RL trains the orchestrator only, rewarded for correct sums alone.

Run:
  python launch/tpu_run.py --config configs/chain_sum_tiny.py
  python launch/tpu_run.py --config configs/chain_sum_tiny.py --config.rollout.delegate=   # inline only
"""

import os

import ml_collections

from jaxrl_agent import config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.load_config(os.path.join(os.path.dirname(__file__), "calculator_tiny.py"))
    config.unlock()
    config.workdir = "runs/chain_sum_tiny"  # Where checkpoints and metrics go.
    config.env.name = "chain_sum"  # Composite tasks: the sum of several chains' values.
    config.env.mixture = "chain_sum:1,chain:1"  # chain: the skill the sub-agents bring (trained in SFT).
    config.env.train_difficulties = "1,2,3"  # chain_sum: (2 chains, 1 read), (2, 2), (3, 2); chain: 1-3 reads.
    config.env.eval_difficulties = "1,2,3"  # Held-out levels (the same).
    config.rollout.delegate = "initial"  # Sub-agents: the SFT policy, frozen.
    config.rollout.delegate_max_subagents = 3  # One per chain.
    config.rollout.delegate_token_budget = 512  # A chain of two reads takes ~45 sampled tokens.
    # Greedy sub-agents in RL: sampled at the orchestrator's temperature 1 they read a chain right
    # ~72% of the time (greedy: 80-98%), and their mistakes, which no update can fix, were most of the
    # orchestrator's reward noise (benchmarks/RESULTS.md, delegation's third attempt).
    config.rollout.delegate_temperature = 0.0
    config.rollout.max_context = 240  # Inline, two chains of two reads need ~255 tokens; delegating ~185.
    config.rollout.max_turns = 10  # Inline: every read, the calc and the answer.
    config.rollout.max_tokens_per_turn = 64  # A reply delegating three chains is ~61 tokens.
    config.sampler.max_prefill_length = 256  # A power of two >= rollout.max_context - 1 (a turn's prompt).
    config.sampler.max_cache_length = 320  # >= a prompt of max_context plus a reply.
    config.learner.row_length = 256  # >= rollout.max_context.
    # chain's key and value copies: ~300 updates of 64 half-chain batches (in a calculator:1,chain:1
    # mixture, levels 1-3: 1.00 / 0.91 / 1.00 held-out); 300 of 32 with a third chain learned nothing.
    config.sft.steps = 400
    config.sft.batch_size = 64  # Expert episodes per update.
    # The estimator's own advantages: calculator_tiny's 0.25 was measured on its calculator alone.
    config.rl.negative_advantage_weight = 1.0
    return config.lock()
