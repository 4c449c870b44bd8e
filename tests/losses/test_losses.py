"""Loss library: NumPy references, golden values, gradients, masking, jit/vmap, properties."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_agent import losses as L
from tests.losses import reference as ref

SHAPES = [(1, 1), (3, 5), (4, 17)]


def _inputs(shape, seed, *, per_token_adv=False, spread=0.3):
    rng = np.random.RandomState(seed)
    b, t = shape
    lp = -np.abs(rng.randn(b, t)) - 0.05
    old = lp + spread * rng.randn(b, t)
    sampler = lp + 0.5 * spread * rng.randn(b, t)
    mask = (rng.rand(b, t) > 0.3).astype(np.float32)
    if b > 1:
        mask[-1] = 0.0  # one sequence with no generated token
    adv = rng.randn(b, t) if per_token_adv else rng.randn(b)
    return [np.asarray(x, np.float32) for x in (lp, old, sampler, mask, adv)]


POLICY_CASES = {
    "reinforce": (lambda lp, old, A, m: L.reinforce_loss(lp, A, m), lambda lp, old, A, m: ref.reinforce(lp, A, m)),
    "ppo": (functools.partial(L.ppo_clip_loss, eps_low=0.2, eps_high=0.28),
            functools.partial(ref.ppo_clip, eps_low=0.2, eps_high=0.28)),
    "ppo_dual": (functools.partial(L.ppo_clip_loss, dual_clip=3.0), functools.partial(ref.ppo_clip, dual_clip=3.0)),
    "gspo": (functools.partial(L.gspo_loss, eps_low=0.05, eps_high=0.08),
             functools.partial(ref.gspo, eps_low=0.05, eps_high=0.08)),
    "cispo": (functools.partial(L.cispo_loss, eps_low=1.0, eps_high=0.3),
              functools.partial(ref.cispo, eps_low=1.0, eps_high=0.3)),
    "md_token": (functools.partial(L.mirror_descent_loss, tau=0.1, level="token"),
                 functools.partial(ref.mirror_descent, tau=0.1, level="token")),
    "md_token_clip": (functools.partial(L.mirror_descent_loss, tau=0.1, level="token", clip_eps_low=0.2,
                                        clip_eps_high=0.2, clip_delta=0.05),
                      functools.partial(ref.mirror_descent, tau=0.1, level="token", clip_eps_low=0.2,
                                        clip_eps_high=0.2, clip_delta=0.05)),
    "md_sequence": (functools.partial(L.mirror_descent_loss, tau=0.5, level="sequence"),
                    functools.partial(ref.mirror_descent, tau=0.5, level="sequence")),
    "md_sequence_clip": (functools.partial(L.mirror_descent_loss, tau=0.5, level="sequence", clip_eps_low=0.2,
                                           clip_eps_high=0.3),
                         functools.partial(ref.mirror_descent, tau=0.5, level="sequence", clip_eps_low=0.2,
                                           clip_eps_high=0.3)),
}


# ---------------------------------------------------------------------------------- references
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(POLICY_CASES))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_losses_match_numpy_reference(shape, name, per_token_adv):
    ours, theirs = POLICY_CASES[name]
    for seed in range(3):
        lp, old, _, m, adv = _inputs(shape, seed, per_token_adv=per_token_adv)
        values, metrics = ours(lp, old, adv, m)
        np.testing.assert_allclose(values, theirs(lp, old, adv, m), rtol=1e-5, atol=1e-5)
        assert all(np.isfinite(np.asarray(v)) for v in metrics.values())


@pytest.mark.parametrize("shape", SHAPES)
def test_decoupled_ppo_matches_reference(shape):
    lp, old, sampler, m, adv = _inputs(shape, 0)
    values, _ = L.decoupled_ppo_loss(lp, old, sampler, adv, m, behaviour_weight_cap=1.5)
    np.testing.assert_allclose(values, ref.decoupled_ppo(lp, old, sampler, adv, m, cap=1.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_reductions_match_reference(shape):
    lp, _, _, m, adv = _inputs(shape, 1)
    np.testing.assert_allclose(L.masked_token_mean(lp, m), ref.token_mean(lp, m), rtol=1e-6)
    np.testing.assert_allclose(L.masked_sequence_mean(lp, m), ref.sequence_mean(lp, m), rtol=1e-6)
    np.testing.assert_allclose(L.masked_sequence_mean(adv, m), ref.sequence_mean(adv, m), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(L.masked_sequence_sum_norm(lp, m, 32), ref.sequence_sum_norm(lp, m, 32), rtol=1e-6)
    np.testing.assert_allclose(L.masked_sequence_sum_norm(adv, m, 32), ref.sequence_sum_norm(adv, m, 32),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("shape", [(1, 2), (3, 4), (5, 8)])
def test_advantages_match_reference(shape):
    rng = np.random.RandomState(0)
    r = rng.randn(*shape).astype(np.float32)
    r[0] = r[0, 0]  # a constant group
    np.testing.assert_allclose(L.group_advantages(r), ref.group_advantages(r), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(L.group_advantages(r, normalize_std=False),
                               ref.group_advantages(r, normalize_std=False), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(L.rloo_advantages(r), ref.rloo(r), rtol=1e-5, atol=1e-6)
    for tau in (0.01, 0.3, 10.0):
        np.testing.assert_allclose(L.ploo_advantages(r, tau=tau), ref.ploo(r, tau), rtol=1e-4, atol=1e-5)
    turn_mask = rng.rand(*shape) > 0.3
    np.testing.assert_allclose(L.turn_reward_to_go(r, turn_mask, gamma=0.9), ref.reward_to_go(r, turn_mask, 0.9),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kl_matches_reference(estimator, shape):
    lp, old, _, m, _ = _inputs(shape, 2, spread=3.0)  # large gaps exercise the k3 clamp
    values, _ = L.kl_penalty(lp, old, m, estimator=estimator)
    np.testing.assert_allclose(values, ref.kl(lp, old, m, estimator), rtol=1e-5, atol=1e-6)


def test_entropy_matches_reference():
    logits = np.random.RandomState(0).randn(2, 3, 7).astype(np.float32) * 3
    np.testing.assert_allclose(L.entropy_from_logits(logits), ref.entropy(logits), rtol=1e-5)
    np.testing.assert_allclose(L.entropy_from_logits(jnp.zeros((1, 4))), [math.log(4)], rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("shape", SHAPES)
def test_corrections_match_reference(level, shape):
    lp, _, sampler, m, _ = _inputs(shape, 3, spread=1.5)
    w, metrics = L.truncated_importance_weights(lp, sampler, m, cap=1.3, level=level)
    np.testing.assert_allclose(w, ref.tis(lp, sampler, m, 1.3, level), rtol=1e-5, atol=1e-6)
    keep, metrics = L.icepop_mask(lp, sampler, m, low=0.7, high=1.4, level=level)
    np.testing.assert_array_equal(keep, ref.icepop(lp, sampler, m, 0.7, 1.4, level))
    dropped = (m.sum() - np.asarray(keep).sum()) / max(m.sum(), 1)
    np.testing.assert_allclose(metrics["icepop/masked_frac"], dropped, rtol=1e-6)


# ---------------------------------------------------------------------------------- golden values
def test_golden_values():
    m = jnp.ones((1, 1))
    lp = lambda p: jnp.full((1, 1), math.log(p))
    zero = jnp.zeros((1, 1))
    # ratio 1.5, A=1, eps 0.2: -min(1.5, 1.2) = -1.2 ; ratio 0.5, A=-1: max(0.5, 0.8) = 0.8.
    np.testing.assert_allclose(L.ppo_clip_loss(lp(1.5), zero, jnp.ones(1), m)[0], [[-1.2]], rtol=1e-6)
    np.testing.assert_allclose(L.ppo_clip_loss(lp(0.5), zero, -jnp.ones(1), m)[0], [[0.8]], rtol=1e-6)
    # Dual clip c=3 bounds the loss of a negative-advantage token with ratio 5 at 3.
    np.testing.assert_allclose(L.ppo_clip_loss(lp(5.0), zero, -jnp.ones(1), m, dual_clip=3.0)[0], [[3.0]], rtol=1e-6)
    # GRPO on [1, 0, 1, 0]: 0.5 / std_unbiased = 0.5 / sqrt(1/3).
    np.testing.assert_allclose(L.group_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]])),
                               [[0.8660254, -0.8660254, 0.8660254, -0.8660254]], rtol=1e-5)
    np.testing.assert_allclose(L.rloo_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]])),
                               [[2 / 3, -2 / 3, 2 / 3, -2 / 3]], rtol=1e-6)
    # PLOO, tau=1, [1, 0, 0]: A_0 = 1 - log mean(e^0, e^0) = 1; A_1 = -log((e + 1) / 2).
    np.testing.assert_allclose(L.ploo_advantages(jnp.array([[1.0, 0.0, 0.0]]), tau=1.0),
                               [[1.0, -0.6201145, -0.6201145]], rtol=1e-6)
    # Sequence mirror descent: A=1, tau=0.5, log-ratios [0.1, 0.2]: (1 - 0.15)^2 / (2 * 0.5 * 2).
    values, _ = L.mirror_descent_loss(jnp.array([[0.1, 0.2]]), jnp.zeros((1, 2)), jnp.ones(1), jnp.ones((1, 2)),
                                      tau=0.5, level="sequence")
    np.testing.assert_allclose(values, [0.36125], rtol=1e-6)
    # k3 at x = log 2: 1/2 - 1 + log 2.
    np.testing.assert_allclose(L.kl_penalty(lp(2.0), zero, m, estimator="k3")[0], [[math.log(2) - 0.5]], rtol=1e-6)
    # TIS caps rho = 3 at 2.
    np.testing.assert_allclose(L.truncated_importance_weights(lp(3.0), zero, m, cap=2.0)[0], [[2.0]], rtol=1e-6)
    # Dr. GRPO reduction: tokens [1, 2 | 3] over max_len 4 and 2 sequences: (3 + 3) / 2 / 4.
    np.testing.assert_allclose(L.masked_sequence_sum_norm(jnp.array([[1.0, 2.0], [3.0, 9.0]]),
                                                          jnp.array([[1, 1], [1, 0]]), 4), 0.75, rtol=1e-6)
    # Reward to go with gamma 0.5 over turns [1, 0, 2]: [1 + 0 + 0.5, 0 + 1, 2].
    np.testing.assert_allclose(L.turn_reward_to_go(jnp.array([[1.0, 0.0, 2.0]]), jnp.ones((1, 3)), gamma=0.5),
                               [[1.5, 1.0, 2.0]], rtol=1e-6)


# ---------------------------------------------------------------------------------- gradients
# CISPO is left out: its weight is stop-gradient, which finite differences cannot see; its
# gradient is checked analytically below.
SMOOTH_CASES = ["reinforce", "md_token", "md_sequence", "gspo"]


@pytest.mark.parametrize("name", SMOOTH_CASES + ["ppo"])
def test_gradients_match_finite_differences(name):
    ours, _ = POLICY_CASES[name]
    lp, old, _, m, adv = _inputs((3, 5), 4, spread=0.02)  # ratios inside every trust region: no kinks
    m = np.ones_like(m)

    def f(x):
        values, _ = ours(x, old, adv, m)
        return jnp.sum(values)

    check_grads(f, (jnp.asarray(lp),), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-3)


def _grad(fn, lp, *args, **kwargs):
    return jax.grad(lambda x: jnp.sum(fn(x, *args, **kwargs)[0]))(jnp.asarray(lp))


def test_on_policy_ppo_and_cispo_give_the_reinforce_gradient():
    lp, _, _, m, adv = _inputs((4, 9), 5)
    reinforce = _grad(lambda x, A, mm: L.reinforce_loss(x, A, mm), lp, adv, m)
    np.testing.assert_allclose(_grad(L.ppo_clip_loss, lp, lp, adv, m), reinforce, rtol=1e-6, atol=1e-7)
    cispo = _grad(functools.partial(L.cispo_loss, eps_low=0.2, eps_high=0.2), lp, lp, adv, m)
    np.testing.assert_allclose(cispo, reinforce, rtol=1e-6, atol=1e-7)


def test_cispo_gradient_is_the_clipped_weight_times_reinforce():
    lp, old, _, m, adv = _inputs((4, 9), 13, spread=0.5)
    g = _grad(functools.partial(L.cispo_loss, eps_low=0.1, eps_high=0.2), lp, old, adv, m)
    w = np.clip(np.exp(lp - old), 0.9, 1.2)
    np.testing.assert_allclose(g, -w * adv[:, None] * m, rtol=1e-5, atol=1e-7)


def test_token_mirror_descent_gradient_tends_to_reinforce():
    lp, old, _, m, adv = _inputs((4, 9), 6, spread=0.5)
    reinforce = _grad(lambda x, A, mm: L.reinforce_loss(x, A, mm), lp, adv, m)
    max_gap = float(np.max(np.abs(lp - old) * m))
    for tau in (1.0, 0.1, 0.01, 1e-4):
        g = _grad(functools.partial(L.mirror_descent_loss, tau=tau, level="token"), lp, old, adv, m)
        # The difference is exactly the regulariser's gradient tau * (lp - old): linear in tau.
        np.testing.assert_allclose(jnp.max(jnp.abs(g - reinforce)), tau * max_gap, rtol=1e-3, atol=1e-6)


def test_sequence_mirror_descent_gradient_is_analytic():
    lp, old, _, m, adv = _inputs((4, 9), 7)
    tau = 0.3
    g = _grad(functools.partial(L.mirror_descent_loss, tau=tau, level="sequence"), lp, old, adv, m)
    delta = np.sum((lp - old) * m, -1)
    n = np.maximum(m.sum(-1), 1)
    expected = (-(adv - tau * delta) / n)[:, None] * m
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-6)


def test_token_clipping_removes_only_the_policy_gradient():
    lp = jnp.array([[math.log(0.9), math.log(0.5)]])  # second token's ratio 0.5/0.2 = 2.5 leaves [0.8, 1.2]
    old = jnp.array([[math.log(0.9), math.log(0.2)]])
    m, adv, tau = jnp.ones((1, 2)), jnp.ones(1), 0.1
    g = _grad(functools.partial(L.mirror_descent_loss, tau=tau, level="token", clip_eps_low=0.2, clip_eps_high=0.2),
              lp, old, adv, m)
    np.testing.assert_allclose(g, [[-1.0, tau * math.log(2.5)]], rtol=1e-5)


# ---------------------------------------------------------------------------------- masking
ALL_CASES = sorted(POLICY_CASES)


@pytest.mark.parametrize("name", ALL_CASES)
def test_masked_tokens_change_neither_loss_nor_gradient(name):
    ours, _ = POLICY_CASES[name]
    lp, old, _, m, adv = _inputs((3, 6), 8, per_token_adv=True)
    garbage = np.where(m > 0, 0, np.nan).astype(np.float32)
    lp2 = np.where(m > 0, lp, np.inf).astype(np.float32)
    old2, adv2 = old + garbage * 0 + np.where(m > 0, 0, 1e9), np.where(m > 0, adv, np.nan)

    def total(x, o, a):
        values, _ = ours(x, o, a, m)
        return L.masked_sequence_mean(values, m) if values.ndim == 1 else L.masked_token_mean(values, m)

    v1, g1 = jax.value_and_grad(total)(jnp.asarray(lp), old, adv)
    v2, g2 = jax.value_and_grad(total)(jnp.asarray(lp2), old2.astype(np.float32), adv2.astype(np.float32))
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    assert np.all(np.asarray(g2)[m == 0] == 0)


def test_masked_tokens_in_objective_and_kl():
    lp, old, sampler, m, adv = _inputs((3, 6), 9)
    objective = L.make_objective(L.ObjectiveSpec(
        terms=(L.PolicyTerm("ppo_clip"), L.KLTerm("k3", coef=0.1)), corrections=(L.TIS(cap=2.0), L.IcePop())))
    batch = L.LossInputs(mask=m, advantages=adv, old_logprobs=old, sampler_logprobs=sampler, ref_logprobs=old - 0.1)
    noisy = L.LossInputs(mask=m, advantages=adv, old_logprobs=np.where(m > 0, old, np.nan),
                         sampler_logprobs=np.where(m > 0, sampler, -np.inf), ref_logprobs=np.where(m > 0, old - 0.1, 7.0))
    (v1, _), g1 = jax.value_and_grad(objective, has_aux=True)(jnp.asarray(lp), batch)
    (v2, _), g2 = jax.value_and_grad(objective, has_aux=True)(jnp.asarray(np.where(m > 0, lp, np.nan)), noisy)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)


# ---------------------------------------------------------------------------------- jit / vmap
class JitVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_equals_no_jit(self):
        lp, old, sampler, m, adv = _inputs((3, 7), 10)
        objective = L.make_objective(L.default_objective_spec())
        batch = L.LossInputs(mask=m, advantages=adv, old_logprobs=old, sampler_logprobs=sampler)
        loss, metrics = self.variant(objective)(lp, batch)
        expected, expected_metrics = objective(lp, batch)
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        for key in expected_metrics:
            np.testing.assert_allclose(metrics[key], expected_metrics[key], rtol=1e-5, atol=1e-7)
        for name in ALL_CASES:
            ours, _ = POLICY_CASES[name]
            np.testing.assert_allclose(self.variant(ours)(lp, old, adv, m)[0], ours(lp, old, adv, m)[0],
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ALL_CASES)
def test_vmap_over_a_stack_of_batches(name):
    ours, _ = POLICY_CASES[name]
    stacks = [_inputs((3, 5), s) for s in range(4)]
    lp, old, _, m, adv = (np.stack(x) for x in zip(*stacks))
    batched, _ = jax.vmap(ours)(lp, old, adv, m)
    for i in range(4):
        np.testing.assert_allclose(batched[i], ours(lp[i], old[i], adv[i], m[i])[0], rtol=1e-6, atol=1e-7)


def test_vmap_advantages_and_corrections():
    r = np.random.RandomState(0).randn(3, 2, 4).astype(np.float32)
    np.testing.assert_allclose(jax.vmap(L.group_advantages)(r), np.stack([L.group_advantages(x) for x in r]), rtol=1e-6)
    lp, _, sampler, m, _ = (np.stack(x) for x in zip(*[_inputs((2, 5), s) for s in range(3)]))
    w, _ = jax.vmap(functools.partial(L.truncated_importance_weights, cap=1.5))(lp, sampler, m)
    for i in range(3):
        np.testing.assert_allclose(w[i], L.truncated_importance_weights(lp[i], sampler[i], m[i], cap=1.5)[0], rtol=1e-6)


# ---------------------------------------------------------------------------------- properties
def test_constant_reward_groups_have_exactly_zero_advantage():
    for value in (0.1, 1.0, -3.7, 1e6 / 3):
        r = jnp.full((2, 7), value, jnp.float32)
        assert np.all(np.asarray(L.group_advantages(r)) == 0.0)
        assert np.all(np.asarray(L.group_advantages(r, normalize_std=False)) == 0.0)
        assert np.all(np.asarray(L.rloo_advantages(r)) == 0.0)


def test_icepop_with_bounds_zero_to_infinity_is_no_masking():
    lp, old, sampler, m, adv = _inputs((4, 8), 11, spread=5.0)
    keep, metrics = L.icepop_mask(lp, sampler, m, low=0.0, high=math.inf)
    np.testing.assert_array_equal(keep, m)
    assert float(metrics["icepop/masked_frac"]) == 0.0
    plain = L.make_objective([L.PolicyTerm("ppo_clip")])
    masked = L.make_objective(L.ObjectiveSpec(terms=(L.PolicyTerm("ppo_clip"),),
                                              corrections=(L.IcePop(low=0.0, high=math.inf),)))
    batch = L.LossInputs(mask=m, advantages=adv, old_logprobs=old, sampler_logprobs=sampler)
    np.testing.assert_array_equal(plain(lp, batch)[0], masked(lp, batch)[0])


def test_ploo_tends_to_rloo_for_large_tau():
    r = np.random.RandomState(1).rand(3, 5).astype(np.float32)
    np.testing.assert_allclose(L.ploo_advantages(r, tau=1e4), L.rloo_advantages(r), atol=1e-3)


def test_negative_advantages_are_scaled_and_the_rest_kept():
    a = np.array([[0.75, -0.25, -0.25, -0.25], [0.5, -0.5, 0.0, 0.0]], np.float32)
    np.testing.assert_allclose(L.weight_negative_advantages(a, 0.2),
                               [[0.75, -0.05, -0.05, -0.05], [0.5, -0.1, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(L.weight_negative_advantages(a, 1.0), a)  # 1 = the estimator's own
    np.testing.assert_array_equal(L.weight_negative_advantages(a, 0.0), np.maximum(a, 0.0))  # positives only
    np.testing.assert_array_equal(L.weight_negative_advantages(a, 3.0), np.where(a < 0, 3 * a, a))
    # Signs never flip, and a group-centred advantage sums to (1 - w) * its positive mass.
    r = np.random.RandomState(4).rand(5, 6).astype(np.float32)
    centred = L.group_advantages(r, normalize_std=False)
    weighted = np.asarray(L.weight_negative_advantages(centred, 0.25))
    np.testing.assert_array_equal(np.sign(weighted), np.sign(np.asarray(centred)))
    np.testing.assert_allclose(weighted.sum(1), 0.75 * np.maximum(np.asarray(centred), 0).sum(1), rtol=1e-5)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="negative_weight must be finite and >= 0"):
            L.weight_negative_advantages(a, bad)


def test_clip_fractions_are_reported_separately():
    lp = jnp.log(jnp.array([[0.5, 1.5, 1.0, 1.0]]))  # ratios vs old=1: 0.5 (low), 1.5 (high)
    _, metrics = L.ppo_clip_loss(lp, jnp.zeros((1, 4)), jnp.array([[-1.0, 1.0, 1.0, 1.0]]), jnp.ones((1, 4)))
    np.testing.assert_allclose(metrics["ppo/clip_frac_low"], 0.25)
    np.testing.assert_allclose(metrics["ppo/clip_frac_high"], 0.25)
    np.testing.assert_allclose(metrics["ppo/ratio_max"], 1.5, rtol=1e-6)


def test_objective_composes_terms_and_reports_metrics():
    lp, old, sampler, m, adv = _inputs((3, 6), 12)
    batch = L.LossInputs(mask=m, advantages=adv, old_logprobs=old, sampler_logprobs=sampler,
                         ref_logprobs=old - 0.2, entropy=jnp.ones_like(lp))
    spec = L.ObjectiveSpec(
        terms=(L.PolicyTerm("cispo", eps_low=1.0, eps_high=0.3), L.KLTerm("k2", coef=0.5), L.EntropyTerm(coef=0.01)),
        corrections=(L.TIS(cap=1.2),))
    loss, metrics = L.make_objective(spec)(lp, batch)
    w, _ = L.truncated_importance_weights(lp, sampler, m, cap=1.2)
    pg = L.masked_token_mean(w * L.cispo_loss(lp, old, adv, m, eps_low=1.0, eps_high=0.3)[0], m)
    kl = L.masked_token_mean(L.kl_penalty(lp, old - 0.2, m, estimator="k2")[0], m)
    np.testing.assert_allclose(loss, pg + 0.5 * kl - 0.01, rtol=1e-5)
    for key in ("loss", "tis/weight_mean", "tis/weight_max", "cispo/clip_frac_low", "cispo/clip_frac_high",
                "masked_token_share", "drift/approx_kl_old", "drift/sampler_abs_diff_mean",
                "drift/sampler_abs_diff_max"):
        assert key in metrics, key
    np.testing.assert_allclose(metrics["drift/sampler_abs_diff_max"], np.max(np.abs(lp - sampler)[m > 0]), rtol=1e-6)


def test_bad_arguments_fail_clearly():
    m = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="'ppo2' is not one of"):
        L.PolicyTerm("ppo2")
    with pytest.raises(ValueError, match="needs batch.ref_logprobs"):
        L.make_objective([L.KLTerm()])(jnp.zeros((2, 3)), L.LossInputs(mask=m, advantages=jnp.ones(2),
                                                                       old_logprobs=jnp.zeros((2, 3))))
    with pytest.raises(ValueError, match="estimator must be"):
        L.kl_penalty(jnp.zeros((2, 3)), jnp.zeros((2, 3)), m, estimator="k4")
    with pytest.raises(ValueError, match="N >= 2"):
        L.rloo_advantages(jnp.ones((3, 1)))
    with pytest.raises(ValueError, match="level must be"):
        L.mirror_descent_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones(2), m, tau=0.1, level="turn")
    with pytest.raises(AssertionError):  # chex shape check names the shapes
        L.ppo_clip_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones(2), m)
    with pytest.raises(ValueError, match="token_mean"):
        L.make_objective([L.PolicyTerm("gspo")])(jnp.zeros((2, 3)), L.LossInputs(
            mask=m, advantages=jnp.ones(2), old_logprobs=jnp.zeros((2, 3))))


def test_remaining_helpers_match_numpy():
    rng = np.random.RandomState(14)
    r = rng.randn(6).astype(np.float32)
    np.testing.assert_allclose(L.reinforce_baseline_advantages(r), r - r.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(L.reinforce_baseline_advantages(r, normalize_std=True),
                               (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5, atol=1e-6)
    turn_values = rng.randn(2, 3).astype(np.float32)
    index = np.array([[0, 0, 1, 2, 2], [2, 1, 1, 0, 7]])
    expected = np.array([[turn_values[b, min(i, 2)] for i in row] for b, row in enumerate(index)])
    np.testing.assert_allclose(L.turn_values_to_tokens(turn_values, index), expected)
    lp, old, sampler, m, _ = _inputs((3, 6), 15)
    metrics = L.drift_metrics(lp, old, sampler, m)
    sel = m > 0
    np.testing.assert_allclose(metrics["drift/sampler_abs_diff_mean"], np.abs(lp - sampler)[sel].mean(), rtol=1e-5)
    x = (lp - old)[sel]
    np.testing.assert_allclose(metrics["drift/approx_kl_old"], np.mean(np.exp(-x) - 1 + x), rtol=1e-5)
    assert float(metrics["drift/token_count"]) == sel.sum()
    keep, km = L.token_clip_keep_mask(lp, old, np.ones(3, np.float32), m, eps_low=0.1, eps_high=0.1, delta=0.02)
    np.testing.assert_array_equal(keep, ref.keep(lp, old, np.ones(3), m, 0.1, 0.1, 0.02))


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_correction_with_a_ppo_term_is_decoupled_ppo(cap):
    lp, old, sampler, mask, adv = _inputs((4, 9), 7, per_token_adv=True)
    objective = L.make_objective(L.ObjectiveSpec(
        terms=(L.PolicyTerm("ppo_clip", eps_low=0.2, eps_high=0.28),), corrections=(L.Decoupled(cap=cap),)))
    assert objective.needs_proximal and not objective.needs_reference
    batch = L.LossInputs(mask=mask, advantages=adv, old_logprobs=old, sampler_logprobs=sampler)
    loss, metrics = objective(lp, batch)
    values, _ = L.decoupled_ppo_loss(lp, old, sampler, adv, mask, eps_low=0.2, eps_high=0.28,
                                     behaviour_weight_cap=cap)
    np.testing.assert_allclose(loss, L.masked_token_mean(values, mask), rtol=1e-6)
    # The behaviour weight is a constant: the gradient is w times the PPO gradient, nothing from w.
    grad = jax.grad(lambda x: objective(x, batch)[0])(lp)
    ref_grad = jax.grad(lambda x: L.masked_token_mean(L.decoupled_ppo_loss(
        x, old, sampler, adv, mask, eps_low=0.2, eps_high=0.28, behaviour_weight_cap=cap)[0], mask))(lp)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert float(metrics["decoupled/behaviour_weight_max"]) <= (cap or np.inf)


def test_objective_from_a_pure_loss_passes_the_design_signature():
    lp, old, sampler, mask, adv = _inputs((3, 5), 3, per_token_adv=True)
    seen = {}

    def my_loss(logprobs, sampler_logprobs, ref_logprobs, advantages, mask_, cfg):
        seen.update(cfg=cfg, ref=ref_logprobs)
        return L.masked_token_mean(-advantages * logprobs, mask_) * cfg["scale"], {"extra": jnp.sum(mask_)}

    objective = L.objective_from_loss(my_loss, {"scale": 2.0}, name="mine")
    loss, metrics = objective(lp, L.LossInputs(mask=mask, advantages=adv, old_logprobs=old, sampler_logprobs=sampler))
    np.testing.assert_allclose(loss, 2.0 * L.masked_token_mean(-adv * lp, mask), rtol=1e-6)
    assert float(metrics["mine/extra"]) == mask.sum() and "drift/sampler_abs_diff_mean" in metrics
    assert seen["cfg"] == {"scale": 2.0} and seen["ref"] is None and not objective.needs_reference


def test_distillation_is_zero_when_student_equals_teacher_and_positive_otherwise():
    rng = np.random.RandomState(3)
    student = jnp.asarray(-rng.uniform(0.1, 3.0, (3, 5)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(3, 5)) < 0.7, jnp.int32).at[0, 0].set(1)
    values, metrics = L.distillation_loss(student, student, mask)
    assert float(jnp.abs(values).max()) == 0.0 and float(metrics["distill/kl_k3"]) == 0.0
    grad = jax.grad(lambda lp: L.masked_token_mean(L.distillation_loss(lp, student, mask)[0], mask))(student)
    assert float(jnp.abs(grad).max()) == 0.0  # at the teacher, nothing to learn
    teacher = student + jnp.asarray(rng.normal(0, 0.5, (3, 5)), jnp.float32)
    values, metrics = L.distillation_loss(student, teacher, mask)
    x = np.asarray(student - teacher)
    k3 = np.exp(-x) - 1 + x
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(values), k3 * m, rtol=1e-5, atol=1e-7)  # golden: k3 per token
    assert float(metrics["distill/kl_k3"]) > 0 and np.all(np.asarray(values)[m == 1] > 0)
    np.testing.assert_allclose(float(metrics["distill/kl_k1"]), (x * m).sum() / m.sum(), rtol=1e-5)
    # The gradient is the reverse KL's policy gradient: (log pi_s - log pi_t) per sampled token.
    grad = jax.grad(lambda lp: L.masked_token_mean(L.distillation_loss(lp, teacher, mask)[0], mask))(student)
    np.testing.assert_allclose(np.asarray(grad), x * m / m.sum(), rtol=1e-5, atol=1e-7)
    # Masked tokens never change it.
    moved = teacher.at[mask == 0].add(5.0)
    np.testing.assert_allclose(np.asarray(L.distillation_loss(student, moved, mask)[0]), np.asarray(values), atol=1e-7)


def test_k3_estimates_stay_accurate_and_non_negative_at_tiny_log_ratios():
    """A student a few small steps from its teacher has per-token log-ratios ~1e-4: there
    exp(-x) - 1 + x in float32 rounds about half the tokens below 0 (and a mean can be negative,
    which a run once recorded as distill/kl_k3). `distillation_loss` and `kl_penalty` (the shared
    `losses._common.k3`) keep the float64 value of the same float32 log-ratios."""
    rng = np.random.RandomState(0)
    teacher = -rng.uniform(0.5, 3.0, (64, 64))
    x = rng.normal(0.0, 1e-4, (64, 64))
    mask = np.ones((64, 64), np.int32)
    student = jnp.asarray(teacher + x, jnp.float32)
    x32 = np.asarray(student, np.float64) - np.asarray(jnp.asarray(teacher, jnp.float32), np.float64)
    want32 = np.expm1(-x32) + x32  # the same on the log-ratios float32 inputs give
    values, metrics = L.distillation_loss(student, jnp.asarray(teacher, jnp.float32), mask)
    assert np.all(np.asarray(values) >= 0.0)
    np.testing.assert_allclose(float(metrics["distill/kl_k3"]), want32.mean(), rtol=1e-3)
    penalty, kl_metrics = L.kl_penalty(student, jnp.asarray(teacher, jnp.float32), mask, estimator="k3")
    assert np.all(np.asarray(penalty) >= 0.0) and float(kl_metrics["kl_k3/mean"]) > 0.0
    # float32's own error on expm1(-x) ~ x * 6e-8: ~1e-11 here, where the old form was off by up to 6e-8.
    np.testing.assert_allclose(np.asarray(penalty), want32, rtol=0, atol=5e-11)


def test_distill_term_is_its_own_loss_term_and_needs_a_teacher():
    objective = L.make_objective([L.PolicyTerm("reinforce"), L.DistillTerm(coef=0.5)])
    assert objective.needs_teacher and not objective.needs_reference
    assert not L.make_objective([L.PolicyTerm("reinforce")]).needs_teacher
    m = jnp.ones((2, 3), jnp.int32)
    lp = jnp.full((2, 3), -1.0)
    inputs = L.LossInputs(mask=m, advantages=jnp.zeros(2), old_logprobs=lp, teacher_logprobs=lp - 0.3)
    loss, metrics = objective(lp, inputs)
    k3 = math.exp(-0.3) - 1 + 0.3
    np.testing.assert_allclose(float(metrics["distill/loss"]), 0.5 * k3, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.5 * k3, rtol=1e-5)  # zero advantages: the policy term is 0
    with pytest.raises(ValueError, match="needs batch.teacher_logprobs"):
        objective(lp, inputs._replace(teacher_logprobs=None))


def test_distill_only_tokens_leave_the_policy_terms_as_if_they_were_not_in_the_batch():
    """rl.distill_envs: the policy terms of a batch with distill-only rows (whatever their advantages
    and ratios) equal those of the batch without them, token counts included; the distillation
    term covers those rows alone."""
    rng = np.random.RandomState(0)
    logprobs = jnp.asarray(-rng.rand(3, 4) * 3, jnp.float32)
    old = logprobs + jnp.asarray(rng.randn(3, 4) * 0.1, jnp.float32)
    mask = jnp.ones((3, 4), jnp.int32)
    advantages = jnp.array([1.0, -0.5, 2.0])
    distill_only = jnp.array([[0.0] * 4, [0.0] * 4, [1.0] * 4])  # row 2: an earlier stage's episode
    spec = L.default_objective_spec()
    objective = L.make_objective(L.ObjectiveSpec(terms=(*spec.terms, L.DistillTerm(coef=0.5)),
                                                 corrections=spec.corrections))
    inputs = L.LossInputs(mask=mask, advantages=advantages, old_logprobs=old, sampler_logprobs=old,
                          teacher_logprobs=old - 0.2, distill_mask=distill_only)
    _, metrics = objective(logprobs, inputs)
    policy_only = L.make_objective(spec)
    without_row, _ = policy_only(logprobs[:2], L.LossInputs(mask=mask[:2], advantages=advantages[:2],
                                                            old_logprobs=old[:2], sampler_logprobs=old[:2]))
    np.testing.assert_allclose(float(metrics["mirror_descent/loss"]), float(without_row), rtol=1e-6)
    # Its advantage is ignored by the policy terms (only the distillation term sees the row).
    moved, _ = objective(logprobs, inputs._replace(advantages=advantages.at[2].set(-7.0)))
    _, base = objective(logprobs, inputs)
    np.testing.assert_allclose(float(moved), float(base["loss"]), rtol=1e-6)
    assert float(metrics["masked_token_share"]) == 0.0  # corrections removed nothing
    # Without a distill mask every row is a policy row (distillation on every token).
    everywhere, _ = policy_only(logprobs, inputs._replace(distill_mask=None, teacher_logprobs=None))
    assert abs(float(everywhere) - float(without_row)) > 1e-4


def test_the_distill_term_covers_only_the_distill_mask():
    """Tokens outside distill_mask never change the distillation term; it averages over the covered."""
    term = L.DistillTerm(coef=1.0)
    mask = jnp.ones((2, 3), jnp.int32)
    student = jnp.full((2, 3), -1.0)
    teacher = jnp.array([[-1.3, -1.3, -1.3], [-5.0, -0.1, -2.0]])
    covered = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    inputs = L.LossInputs(mask=mask, advantages=jnp.zeros(2), old_logprobs=student, teacher_logprobs=teacher,
                          distill_mask=covered)
    value, _ = term(student, inputs, mask, None)
    np.testing.assert_allclose(float(value), math.exp(-0.3) - 1 + 0.3, rtol=1e-5)  # row 0's tokens only
    moved = inputs._replace(teacher_logprobs=teacher.at[1].set(-9.0))
    np.testing.assert_allclose(float(term(student, moved, mask, None)[0]), float(value), rtol=1e-6)
    grad = jax.grad(lambda lp: term(lp, inputs, mask, None)[0])(student)
    assert float(jnp.abs(grad[1]).max()) == 0.0 and float(jnp.abs(grad[0]).min()) > 0
    everything, _ = term(student, inputs._replace(distill_mask=None), mask, None)
    assert float(everything) > float(value)  # without a mask row 1's larger gaps count too
