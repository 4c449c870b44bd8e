"""KL penalties against a reference policy and entropy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_agent.losses._common import as_float_mask, clamped_log_ratio, masked_mean, token_arrays

# k3's value is clamped to this range (as in common RLHF trainers' "low_var_kl"): a single token
# whose log-ratio explodes must not dominate the batch.
K3_CLAMP = 10.0


def kl_penalty(
    logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, *, estimator: str = "k3"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples y ~ pi_theta.

    With x = log pi_theta(y_t) - log pi_ref(y_t) (clamped to +-20):
      k1 = x                       unbiased, high variance, can be negative
      k2 = x^2 / 2                 biased, low variance; its gradient is that of the true KL
      k3 = exp(-x) - 1 + x         unbiased, non-negative, low variance; clamped to [-10, 10]
    (Schulman 2020, "Approximating KL divergence".)

    Args:
      logprobs, ref_logprobs, mask: [B, T].  estimator: 'k1', 'k2' or 'k3'.

    Returns:
      ([B, T] per-token penalty, 0 where masked; metrics).
    """
    lp, ref = token_arrays(mask, logprobs, ref_logprobs)
    x = clamped_log_ratio(lp, ref)
    if estimator == "k1":
        values = x
    elif estimator == "k2":
        values = 0.5 * x**2
    elif estimator == "k3":
        values = jnp.clip(jnp.exp(-x) - 1.0 + x, -K3_CLAMP, K3_CLAMP)
    else:
        raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
    values = values * as_float_mask(mask)
    return values, {f"kl_{estimator}/mean": masked_mean(values, mask)}


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """H(softmax(logits)) = -sum_v p_v log p_v in float32.

    Args:
      logits: [..., V].

    Returns:
      [...] entropies (nats).
    """
    chex.assert_rank(logits, {2, 3})
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
