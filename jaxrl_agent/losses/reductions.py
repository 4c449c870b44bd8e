"""Named reductions from per-token (or per-sequence) losses to a scalar.

Which tokens carry how much weight is part of the objective, not an implementation detail:
  * `masked_token_mean`: every generated token of the batch weighs the same
    (DAPO's token-level loss; long answers get more total weight).
  * `masked_sequence_mean`: mean over tokens within a sequence, then over sequences
    (the original GRPO; each sequence weighs the same, which biases towards long wrong answers).
  * `masked_sequence_sum_norm`: sum over tokens divided by a constant `max_len`, mean over sequences
    (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"; no length bias).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_agent.losses._common import as_float_mask, sanitize


def masked_token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """sum_{b,t} m_bt v_bt / sum_{b,t} m_bt.

    Args:
      values: [B, T] per-token values.  mask: [B, T] (1 = counted).

    Returns:
      scalar; 0 when the mask is empty.
    """
    chex.assert_equal_shape([values, mask])
    m = as_float_mask(mask)
    return jnp.sum(sanitize(values, mask) * m) / jnp.maximum(jnp.sum(m), 1.0)


def masked_sequence_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """mean over sequences with >= 1 token of (sum_t m_bt v_bt / sum_t m_bt).

    Args:
      values: [B, T] per-token values, or [B] per-sequence values.  mask: [B, T].

    Returns:
      scalar; sequences without tokens are left out; 0 when all are empty.
    """
    chex.assert_rank(mask, 2)
    m = as_float_mask(mask)
    lengths = jnp.sum(m, -1)
    present = (lengths > 0).astype(jnp.float32)
    if values.ndim == 1:
        chex.assert_axis_dimension(values, 0, mask.shape[0])
        per_sequence = jnp.where(lengths > 0, values.astype(jnp.float32), 0.0)
    else:
        chex.assert_equal_shape([values, mask])
        per_sequence = jnp.sum(sanitize(values, mask) * m, -1) / jnp.maximum(lengths, 1.0)
    return jnp.sum(per_sequence * present) / jnp.maximum(jnp.sum(present), 1.0)


def masked_sequence_sum_norm(values: jax.Array, mask: jax.Array, max_len: int) -> jax.Array:
    """(1/B) sum_b sum_t m_bt v_bt / max_len  (Dr. GRPO's constant normaliser).

    Args:
      values: [B, T] per-token values, or [B] per-sequence sums.  mask: [B, T].
      max_len: the constant the token sum is divided by (typically the generation budget).
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    chex.assert_rank(mask, 2)
    if values.ndim == 1:
        chex.assert_axis_dimension(values, 0, mask.shape[0])
        has_tokens = jnp.sum(as_float_mask(mask), -1) > 0
        sums = jnp.where(has_tokens, values.astype(jnp.float32), 0.0)
    else:
        chex.assert_equal_shape([values, mask])
        sums = jnp.sum(sanitize(values, mask) * as_float_mask(mask), -1)
    return jnp.mean(sums) / max_len


REDUCTIONS = {
    "token_mean": masked_token_mean,
    "sequence_mean": masked_sequence_mean,
    "sequence_sum_norm": masked_sequence_sum_norm,
}
