"""Shared checks and masking helpers for the loss library (internal)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

# Log-ratios are clamped to this magnitude before exp: exp(20) ~ 5e8 is far outside every trust
# region yet finite in float32, so a wild token can't turn a loss into inf/NaN.
LOG_RATIO_CLAMP = 20.0


def as_float_mask(mask: jax.Array) -> jax.Array:
    return mask.astype(jnp.float32)


def sanitize(x: jax.Array, mask: jax.Array) -> jax.Array:
    """x where mask, else 0 — before any arithmetic, so masked garbage (inf, NaN) can reach
    neither the loss nor, through the backward pass, the gradient."""
    return jnp.where(mask.astype(bool), x.astype(jnp.float32), 0.0)


def token_arrays(mask: jax.Array, *arrays: jax.Array) -> list[jax.Array]:
    """Checks that every array is [B, T] like `mask` and returns them sanitized (float32)."""
    chex.assert_rank(mask, 2)
    for a in arrays:
        chex.assert_equal_shape([a, mask])
    return [sanitize(a, mask) for a in arrays]


def token_advantages(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Advantages [B] (one per sequence) or [B, T] -> [B, T] float32, zero where masked."""
    if advantages.ndim == 1:
        chex.assert_axis_dimension(advantages, 0, mask.shape[0])
        advantages = jnp.broadcast_to(advantages[:, None], mask.shape)
    else:
        chex.assert_equal_shape([advantages, mask])
    return sanitize(advantages, mask)


def sequence_advantages(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Advantages for sequence-level losses: [B], or [B, T] reduced by its masked token mean."""
    if advantages.ndim == 1:
        chex.assert_axis_dimension(advantages, 0, mask.shape[0])
        return advantages.astype(jnp.float32)
    chex.assert_equal_shape([advantages, mask])
    m = as_float_mask(mask)
    return jnp.sum(sanitize(advantages, mask) * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)


def clamped_log_ratio(logprobs: jax.Array, reference_logprobs: jax.Array) -> jax.Array:
    return jnp.clip(logprobs - reference_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k3(x: jax.Array) -> jax.Array:
    """Schulman's (2020) k3 estimate exp(-x) - 1 + x of a KL from log-ratios x, elementwise.

    Written expm1(-x) + x: in float32, exp(-x) - 1 + x loses the value to rounding for |x| below
    ~1e-3 (at |x| ~ 1e-4 about 44% of tokens come out negative, by up to 6e-8, against a true
    value of ~5e-9). The estimate is >= 0 by definition; rounding left below 0 is set to 0.
    """
    return jnp.maximum(jnp.expm1(-x) + x, 0.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = as_float_mask(mask)
    return jnp.sum(jnp.where(mask.astype(bool), x, 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Max over masked-in entries; 0 when there are none."""
    values = jnp.where(mask.astype(bool), x, -jnp.inf)
    result = jnp.max(values)
    return jnp.where(jnp.isfinite(result), result, 0.0)


def masked_fraction(condition: jax.Array, mask: jax.Array) -> jax.Array:
    """Share of masked-in tokens where `condition` holds."""
    return masked_mean(condition.astype(jnp.float32), mask)
