"""Policy-gradient objectives for LLM policies.

Conventions (all arrays float32 after masking):
  logprobs      [B, T]  log pi_theta(y_t | ...) under the parameters being trained
  old_logprobs  [B, T]  log pi_old: the policy the sample is compared against (trust region anchor)
  advantages    [B] or [B, T]
  mask          [B, T]  1 where the policy generated the token
Every loss returns `(values, metrics)`: `values` is `[B, T]` per token (0 where masked) or `[B]` per
sequence; reduce it with `jaxrl_agent.losses.reductions`. Losses are to be *minimised*.
Masked positions are replaced by 0 before any arithmetic, so whatever they hold (even inf / NaN)
changes neither the loss nor its gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent.losses._common import (
    as_float_mask,
    clamped_log_ratio,
    k3,
    masked_fraction,
    masked_max,
    masked_mean,
    sequence_advantages,
    token_advantages,
    token_arrays,
)

Metrics = dict[str, jax.Array]


def _ratio_metrics(prefix: str, ratio: jax.Array, log_ratio: jax.Array, mask: jax.Array) -> Metrics:
    # k3 estimate of KL(pi_old || pi_theta) (Schulman 2020, "Approximating KL divergence").
    approx_kl = masked_mean(k3(log_ratio), mask)
    return {
        f"{prefix}/ratio_mean": masked_mean(ratio, mask),
        f"{prefix}/ratio_max": masked_max(ratio, mask),
        f"{prefix}/approx_kl": approx_kl,
    }


def reinforce_loss(logprobs: jax.Array, advantages: jax.Array, mask: jax.Array) -> tuple[jax.Array, Metrics]:
    """REINFORCE: l_t = -A * log pi_theta(y_t)  (Williams 1992).

    Args:
      logprobs: [B, T].  advantages: [B] or [B, T].  mask: [B, T].

    Returns:
      ([B, T] per-token loss, metrics).
    """
    (lp,) = token_arrays(mask, logprobs)
    adv = token_advantages(advantages, mask)
    loss = -adv * lp * as_float_mask(mask)
    return loss, {"reinforce/advantage_mean": masked_mean(adv, mask)}


def ppo_clip_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped surrogate with asymmetric (clip-higher) bounds and optional dual clip.

      r_t = exp(clamp(log pi_theta - log pi_old))
      l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)        (Schulman et al. 2017)
      dual clip, A_t < 0:  l_t = min(l_t, -c A_t)                           (Ye et al. 2020, c > 1)

    eps_high > eps_low is DAPO's clip-higher (Yu et al. 2025), leaving room for low-probability
    tokens to rise. The log-ratio is clamped to +-20 before exp.

    Args:
      logprobs, old_logprobs, mask: [B, T].  advantages: [B] or [B, T].
      eps_low, eps_high: trust-region bounds.  dual_clip: c > 1, or None.

    Returns:
      ([B, T] per-token loss, metrics incl. 'ppo/clip_frac_low' and 'ppo/clip_frac_high': the share
      of tokens whose gradient the lower / upper bound removes).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    lp, old = token_arrays(mask, logprobs, old_logprobs)
    adv = token_advantages(advantages, mask)
    log_ratio = clamped_log_ratio(lp, old)
    ratio = jnp.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = jnp.maximum(unclipped, clipped)
    metrics = _ratio_metrics("ppo", ratio, log_ratio, mask)
    if dual_clip is not None:
        dual = -dual_clip * adv
        metrics["ppo/dual_clip_frac"] = masked_fraction((adv < 0) & (loss > dual), mask)
        loss = jnp.where(adv < 0, jnp.minimum(loss, dual), loss)
    metrics["ppo/clip_frac_low"] = masked_fraction((ratio < 1.0 - eps_low) & (adv < 0), mask)
    metrics["ppo/clip_frac_high"] = masked_fraction((ratio > 1.0 + eps_high) & (adv > 0), mask)
    return loss * as_float_mask(mask), metrics


def gspo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[jax.Array, Metrics]:
    """Group Sequence Policy Optimization: a clipped surrogate on the length-normalised sequence ratio.

      s_i = exp( (1/|y_i|) sum_t (log pi_theta - log pi_old) )
      l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    (Zheng et al. 2025, "Group Sequence Policy Optimization"; their bounds are ~3e-4 / 4e-4 because
    s_i is a per-token geometric mean.)

    Args:
      logprobs, old_logprobs, mask: [B, T].  advantages: [B] (or [B, T], averaged per sequence).

    Returns:
      ([B] per-sequence loss, metrics). Sequences without tokens get 0.
    """
    lp, old = token_arrays(mask, logprobs, old_logprobs)
    adv = sequence_advantages(advantages, mask)
    m = as_float_mask(mask)
    lengths = jnp.sum(m, -1)
    present = lengths > 0
    mean_log_ratio = jnp.sum(clamped_log_ratio(lp, old) * m, -1) / jnp.maximum(lengths, 1.0)
    s = jnp.exp(mean_log_ratio)
    loss = jnp.maximum(-s * adv, -jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * adv)
    seq_mask = present[:, None]
    metrics = {
        "gspo/ratio_mean": masked_mean(s[:, None], seq_mask),
        "gspo/ratio_max": masked_max(s[:, None], seq_mask),
        "gspo/clip_frac_low": masked_fraction(((s < 1.0 - eps_low) & (adv < 0))[:, None], seq_mask),
        "gspo/clip_frac_high": masked_fraction(((s > 1.0 + eps_high) & (adv > 0))[:, None], seq_mask),
    }
    return jnp.where(present, loss, 0.0), metrics


def cispo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[jax.Array, Metrics]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

      l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(y_t)

    Unlike PPO no token's gradient is dropped; only its weight is bounded (MiniMax 2025,
    "MiniMax-M1", sec. 3.1). eps_low >= 1 means no lower bound.

    Args:
      logprobs, old_logprobs, mask: [B, T].  advantages: [B] or [B, T].

    Returns:
      ([B, T] per-token loss, metrics).
    """
    lp, old = token_arrays(mask, logprobs, old_logprobs)
    adv = token_advantages(advantages, mask)
    log_ratio = clamped_log_ratio(lp, old)
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, max(1.0 - eps_low, 0.0), 1.0 + eps_high))
    loss = -weight * adv * lp * as_float_mask(mask)
    metrics = _ratio_metrics("cispo", ratio, log_ratio, mask)
    metrics["cispo/clip_frac_low"] = masked_fraction(ratio < 1.0 - eps_low, mask)
    metrics["cispo/clip_frac_high"] = masked_fraction(ratio > 1.0 + eps_high, mask)
    return loss, metrics


