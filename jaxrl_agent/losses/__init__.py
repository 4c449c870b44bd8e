"""Pure loss functions for LLM policy optimisation (arrays in, (loss, metrics) out).

Only jax and chex are imported here: no model, no config. See docs/losses.md for the table of
losses with formulas and papers, and `make_objective` for composing them.
"""

from jaxrl_agent.losses.advantages import (
    group_advantages,
    ploo_advantages,
    reinforce_baseline_advantages,
    rloo_advantages,
    turn_reward_to_go,
    turn_values_to_tokens,
    weight_negative_advantages,
)
from jaxrl_agent.losses.corrections import drift_metrics, icepop_mask, truncated_importance_weights
from jaxrl_agent.losses.objective import (
    POLICY_LOSSES,
    TIS,
    CustomTerm,
    Decoupled,
    DistillTerm,
    EntropyTerm,
    IcePop,
    KLTerm,
    LossInputs,
    Objective,
    ObjectiveSpec,
    PolicyTerm,
    default_objective_spec,
    make_objective,
    objective_from_loss,
)
from jaxrl_agent.losses.policy import (
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    mirror_descent_loss,
    ppo_clip_loss,
    reinforce_loss,
    token_clip_keep_mask,
)
from jaxrl_agent.losses.reductions import masked_sequence_mean, masked_sequence_sum_norm, masked_token_mean
from jaxrl_agent.losses.regularizers import distillation_loss, entropy_from_logits, kl_penalty

__all__ = [
    "CustomTerm", "Decoupled", "DistillTerm", "distillation_loss", "EntropyTerm", "IcePop", "KLTerm", "LossInputs", "Objective", "ObjectiveSpec", "POLICY_LOSSES",
    "PolicyTerm", "TIS", "cispo_loss", "decoupled_ppo_loss", "default_objective_spec", "drift_metrics",
    "entropy_from_logits", "group_advantages", "gspo_loss", "icepop_mask", "kl_penalty", "make_objective", "objective_from_loss",
    "masked_sequence_mean", "masked_sequence_sum_norm", "masked_token_mean", "mirror_descent_loss",
    "ploo_advantages", "ppo_clip_loss", "reinforce_baseline_advantages", "reinforce_loss", "rloo_advantages",
    "token_clip_keep_mask", "truncated_importance_weights", "turn_reward_to_go", "turn_values_to_tokens",
    "weight_negative_advantages",
]
