"""Corrections for train / inference mismatch and staleness between sampler and learner.

The sampler's log-probabilities differ from the learner's even at the same weights (different
kernels, precision, batch shapes) and more so when the sampling weights are stale. These functions
turn the ratio rho_t = pi_learner(y_t) / pi_sampler(y_t) into per-token weights or masks that a
policy loss applies. All are computed without gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent.losses._common import as_float_mask, clamped_log_ratio, k3, masked_fraction, masked_max, masked_mean, token_arrays

LEVELS = ("token", "sequence")


def _log_ratio(logprobs, sampler_logprobs, mask, level):
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    lp, slp = token_arrays(mask, logprobs, sampler_logprobs)
    m = as_float_mask(mask)
    log_ratio = jax.lax.stop_gradient(clamped_log_ratio(lp, slp)) * m
    if level == "sequence":
        # Geometric mean over the sequence's tokens, the same value on every token.
        mean = jnp.sum(log_ratio, -1, keepdims=True) / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0)
        log_ratio = jnp.broadcast_to(mean, log_ratio.shape) * m
    return log_ratio


def truncated_importance_weights(
    logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array, *, cap: float = 2.0, level: str = "token"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Truncated importance sampling (TIS): w_t = min(rho_t, cap), stop-gradient.

    Multiplying a policy loss by w corrects for sampling from pi_sampler instead of pi_learner
    while bounding the variance (Ionides 2008; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"). level='sequence' uses the geometric mean
    rho_i = exp(mean_t log rho_t) for every token of sequence i.

    Args:
      logprobs, sampler_logprobs, mask: [B, T].  cap: > 0.

    Returns:
      (weights [B, T], 0 where masked; metrics 'tis/weight_mean', 'tis/weight_max',
      'tis/capped_frac').
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    log_ratio = _log_ratio(logprobs, sampler_logprobs, mask, level)
    rho = jnp.exp(log_ratio)
    weights = jnp.minimum(rho, cap) * as_float_mask(mask)
    metrics = {
        "tis/weight_mean": masked_mean(weights, mask),
        "tis/weight_max": masked_max(weights, mask),
        "tis/capped_frac": masked_fraction(rho > cap, mask),
    }
    return weights, metrics


def icepop_mask(
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    mask: jax.Array,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Double-sided masking (IcePop): drop tokens whose rho_t lies outside [low, high].

    Instead of re-weighting, tokens with too large a train/inference gap in either direction are
    removed from the gradient (Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale
    Thinking Model", IcePop). Bounds [0, inf) keep every token. level='sequence' drops whole
    sequences by their geometric-mean ratio.

    Args:
      logprobs, sampler_logprobs, mask: [B, T].  0 <= low <= high.

    Returns:
      (new mask [B, T] float32 (a subset of `mask`); metrics 'icepop/masked_frac',
      'icepop/masked_frac_low', 'icepop/masked_frac_high').
    """
    if not 0.0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low} high={high}")
    log_ratio = _log_ratio(logprobs, sampler_logprobs, mask, level)
    rho = jnp.exp(log_ratio)
    too_low, too_high = rho < low, rho > high
    keep = (~(too_low | too_high)).astype(jnp.float32) * as_float_mask(mask)
    metrics = {
        "icepop/masked_frac": masked_fraction(too_low | too_high, mask),
        "icepop/masked_frac_low": masked_fraction(too_low, mask),
        "icepop/masked_frac_high": masked_fraction(too_high, mask),
    }
    return keep, metrics


def drift_metrics(
    logprobs: jax.Array, old_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """How far the learner is from the sampler and from pi_old, per generated token.

    'drift/sampler_abs_diff_mean|max' = mean / max |log pi_learner - log pi_sampler|;
    'drift/approx_kl_old' = k3 estimate of KL(pi_old || pi_theta); 'drift/token_count'.
    """
    lp, old, slp = token_arrays(mask, logprobs, old_logprobs, sampler_logprobs)
    lp, old, slp = (jax.lax.stop_gradient(x) for x in (lp, old, slp))
    gap = jnp.abs(lp - slp)
    x = clamped_log_ratio(lp, old)
    return {
        "drift/sampler_abs_diff_mean": masked_mean(gap, mask),
        "drift/sampler_abs_diff_max": masked_max(gap, mask),
        "drift/approx_kl_old": masked_mean(k3(x), mask),
        "drift/token_count": jnp.sum(as_float_mask(mask)),
    }
