"""Composing losses into one objective: `make_objective(spec) -> objective(logprobs, batch)`.

An objective is a sum of terms with coefficients, after corrections that re-weight or mask tokens:

    objective = make_objective(ObjectiveSpec(
        terms=(PolicyTerm("mirror_descent", tau=0.05, level="token", clip_eps_low=0.2, clip_eps_high=0.2),
               KLTerm("k3", coef=0.01)),
        corrections=(TIS(cap=2.0), IcePop(low=0.5, high=2.0)),
    ))
    loss, metrics = objective(logprobs, batch)   # pure; jit / grad / vmap as you like

`batch` is a `LossInputs` (or any mapping with the same keys). Corrections compare the learner's
log-probs with the sampler's: TIS multiplies policy terms by capped importance weights, IcePop drops
tokens from them, Decoupled weights them by pi_prox / pi_sampler (with `old_logprobs` = the proximal
policy). KL and entropy terms use the batch's original mask. A researcher's own term is any
callable `(logprobs, batch, mask, weights) -> (scalar, metrics)` wrapped in `CustomTerm`; a whole
pure loss with the signature of docs/contracts.md becomes an objective through `objective_from_loss`.

`make_objective` returns an `Objective`: the pure function plus what the learner must compute for
it — reference log-probs (a KL term: a second, frozen forward pass) and proximal log-probs (the
decoupled correction: the iteration's starting parameters, recomputed before its first update).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp

from jaxrl_agent.losses import corrections as corrections_lib
from jaxrl_agent.losses import policy, reductions, regularizers
from jaxrl_agent.losses._common import as_float_mask, masked_mean

Metrics = dict[str, jax.Array]


class LossInputs(NamedTuple):
    """Everything a loss may need besides the current log-probs. Token arrays are [B, T].

    Attributes:
      mask: 1 where the policy generated the token.
      advantages: [B] or [B, T].
      old_logprobs: pi_old, the trust-region anchor (e.g. the learner's log-probs before this
        update's first minibatch).
      sampler_logprobs: what the sampler reported; None = same as old_logprobs.
      ref_logprobs: frozen reference policy, for KL terms; None if unused.
      entropy: per-token entropy of the current policy (differentiable), for entropy terms.
      teacher_logprobs: frozen teacher policy (a previous stage's), for distillation terms.
      distill_mask: 1 on the generated tokens trained by distillation alone (the episodes of an
        earlier stage's environments, `rl.distill_envs`): distillation terms cover these and only
        these, and the policy-gradient terms leave them out (their token counts too, so the policy
        terms equal those of the batch without them). None = distillation terms cover every
        generated token (`mask`'s) and the policy terms do too.
    """

    mask: jax.Array
    advantages: jax.Array
    old_logprobs: jax.Array
    sampler_logprobs: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    entropy: jax.Array | None = None
    teacher_logprobs: jax.Array | None = None
    distill_mask: jax.Array | None = None


def _field(batch, name: str):
    return batch[name] if isinstance(batch, Mapping) else getattr(batch, name)


def _optional(batch, name: str):
    if isinstance(batch, Mapping):
        return batch.get(name)
    return getattr(batch, name, None)


def _reduce(values: jax.Array, mask: jax.Array, reduction: str, max_len: int | None) -> jax.Array:
    if reduction not in reductions.REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not one of {sorted(reductions.REDUCTIONS)}")
    if reduction == "sequence_sum_norm":
        if max_len is None:
            raise ValueError("reduction 'sequence_sum_norm' needs max_len")
        return reductions.masked_sequence_sum_norm(values, mask, max_len)
    if reduction == "token_mean" and values.ndim == 1:
        raise ValueError("a per-sequence loss cannot use reduction 'token_mean'; use 'sequence_mean'")
    return reductions.REDUCTIONS[reduction](values, mask)


# ---------------------------------------------------------------------------------- policy losses
def _reinforce(logprobs, batch, mask, **kw):
    return policy.reinforce_loss(logprobs, _field(batch, "advantages"), mask, **kw)


def _with_old(fn):
    def call(logprobs, batch, mask, **kw):
        return fn(logprobs, _field(batch, "old_logprobs"), _field(batch, "advantages"), mask, **kw)

    return call


def _decoupled(logprobs, batch, mask, **kw):
    behaviour = _optional(batch, "sampler_logprobs")
    old = _field(batch, "old_logprobs")
    return policy.decoupled_ppo_loss(
        logprobs, old, old if behaviour is None else behaviour, _field(batch, "advantages"), mask, **kw
    )


# name -> fn(logprobs, batch, mask, **kwargs) -> (values [B, T] or [B], metrics)
POLICY_LOSSES: dict[str, Callable[..., tuple[jax.Array, Metrics]]] = {
    "reinforce": _reinforce,
    "ppo_clip": _with_old(policy.ppo_clip_loss),
    "gspo": _with_old(policy.gspo_loss),
    "cispo": _with_old(policy.cispo_loss),
    "mirror_descent": _with_old(policy.mirror_descent_loss),
    "decoupled_ppo": _decoupled,
}


class Term(Protocol):
    """One summand of an objective: (logprobs, batch, policy mask, token weights) -> (scalar, metrics)."""

    def __call__(self, logprobs, batch, mask: jax.Array, weights: jax.Array) -> tuple[jax.Array, Metrics]: ...


@dataclasses.dataclass(frozen=True, init=False)
class PolicyTerm:
    """coef * reduction(weights * loss(logprobs, ...)) for a loss named in POLICY_LOSSES."""

    loss: str
    coef: float
    reduction: str
    max_len: int | None
    kwargs: tuple[tuple[str, Any], ...]

    def __init__(self, loss: str, *, coef: float = 1.0, reduction: str = "token_mean",
                 max_len: int | None = None, **kwargs):
        if loss not in POLICY_LOSSES:
            raise ValueError(f"policy loss {loss!r} is not one of {sorted(POLICY_LOSSES)}")
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "coef", float(coef))
        object.__setattr__(self, "reduction", reduction)
        object.__setattr__(self, "max_len", max_len)
        object.__setattr__(self, "kwargs", tuple(sorted(kwargs.items())))

    def __call__(self, logprobs, batch, mask, weights):
        values, metrics = POLICY_LOSSES[self.loss](logprobs, batch, mask, **dict(self.kwargs))
        if values.ndim == 1:
            # Per-sequence loss: weight by the sequence's mean token weight.
            m = as_float_mask(mask)
            seq_weights = jnp.sum(weights * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)
            values = values * seq_weights
        else:
            values = values * weights
        value = self.coef * _reduce(values, mask, self.reduction, self.max_len)
        metrics[f"{self.loss}/loss"] = value
        return value, metrics


@dataclasses.dataclass(frozen=True)
class KLTerm:
    """coef * reduction(KL estimate against batch.ref_logprobs) over all generated tokens."""

    estimator: str = "k3"
    coef: float = 0.01
    reduction: str = "token_mean"
    max_len: int | None = None

    def __call__(self, logprobs, batch, mask, weights):
        del mask, weights  # the KL anchor applies to every generated token, corrected or not
        ref = _optional(batch, "ref_logprobs")
        if ref is None:
            raise ValueError("a KL term needs batch.ref_logprobs (a reference policy)")
        full_mask = _field(batch, "mask")
        values, metrics = regularizers.kl_penalty(logprobs, ref, full_mask, estimator=self.estimator)
        value = self.coef * _reduce(values, full_mask, self.reduction, self.max_len)
        metrics[f"kl_{self.estimator}/loss"] = value
        return value, metrics


@dataclasses.dataclass(frozen=True)
class DistillTerm:
    """coef * reduction(on-policy distillation against batch.teacher_logprobs) over the generated
    tokens `batch.distill_mask` covers (all of them when it is None): the reverse KL to a frozen
    teacher on the student's own samples (`regularizers.distillation_loss`; cross-stage
    distillation, GLM-4.5 / GLM-5). With a mask the reduction's token count is the covered tokens'."""

    coef: float = 0.1
    reduction: str = "token_mean"
    max_len: int | None = None

    def __call__(self, logprobs, batch, mask, weights):
        del mask, weights  # like the KL anchor: every generated token, corrected or not
        teacher = _optional(batch, "teacher_logprobs")
        if teacher is None:
            raise ValueError("a distillation term needs batch.teacher_logprobs (a teacher policy)")
        covered = _optional(batch, "distill_mask")
        full_mask = _field(batch, "mask") if covered is None else covered
        values, metrics = regularizers.distillation_loss(logprobs, teacher, full_mask)
        value = self.coef * _reduce(values, full_mask, self.reduction, self.max_len)
        metrics["distill/loss"] = value
        return value, metrics


@dataclasses.dataclass(frozen=True)
class EntropyTerm:
    """-coef * masked mean entropy (an exploration bonus when coef > 0)."""

    coef: float = 0.001

    def __call__(self, logprobs, batch, mask, weights):
        del logprobs, mask, weights
        entropy = _optional(batch, "entropy")
        if entropy is None:
            raise ValueError("an entropy term needs batch.entropy (per-token entropy of the current policy)")
        mean = masked_mean(entropy, _field(batch, "mask"))
        return -self.coef * mean, {"entropy/mean": mean}


@dataclasses.dataclass(frozen=True)
class CustomTerm:
    """coef * fn(logprobs, batch, mask, weights)[0] for a researcher's own term."""

    fn: Callable[..., tuple[jax.Array, Metrics]]
    coef: float = 1.0
    name: str = "custom"

    def __call__(self, logprobs, batch, mask, weights):
        value, metrics = self.fn(logprobs, batch, mask, weights)
        value = self.coef * value
        return value, {**{f"{self.name}/{k}": v for k, v in metrics.items()}, f"{self.name}/loss": value}


# ------------------------------------------------------------------------------------ corrections
# A correction is called as correction(logprobs, sampler_logprobs, mask, weights, old_logprobs=...)
# and returns (weights, mask, metrics) for the policy terms.
@dataclasses.dataclass(frozen=True)
class TIS:
    """Truncated importance weights min(pi_learner / pi_sampler, cap) on the policy terms."""

    cap: float = 2.0
    level: str = "token"

    def __call__(self, logprobs, sampler_logprobs, mask, weights, old_logprobs=None):
        del old_logprobs
        w, metrics = corrections_lib.truncated_importance_weights(
            logprobs, sampler_logprobs, mask, cap=self.cap, level=self.level
        )
        return weights * w, mask, metrics


@dataclasses.dataclass(frozen=True)
class IcePop:
    """Drops tokens whose pi_learner / pi_sampler leaves [low, high] from the policy terms."""

    low: float = 0.5
    high: float = 2.0
    level: str = "token"

    def __call__(self, logprobs, sampler_logprobs, mask, weights, old_logprobs=None):
        del old_logprobs
        keep, metrics = corrections_lib.icepop_mask(
            logprobs, sampler_logprobs, mask, low=self.low, high=self.high, level=self.level
        )
        return weights, keep, metrics


@dataclasses.dataclass(frozen=True)
class Decoupled:
    """Decoupled-PPO behaviour weights on the policy terms, their trust region around pi_prox.

      w_t = sg(min(pi_prox(y_t) / pi_sampler(y_t), cap))

    where pi_prox is `batch.old_logprobs` — the learner's log-probs under the iteration's starting
    parameters, which the learner recomputes when an objective has this correction — so every
    policy term's ratio is taken against pi_prox while w corrects for the (possibly stale, possibly
    mismatched) sampling policy. With a PPO term this is exactly `policy.decoupled_ppo_loss`
    (Hilton et al. 2022, "Batch size-invariance for policy optimization"; Fu et al. 2025, "AReaL",
    eq. 5). cap None = uncapped.
    """

    cap: float | None = 2.0

    def __call__(self, logprobs, sampler_logprobs, mask, weights, old_logprobs=None):
        del logprobs
        if old_logprobs is None:
            raise ValueError("the decoupled correction needs batch.old_logprobs (proximal log-probs)")
        m = as_float_mask(mask)
        w = jnp.exp(jnp.clip(old_logprobs - sampler_logprobs, -20.0, 20.0)) * m
        if self.cap is not None:
            w = jnp.minimum(w, self.cap)
        w = jax.lax.stop_gradient(w)
        metrics = {"decoupled/behaviour_weight_mean": masked_mean(w, mask),
                   "decoupled/behaviour_weight_max": jnp.max(jnp.where(m > 0, w, 0.0))}
        return weights * w, mask, metrics


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    terms: tuple[Term, ...]
    corrections: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Objective:
    """`objective(logprobs [B, T], batch) -> (scalar loss, metrics)`, pure, plus what the learner
    must compute for it: `needs_reference` — `batch.ref_logprobs` from the frozen reference policy
    (a second forward pass, skipped otherwise); `needs_proximal` — `batch.old_logprobs` recomputed
    with the iteration's starting parameters (otherwise they are the sampler's); `needs_teacher` —
    `batch.teacher_logprobs` from the frozen teacher (a previous stage's final policy)."""

    fn: Callable[[jax.Array, Any], tuple[jax.Array, Metrics]]
    needs_reference: bool = False
    needs_proximal: bool = False
    needs_teacher: bool = False
    name: str = "objective"

    def __call__(self, logprobs: jax.Array, batch) -> tuple[jax.Array, Metrics]:
        return self.fn(logprobs, batch)


def default_objective_spec() -> ObjectiveSpec:
    """The trainer's default: token-level mirror descent (tau 0.05) with token clipping at 0.2,
    plus truncated importance weights (cap 2) for sampler mismatch and staleness
    (settings measured on the tiny agent)."""
    return ObjectiveSpec(
        terms=(PolicyTerm("mirror_descent", tau=0.05, level="token", clip_eps_low=0.2, clip_eps_high=0.2),),
        corrections=(TIS(cap=2.0),),
    )


def make_objective(spec: ObjectiveSpec | Sequence[Term], *, name: str = "objective") -> Objective:
    """Returns the pure `objective(logprobs [B, T], batch) -> (scalar loss, metrics)` as an `Objective`
    (it needs reference log-probs when a term is a `KLTerm`, proximal ones with a `Decoupled` correction).

    Metrics always include 'loss', 'masked_token_share' (generated tokens that corrections removed
    from the policy terms), 'token_weight_mean|max', and the drift metrics of
    `corrections.drift_metrics` (|log pi_learner - log pi_sampler| mean and max, approx KL to pi_old),
    besides every term's own.
    """
    if not isinstance(spec, ObjectiveSpec):
        spec = ObjectiveSpec(terms=tuple(spec))
    if not spec.terms:
        raise ValueError("an objective needs at least one term")

    def objective(logprobs: jax.Array, batch) -> tuple[jax.Array, Metrics]:
        mask = as_float_mask(_field(batch, "mask"))
        old = _field(batch, "old_logprobs")
        sampler = _optional(batch, "sampler_logprobs")
        sampler = old if sampler is None else sampler
        weights = jnp.ones_like(mask)
        distill_only = _optional(batch, "distill_mask")
        # Tokens trained by distillation alone carry no policy-gradient term (see LossInputs).
        policy_tokens = mask if distill_only is None else mask * (1.0 - as_float_mask(distill_only))
        policy_mask = policy_tokens
        metrics: Metrics = {}
        for correction in spec.corrections:
            weights, policy_mask, extra = correction(logprobs, sampler, policy_mask, weights, old_logprobs=old)
            metrics.update(extra)
        total = jnp.zeros((), jnp.float32)
        for term in spec.terms:
            value, extra = term(logprobs, batch, policy_mask, weights)
            total = total + value
            metrics.update(extra)
        metrics["loss"] = total
        metrics["masked_token_share"] = 1.0 - jnp.sum(policy_mask) / jnp.maximum(jnp.sum(policy_tokens), 1.0)
        metrics["token_weight_mean"] = masked_mean(weights, policy_mask)
        metrics["token_weight_max"] = jnp.max(jnp.where(policy_mask > 0, weights, 0.0))
        metrics.update(corrections_lib.drift_metrics(logprobs, old, sampler, mask))
        return total, metrics

    return Objective(objective, needs_reference=any(isinstance(t, KLTerm) for t in spec.terms),
                     needs_proximal=any(isinstance(c, Decoupled) for c in spec.corrections),
                     needs_teacher=any(isinstance(t, DistillTerm) for t in spec.terms), name=name)


def objective_from_loss(loss_fn: Callable[..., tuple[jax.Array, Metrics]], cfg: Any = None, *,
                        needs_reference: bool = False, name: str = "custom") -> Objective:
    """An `Objective` from a pure loss with the signature of docs/contracts.md:

      loss_fn(logprobs, sampler_logprobs, ref_logprobs, advantages, mask, cfg) -> (loss, metrics)

    all arrays [B, T] (ref_logprobs None unless `needs_reference`), `cfg` passed through as given.
    The objective's metrics add 'loss' and the drift metrics (learner vs sampler log-probs).
    """

    def objective(logprobs, batch):
        mask = as_float_mask(_field(batch, "mask"))
        sampler = _optional(batch, "sampler_logprobs")
        old = _field(batch, "old_logprobs")
        sampler = old if sampler is None else sampler
        loss, metrics = loss_fn(logprobs, sampler, _optional(batch, "ref_logprobs"), _field(batch, "advantages"),
                                mask, cfg)
        metrics = {f"{name}/{k}": v for k, v in dict(metrics).items()}
        metrics["loss"] = loss
        metrics.update(corrections_lib.drift_metrics(logprobs, old, sampler, mask))
        return loss, metrics

    return Objective(objective, needs_reference=needs_reference, name=name)
