"""Advantage estimators for outcome rewards of grouped rollouts (no value network).

Rewards of G prompts x N samples each are `[G, N]`; the estimators return advantages of the same
shape, to be broadcast over each sequence's tokens by the policy losses.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp


def _group_rewards(rewards: jax.Array, *, min_samples: int = 1) -> jax.Array:
    chex.assert_rank(rewards, 2)
    if rewards.shape[1] < min_samples:
        raise ValueError(f"rewards [G, N] need N >= {min_samples} samples per group, got shape {rewards.shape}")
    return rewards.astype(jnp.float32)


def group_advantages(rewards: jax.Array, *, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """GRPO group-relative advantages.

      A_i = (R_i - mean_j R_j) / (std_j R_j + eps)     (normalize_std=True; GRPO, Shao et al. 2024,
                                                         "DeepSeekMath"; std with N-1, unbiased)
      A_i =  R_i - mean_j R_j                           (normalize_std=False; Dr. GRPO, Liu et al. 2025)

    A group whose rewards are all equal gets exactly 0 (no float residue from the mean).

    Args:
      rewards: [G, N] rewards of N samples for each of G prompts.

    Returns:
      [G, N] float32 advantages.
    """
    r = _group_rewards(rewards)
    n = r.shape[1]
    mean = jnp.mean(r, axis=1, keepdims=True)
    constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    centered = jnp.where(constant, 0.0, r - mean)
    if not normalize_std:
        return centered
    if n < 2:
        return jnp.zeros_like(r)
    std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / (n - 1))
    return centered / (std + eps)


def rloo_advantages(rewards: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out: A_i = R_i - (1/(N-1)) sum_{j != i} R_j.

    (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024.)

    Args:
      rewards: [G, N] with N >= 2.

    Returns:
      [G, N] float32.
    """
    r = _group_rewards(rewards, min_samples=2)
    n = r.shape[1]
    loo_mean = (jnp.sum(r, axis=1, keepdims=True) - r) / (n - 1)
    constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    return jnp.where(constant, 0.0, r - loo_mean)


def ploo_advantages(rewards: jax.Array, *, tau: float) -> jax.Array:
    """Kimi k1.5's leave-one-out soft baseline: A_i = R_i - tau * log mean_{j != i} exp(R_j / tau).

    The baseline is tau * log Z estimated from the other samples (Kimi Team 2025, "Kimi k1.5",
    eq. 3); computed with a masked logsumexp, so it is stable for any tau > 0. As tau -> inf it
    tends to the RLOO baseline; as tau -> 0 to the max of the others.

    Args:
      rewards: [G, N] with N >= 2.  tau: temperature > 0.

    Returns:
      [G, N] float32.
    """
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    r = _group_rewards(rewards, min_samples=2)
    n = r.shape[1]
    others = ~jnp.eye(n, dtype=bool)  # [N, N]: row i selects j != i
    scaled = jnp.broadcast_to((r / tau)[:, None, :], (r.shape[0], n, n))
    log_mean = jax.nn.logsumexp(scaled, axis=-1, where=others[None]) - jnp.log(n - 1.0)
    return r - tau * log_mean


def weight_negative_advantages(advantages: jax.Array, negative_weight: float) -> jax.Array:
    """Scales the negative advantages by w, leaving the others as they are:

      A'_i = A_i          if A_i >= 0
      A'_i = w * A_i      if A_i <  0          (w = negative_weight >= 0; w = 1: unchanged)

    The policy gradient of a group splits into positive-sample reinforcement (PSR: raising the
    likelihood of the samples above the baseline) and negative-sample reinforcement (NSR: lowering
    that of the ones below it). Zhu et al. 2025 ("The Surprising Effectiveness of Negative
    Reinforcement in LLM Reasoning") train W-REINFORCE, lambda * PSR + NSR; this is that sum with
    lambda = 1 / w, up to the step size (which Adam's normalisation absorbs). They found PSR raises
    pass@1 soonest and narrows exploration (pass@k at large k falls), NSR keeps it, and lambda = 0.1
    (w = 10) best for pass@k. w < 1 leans on the successes: on the tiny calculator default, w = 0.25
    reached +15 points of greedy pass@1 in ~103 RL iterations against ~137 at w = 1 (three seeds;
    benchmarks/RESULTS.md). w = 0 keeps only the positive samples (RAFT-like, with the group's mean
    as the cut). A group-centred advantage no longer sums to zero for w != 1.

    Args:
      advantages: any shape, e.g. [G, N] from the estimators above.
      negative_weight: w >= 0, finite (a Python number).

    Returns:
      float32 advantages of the same shape.
    """
    if not (math.isfinite(negative_weight) and negative_weight >= 0):
        raise ValueError(f"negative_weight must be finite and >= 0, got {negative_weight}")
    a = jnp.asarray(advantages, jnp.float32)
    return jnp.where(a < 0, jnp.float32(negative_weight) * a, a)


def reinforce_baseline_advantages(rewards: jax.Array, *, normalize_std: bool = False, eps: float = 1e-6) -> jax.Array:
    """REINFORCE with a batch-mean baseline (Williams 1992): A_i = R_i - mean_batch R.

    Args:
      rewards: [B] (any shape; the mean is over all of it).
      normalize_std: also divide by the batch std (REINFORCE++ style global normalisation).

    Returns:
      float32 advantages, same shape.
    """
    r = rewards.astype(jnp.float32)
    centered = r - jnp.mean(r)
    if normalize_std:
        return centered / (jnp.std(r) + eps)
    return centered


def turn_reward_to_go(turn_rewards: jax.Array, turn_mask: jax.Array, *, gamma: float = 1.0) -> jax.Array:
    """Per-turn discounted return for multi-turn credit: G_k = sum_{k' >= k, valid} gamma^(k'-k) r_k'.

    Turn k's tokens get the reward of turn k and of every later turn, so a tool call is credited
    with what followed it but not with what came before (REINFORCE's causality; Sutton & Barto).

    Args:
      turn_rewards: [B, K] rewards attributed to each turn (e.g. a format reward per call and the
        outcome reward on the last turn).
      turn_mask: [B, K] 1 for turns that exist.
      gamma: discount per turn.

    Returns:
      [B, K] float32 returns, 0 on missing turns.
    """
    chex.assert_rank(turn_rewards, 2)
    chex.assert_equal_shape([turn_rewards, turn_mask])
    r = jnp.where(turn_mask.astype(bool), turn_rewards.astype(jnp.float32), 0.0)

    def step(carry, reward):
        ret = reward + gamma * carry
        return ret, ret

    _, returns = jax.lax.scan(step, jnp.zeros(r.shape[0], jnp.float32), r.T, reverse=True)
    return jnp.where(turn_mask.astype(bool), returns.T, 0.0)


def turn_values_to_tokens(turn_values: jax.Array, token_turn_index: jax.Array) -> jax.Array:
    """Spreads per-turn values [B, K] onto tokens: out[b, t] = turn_values[b, token_turn_index[b, t]].

    Args:
      turn_values: [B, K].  token_turn_index: [B, T] int turn of each token (any value for tokens
        that the loss mask drops; it is clipped into range).

    Returns:
      [B, T] float32.
    """
    chex.assert_rank([turn_values, token_turn_index], 2)
    idx = jnp.clip(token_turn_index, 0, turn_values.shape[1] - 1)
    return jnp.take_along_axis(turn_values.astype(jnp.float32), idx, axis=1)
