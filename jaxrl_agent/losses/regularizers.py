"""KL penalties against a reference policy, on-policy distillation from a teacher, and entropy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_agent.losses._common import as_float_mask, clamped_log_ratio, k3, masked_mean, token_arrays

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
      k3 = exp(-x) - 1 + x         unbiased, non-negative, low variance; clamped to [0, 10]
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
        values = jnp.minimum(k3(x), K3_CLAMP)
    else:
        raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
    values = values * as_float_mask(mask)
    return values, {f"kl_{estimator}/mean": masked_mean(values, mask)}


def distillation_loss(logprobs: jax.Array, teacher_logprobs: jax.Array, mask: jax.Array
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """On-policy distillation: the reverse KL(pi_student || pi_teacher) on the student's own
    sampled tokens y_t ~ pi_student (GKD, Agarwal et al. 2024, arXiv 2306.13649; the cross-stage
    distillation of GLM-4.5, arXiv 2508.06471).

    With x = log pi_student(y_t) - log pi_teacher(y_t) (clamped to +-20), the per-token surrogate
    has the value of k3 = exp(-x) - 1 + x (unbiased for the KL, >= 0, 0 iff the two agree on the
    token; clamped to [0, 10]) and the gradient of the reverse KL's policy gradient,
    sg(x) * grad log pi_student(y_t), i.e. the per-token reward -x of on-policy distillation:

        surrogate_t = sg(k3_t) + sg(x_t) * (log pi_student(y_t) - sg(log pi_student(y_t)))

    Args:
      logprobs: [B, T] the student's (differentiable). teacher_logprobs: [B, T] the frozen
        teacher's. mask: [B, T] 1 on the student's sampled tokens.

    Returns:
      ([B, T] per-token surrogate, 0 where masked; metrics 'distill/kl_k3' and 'distill/kl_k1'
      (the masked means of k3 and of x)).
    """
    lp, teacher = token_arrays(mask, logprobs, teacher_logprobs)
    x = jax.lax.stop_gradient(clamped_log_ratio(lp, teacher))
    kl = jnp.minimum(k3(x), K3_CLAMP)
    values = (kl + x * (lp - jax.lax.stop_gradient(lp))) * as_float_mask(mask)
    return values, {"distill/kl_k3": masked_mean(kl, mask), "distill/kl_k1": masked_mean(x, mask)}


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