def token_clip_keep_mask(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    delta: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Which tokens stay in the policy-gradient term (token-level clipping), and how many left.

    A token is removed when its ratio r_t = pi_theta / pi_old leaves [1 - eps_low, 1 + eps_high], or
    when its probability moved by more than delta in the direction its advantage pushes it:
    sign(A_t) * (pi_theta(y_t) - pi_old(y_t)) > delta (a probability-difference trust region, as in
    DPPO-style "delta" clipping). Computed without gradient. A bound set to None is not applied.

    Returns:
      (keep [B, T] float32 in {0, 1}, 0 where masked; metrics 'clip_frac_low' / 'clip_frac_high' /
      'clip_frac_delta').
    """
    lp, old = token_arrays(mask, logprobs, old_logprobs)
    adv = token_advantages(advantages, mask)
    lp, old = jax.lax.stop_gradient(lp), jax.lax.stop_gradient(old)
    ratio = jnp.exp(clamped_log_ratio(lp, old))
    low = ratio < 1.0 - eps_low if eps_low is not None else jnp.zeros_like(ratio, bool)
    high = ratio > 1.0 + eps_high if eps_high is not None else jnp.zeros_like(ratio, bool)
    if delta is not None:
        moved = jnp.sign(adv) * (jnp.exp(lp) - jnp.exp(old)) > delta
    else:
        moved = jnp.zeros_like(ratio, bool)
    keep = ~(low | high | moved)
    metrics = {
        "clip_frac_low": masked_fraction(low, mask),
        "clip_frac_high": masked_fraction(high, mask),
        "clip_frac_delta": masked_fraction(moved, mask),
    }
    return keep.astype(jnp.float32) * as_float_mask(mask), metrics


def mirror_descent_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float,
    level: str = "sequence",
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    clip_delta: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Kimi k1.5's relative-entropy-regularised policy mirror descent, with token-level clipping.

    Kimi k1.5 (Kimi Team 2025, sec. 2.3.2) maximises E[r] - tau KL(pi_theta || pi_old), whose
    optimum satisfies r - tau log Z = tau log(pi*/pi_old); it regresses that identity on samples:

      sequence level:  l_i = (A_i - tau * Delta_i)^2 / (2 tau |y_i|),
                       Delta_i = sum_t (log pi_theta - log pi_old),  A_i ~ r_i - tau log Z
      token level:     l_t = -A_t log pi_theta(y_t) + (tau/2) (log pi_theta - log pi_old)^2

    The sequence-level gradient is -(A_i - tau Delta_i)/|y_i| * sum_t grad log pi_theta: a
    policy-gradient part -A_i/|y_i| sum_t grad log pi and a regulariser tau Delta_i/|y_i| sum_t
    grad log pi. With token-level clipping (`token_clip_keep_mask`: ratio outside
    [1 - clip_eps_low, 1 + clip_eps_high], or probability moved more than clip_delta toward the
    advantage), clipped tokens leave the policy-gradient part only; the regulariser still applies
    to them and pulls them back. Sequence level is then computed in expanded form,
      l_i = [A_i^2 / (2 tau) - A_i sum_t keep_t (log pi_theta - log pi_old) + (tau/2) Delta_i^2] / |y_i|,
    which equals the square above when no token is clipped.

    Args:
      logprobs, old_logprobs, mask: [B, T].  advantages: [B] or [B, T] (sequence level takes the
        per-sequence mean).  tau: regularisation strength > 0.  level: 'sequence' or 'token'.

    Returns:
      ([B] per-sequence loss for level='sequence', [B, T] per-token for 'token'; metrics).
    """
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    lp, old = token_arrays(mask, logprobs, old_logprobs)
    m = as_float_mask(mask)
    log_ratio = clamped_log_ratio(lp, old) * m
    keep, metrics = token_clip_keep_mask(
        lp, old, advantages, mask, eps_low=clip_eps_low, eps_high=clip_eps_high, delta=clip_delta
    )
    metrics = {f"mirror_descent/{k}": v for k, v in metrics.items()}
    metrics.update(_ratio_metrics("mirror_descent", jnp.exp(log_ratio), log_ratio, mask))
    if level == "token":
        adv = token_advantages(advantages, mask)
        loss = (-keep * adv * lp + 0.5 * tau * log_ratio**2) * m
        return loss, metrics
    adv = sequence_advantages(advantages, mask)
    lengths = jnp.sum(m, -1)
    delta_total = jnp.sum(log_ratio, -1)
    kept_log_ratio = jnp.sum(keep * log_ratio, -1)
    loss = (adv**2 / (2 * tau) - adv * kept_log_ratio + 0.5 * tau * delta_total**2) / jnp.maximum(lengths, 1.0)
    return jnp.where(lengths > 0, loss, 0.0), metrics


def decoupled_ppo_loss(
    logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    behaviour_weight_cap: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Decoupled PPO: the trust region is around a proximal policy, not the behaviour policy.

      w_t = sg(pi_prox / pi_behav)   (optionally capped)       r_t = pi_theta / pi_prox
      l_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    With asynchronous rollouts the behaviour policy (whatever versions sampled the tokens) may be
    several updates stale; decoupling keeps PPO's trust region on the recent proximal policy while
    w corrects for the stale sampling (Hilton et al. 2022, "Batch size-invariance for policy
    optimization"; Fu et al. 2025, "AReaL", eq. 5).

    Args:
      logprobs, proximal_logprobs, behaviour_logprobs, mask: [B, T].  advantages: [B] or [B, T].
      behaviour_weight_cap: cap on w (truncated IS), or None.

    Returns:
      ([B, T] per-token loss, metrics).
    """
    lp, prox, behav = token_arrays(mask, logprobs, proximal_logprobs, behaviour_logprobs)
    surrogate, metrics = ppo_clip_loss(lp, prox, advantages, mask, eps_low=eps_low, eps_high=eps_high)
    weight = jnp.exp(clamped_log_ratio(prox, behav))
    if behaviour_weight_cap is not None:
        weight = jnp.minimum(weight, behaviour_weight_cap)
    weight = jax.lax.stop_gradient(weight)
    metrics = {k.replace("ppo/", "decoupled_ppo/"): v for k, v in metrics.items()}
    metrics["decoupled_ppo/behaviour_weight_mean"] = masked_mean(weight, mask)
    metrics["decoupled_ppo/behaviour_weight_max"] = masked_max(weight, mask)
    return weight * surrogate, metrics
