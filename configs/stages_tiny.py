"""A stage list on the tiny default: SFT on two environments, RL on calculator, then RL on chain
distilling from the calculator stage's policy on calculator's own tasks (GLM's staged RL with
cross-stage distillation).

Run:
  python launch/tpu_run.py --config configs/stages_tiny.py
  python launch/tpu_run.py --config configs/stages_tiny.py --config.stage.chain.rl.distill_coef=0.0
Each stage runs in runs/stages_tiny/stages/<i>_<name>; runs/stages_tiny/metrics.jsonl has a
'stage_eval' record per stage: held-out success on both environments, so forgetting is visible.
"""

import os

import ml_collections

from jaxrl_agent import config_lib


def get_config() -> ml_collections.ConfigDict:
    config = config_lib.load_config(os.path.join(os.path.dirname(__file__), "calculator_tiny.py"))
    config.unlock()
    config.workdir = "runs/stages_tiny"  # Where the stages' folders and the list's metrics go.
    config.rollout.max_context = 192  # chain's 3-read episodes are ~175 tokens.
    config.sampler.max_prefill_length = 256  # A power of two >= rollout.max_context - 1.
    config.sampler.max_cache_length = 256  # >= rollout.max_context.
    config.learner.row_length = 256  # >= rollout.max_context.
    config.stages = "sft,calculator,chain"  # In order; each starts from the previous one's final policy.
    # SFT on both environments' demonstrations (levels 1-3 of each).
    config.stage.sft = ml_collections.ConfigDict({"env": {"mixture": "calculator:1,chain:1"}, "rl": {"iterations": 0}})
    # RL on calculator from the SFT policy.
    config.stage.calculator = ml_collections.ConfigDict({"sft": {"steps": 0}, "rl": {"iterations": 40}})
    # RL on chain, distilling from the calculator stage's final policy (rl.teacher 'initial') on a
    # quarter of calculator tasks, which carry no reward signal of their own here (rl.distill_envs):
    # chain's tasks learn from their rewards alone, calculator's keep the teacher's behaviour.
    config.stage.chain = ml_collections.ConfigDict({
        "sft": {"steps": 0},
        "env": {"name": "chain", "mixture": "chain:3,calculator:1", "train_difficulties": "1,2,3",
                "eval_difficulties": "1,2,3"},
        # learning_rate: the base's; listed so that a run can move B alone (--config.stage.chain.rl.learning_rate).
        "rl": {"iterations": 40, "distill_coef": 0.1, "distill_envs": "calculator", "learning_rate": 2e-4},
    })
    # The estimator's own advantages: calculator_tiny's 0.25 was measured on its calculator alone.
    config.rl.negative_advantage_weight = 1.0
    return config.lock()
