"""Model invariants: cached decode == full forward, packed == unpacked, remat == plain."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import models

CONFIGS = {
    "llama": models.ModelConfig(architecture="llama", rope_scaling=models.RopeScaling(original_max_position_embeddings=16)),
    "qwen2": models.ModelConfig(architecture="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": models.ModelConfig(architecture="qwen3", qk_norm=True, num_kv_heads=1, head_dim=32),
}


def _params(config, seed=0):
    params = models.init_params(config, jax.random.PRNGKey(seed))
    # Perturb norms / biases away from their trivial init.
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), params)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_token_by_token_decode_matches_forward(arch):
    config = CONFIGS[arch]
    params = _params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, config.vocab_size)
    full = models.forward(config, params, tokens)

    prefill = jax.jit(models.prefill, static_argnums=0)
    decode = jax.jit(models.decode_step, static_argnums=0)
    cache = models.init_cache(config, 3, 16)
    prompt_len = 4
    logits, cache = prefill(config, params, tokens[:, :prompt_len], cache)
    steps = [logits]
    for t in range(prompt_len, tokens.shape[1]):
        step_logits, cache = decode(config, params, tokens[:, t], jnp.full((3,), t), cache)
        steps.append(step_logits[:, None])
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))  # tied and untied output projections; GQA with q/k norms
def test_prefill_logits_at_selected_positions_equal_the_full_logits_there(arch):
    config = CONFIGS[arch]
    params = _params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 12), 0, config.vocab_size)
    full, full_cache = models.prefill(config, params, tokens, models.init_cache(config, 3, 16))
    rows, cols = np.asarray([1, 0, 2, 1]), np.asarray([5, 11, 0, 5])  # a repeated position too
    at = jnp.asarray(rows * 12 + cols)
    picked, cache = models.prefill(config, params, tokens, models.init_cache(config, 3, 16), at=at)
    assert picked.shape == (4, config.vocab_size)
    np.testing.assert_allclose(picked, np.asarray(full)[rows, cols], atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), cache, full_cache)
    # The output projection passed in explicitly (as the engine's decode loop does) gives the same.
    step, _ = models.decode_step(config, params, tokens[:, 0], jnp.zeros(3, jnp.int32),
                                 models.init_cache(config, 3, 16), kernel=models.output_kernel(config, params))
    np.testing.assert_allclose(step, np.asarray(full)[:, 0], atol=1e-5, rtol=0)


def test_with_selected_positions_the_last_block_queries_only_there():
    """`at`: every layer's keys and values come from all B * T positions, but the last block's
    query, output and MLP products (and the output projection) run on the N selected rows alone."""
    config = CONFIGS["llama"]
    params = _params(config)
    tokens = jnp.zeros((3, 12), jnp.int32)
    at = jnp.asarray([5, 13])
    jaxpr = jax.make_jaxpr(lambda p, t: models.prefill(config, p, t, models.init_cache(config, 3, 16), at=at))(
        params, tokens)
    # (rows, kernel shape) of every product of a [rows, H]-like operand with a weight matrix
    products = [(eqn.invars[0].aval.shape[0], eqn.invars[1].aval.shape) for eqn in jaxpr.eqns
                if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.ndim in (2, 3)
                and eqn.invars[1].aval.ndim in (2, 3)]
    h, i = config.hidden_size, config.intermediate_size
    mlp_rows = [r for r, w in products if w == (h, i)]  # gate and up, per layer
    assert mlp_rows == [36, 36] * (config.num_layers - 1) + [2, 2], mlp_rows
    query_rows = [r for r, w in products if w == (h, config.num_heads, config.head_dim)]
    assert query_rows == [36] * (config.num_layers - 1) + [2], query_rows
    kv_rows = [r for r, w in products if w == (h, config.num_kv_heads, config.head_dim)]
    assert kv_rows == [36, 36] * config.num_layers, kv_rows  # keys and values of every position


def test_decode_with_ragged_rows_and_padded_prefill():
    """Rows at different positions (JetStream slots) and a right-padded prefill bucket."""
    config = CONFIGS["llama"]
    params = _params(config)
    rng = np.random.RandomState(0)
    lengths = [3, 6]
    seqs = [rng.randint(0, config.vocab_size, n + 4) for n in lengths]
    cache = models.init_cache(config, 2, 16)
    padded = np.zeros((2, 8), np.int32)  # bucket of 8, true lengths 3 and 6, garbage after
    for b, n in enumerate(lengths):
        padded[b, :n] = seqs[b][:n]
        padded[b, n:] = 7
    _, cache = models.prefill(config, params, jnp.asarray(padded), cache)
    decode = jax.jit(functools.partial(models.decode_step, config))
    # One compiled forward: each sequence right-padded to 10 (causal: padding cannot change the
    # logits before it), instead of eager forwards at eight lengths (~10 s of op-by-op dispatch).
    forward = jax.jit(functools.partial(models.forward, config))
    for step in range(4):
        tokens = jnp.asarray([seqs[b][lengths[b] + step] for b in range(2)])
        positions = jnp.asarray([lengths[b] + step for b in range(2)])
        logits, cache = decode(params, tokens, positions, cache)
        for b in range(2):
            n = lengths[b] + step + 1
            alone = forward(params, jnp.asarray(np.pad(seqs[b][:n], (0, 10 - n))[None]))
            np.testing.assert_allclose(logits[b], alone[0, n - 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_packed_segments_equal_separate_sequences(arch):
    config = CONFIGS[arch]
    params = _params(config)
    rng = np.random.RandomState(1)
    lengths = [5, 3, 6]
    seqs = [rng.randint(0, config.vocab_size, n) for n in lengths]
    row = np.concatenate(seqs + [np.zeros(2, int)])  # two padding tokens at the end
    segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(2, int)])
    packed = models.forward(config, params, jnp.asarray(row[None]), segment_ids=jnp.asarray(segment_ids[None]))
    start = 0
    for seq in seqs:
        alone = models.forward(config, params, jnp.asarray(seq[None]))
        np.testing.assert_allclose(packed[0, start:start + len(seq)], alone[0], atol=1e-5, rtol=0)
        start += len(seq)
    assert np.all(np.isfinite(np.asarray(packed)))


def test_positions_from_segments():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    np.testing.assert_array_equal(models.positions_from_segments(seg), [[0, 1, 2, 0, 1, 0, 0, 1]])


@pytest.mark.parametrize("remat,scan_layers", [(True, True), (False, False), (True, False)])
def test_remat_and_unrolled_layers_give_identical_values_and_gradients(remat, scan_layers):
    config = CONFIGS["qwen3"]
    params = _params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, config.vocab_size)
    segments = jnp.asarray([[1] * 4 + [2] * 6, [1] * 10])

    def loss(cfg, p):
        return jnp.mean(jax.nn.log_softmax(models.forward(cfg, p, tokens, segment_ids=segments))[..., 0])

    value, grad = jax.jit(jax.value_and_grad(functools.partial(loss, config)))(params)
    variant = config.replace(remat=remat, scan_layers=scan_layers)
    value_r, grad_r = jax.jit(jax.value_and_grad(functools.partial(loss, variant)))(params)
    np.testing.assert_allclose(value, value_r, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_r)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_attention_softmax_equals_jax_softmax_in_value_and_derivatives():
    from jaxrl_agent.models import transformer

    scores = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5, 7)) * 4.0
    # Masked positions as the attention adds them (a large negative bias), one row fully visible.
    scores = scores + jnp.where(jnp.tril(jnp.ones((5, 7), bool), 2), 0.0, transformer._MASK_VALUE)
    weights = jax.random.normal(jax.random.PRNGKey(1), scores.shape)
    ours, reference = transformer.attention_softmax, lambda s: jax.nn.softmax(s, axis=-1)
    np.testing.assert_allclose(ours(scores), reference(scores), rtol=1e-6, atol=1e-7)

    def objective(softmax, s):
        return jnp.sum(weights * softmax(s) ** 2)  # not linear in p: the chain rule through p matters

    grad, grad_ref = (jax.grad(functools.partial(objective, f))(scores) for f in (ours, reference))
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-6)
    # The closed form: ds = p * (dp - sum(p * dp)), with dp = 2 w p.
    p = reference(scores)
    dp = 2 * weights * p
    np.testing.assert_allclose(grad, p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)), rtol=1e-5, atol=1e-6)
    tangent = jax.random.normal(jax.random.PRNGKey(2), scores.shape)
    _, jvp = jax.jvp(ours, (scores,), (tangent,))
    _, jvp_ref = jax.jvp(reference, (scores,), (tangent,))
    np.testing.assert_allclose(jvp, jvp_ref, rtol=1e-5, atol=1e-6)


def test_model_gradients_equal_those_through_jax_softmax(monkeypatch):
    """The whole model's loss and gradients with the attention's own softmax derivative equal the
    ones differentiated through jax.nn.softmax (packed segments, GQA)."""
    from jaxrl_agent.models import transformer

    config = CONFIGS["qwen3"]
    params = _params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, config.vocab_size)
    segments = jnp.asarray([[1] * 4 + [2] * 6, [1] * 10])

    def loss(p):
        return jnp.mean(jax.nn.log_softmax(models.forward(config, p, tokens, segment_ids=segments))[..., 0])

    value, grad = jax.value_and_grad(loss)(params)
    monkeypatch.setattr(transformer, "attention_softmax", lambda s: jax.nn.softmax(s, axis=-1))
    value_ref, grad_ref = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_params_and_compute_give_float32_logits():
    config = CONFIGS["llama"].replace(param_dtype="bfloat16", dtype="bfloat16")
    params = models.init_params(config, jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    tokens = jnp.ones((1, 5), jnp.int32)
    logits = models.forward(config, params, tokens)
    assert logits.dtype == jnp.float32
    reference = models.forward(CONFIGS["llama"], jax.tree.map(lambda x: x.astype(jnp.float32), params), tokens)
    np.testing.assert_allclose(logits, reference, atol=5e-2)


def test_token_logprobs_are_float32_log_softmax():
    logits = jnp.asarray([[[1.0, 2.0, 3.0]]], jnp.bfloat16)
    lp = models.token_logprobs(logits, jnp.asarray([[2]]))
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, [[3.0 - np.log(np.exp([1.0, 2.0, 3.0]).sum())]], rtol=1e-6)


def test_bad_inputs_raise_clear_errors():
    config = CONFIGS["llama"]
    params = _params(config)
    with pytest.raises(ValueError, match="rank 2"):
        models.forward(config, params, jnp.ones((4,), jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        models.forward(config, params, jnp.ones((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="num_kv_heads"):
        models.ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(models.UnsupportedArchitectureError, match="gpt2"):
        models.ModelConfig(architecture="gpt2")


def test_fused_token_logprobs_and_entropy_match_the_reference_values_and_gradients():
    from jaxrl_agent import losses

    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(7), 4)
    logits = jax.random.normal(k1, (3, 5, 11)) * 4.0
    targets = jax.random.randint(k2, (3, 5), 0, 11)
    w_logp, w_entropy = jax.random.normal(k3, (3, 5)), jax.random.normal(k4, (3, 5))

    def reference(z):
        return models.token_logprobs(z, targets), losses.entropy_from_logits(z)

    def fused(z):
        return models.token_logprobs_and_entropy(z, targets)

    for got, want in zip(fused(logits), reference(logits)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Gradients through either output alone and through both (the custom VJP's two terms).
    for a, b in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
        def objective(fn, a=a, b=b):
            return lambda z: jnp.sum(a * w_logp * fn(z)[0]) + jnp.sum(b * w_entropy * fn(z)[1])

        np.testing.assert_allclose(jax.grad(objective(fused))(logits), jax.grad(objective(reference))(logits),
                                   rtol=1e-4, atol=1e-6)
    # A central difference along a random direction.
    direction = jax.random.normal(k3, logits.shape)
    f = lambda z: jnp.sum(w_logp * fused(z)[0]) + jnp.sum(w_entropy * fused(z)[1])
    eps = 1e-2
    numeric = (f(logits + eps * direction) - f(logits - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(jax.grad(f)(logits), direction), numeric, rtol=2e-2)


@pytest.mark.parametrize("chunk", [0, 2, 3, 7])
def test_chunked_logprobs_and_entropy_match_the_full_logits_path(chunk):
    """Values and gradients (hidden and kernel) equal the reference on materialised logits, for
    chunks that divide T, that do not (3 of 7), and one chunk; with a temperature."""
    from jaxrl_agent import losses

    k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(3), 5)
    hidden = jax.random.normal(k1, (2, 7, 6))
    kernel = jax.random.normal(k2, (6, 13))
    targets = jax.random.randint(k3, (2, 7), 0, 13)
    w_logp, w_entropy = jax.random.normal(k4, (2, 7)), jax.random.normal(k5, (2, 7))
    temperature = 0.7

    def reference(h, w):
        z = jnp.einsum("bth,hv->btv", h, w) / temperature
        return models.token_logprobs(z, targets), losses.entropy_from_logits(z)

    def chunked(h, w):
        return models.chunked_logprobs_and_entropy(h, w, targets, temperature=temperature, chunk=chunk)

    for got, want in zip(chunked(hidden, kernel), reference(hidden, kernel)):
        assert got.shape == (2, 7)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a or b None: that output is not used at all (a symbolic zero cotangent, its term skipped).
    for a, b in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (1.0, None), (None, 1.0)):
        def objective(fn, a=a, b=b):
            return lambda h, w: (0.0 if a is None else jnp.sum(a * w_logp * fn(h, w)[0])) + (
                0.0 if b is None else jnp.sum(b * w_entropy * fn(h, w)[1]))

        got = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, kernel)
        want = jax.grad(objective(reference), argnums=(0, 1))(hidden, kernel)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_hidden_states_times_output_kernel_is_forward():
    for tie in (True, False):
        config = models.ModelConfig(vocab_size=17, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                                    num_kv_heads=1, head_dim=8, tie_word_embeddings=tie)
        params = models.init_params(config, jax.random.PRNGKey(0))
        tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 17)
        segments = jnp.asarray([[1, 1, 2, 2, 2], [1, 1, 1, 1, 0]])
        want = models.forward(config, params, tokens, segment_ids=segments)
        got = jnp.einsum("bth,hv->btv", models.hidden_states(config, params, tokens, segment_ids=segments),
                         models.output_kernel(config, params))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_swiglu_equals_silu_gating_in_value_and_gradient():
    from jaxrl_agent.models import transformer

    gate, up = (jax.random.normal(jax.random.PRNGKey(i), (6, 9)) * 3.0 for i in (0, 1))
    weights = jax.random.normal(jax.random.PRNGKey(2), gate.shape)
    reference = lambda g, u: jax.nn.silu(g) * u
    np.testing.assert_allclose(transformer.swiglu(gate, up), reference(gate, up), rtol=1e-6, atol=1e-7)

    def objective(fn, g, u):
        return jnp.sum(weights * fn(g, u) ** 2)  # not linear in the output: the chain rule matters

    ours = jax.grad(functools.partial(objective, transformer.swiglu), argnums=(0, 1))(gate, up)
    ref = jax.grad(functools.partial(objective, reference), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The closed form, with d out = 2 w out and s = sigmoid(gate).
    s = jax.nn.sigmoid(gate)
    d_out = 2 * weights * reference(gate, up)
    np.testing.assert_allclose(ours[0], d_out * up * (s + gate * s * (1 - s)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours[1], d_out * gate * s, rtol=1e-5, atol=1e-6)


def test_model_gradients_equal_those_through_silu(monkeypatch):
    """The whole model's loss and gradients with the MLP's own SwiGLU derivative equal the ones
    differentiated through jax.nn.silu."""
    from jaxrl_agent.models import transformer

    config = CONFIGS["llama"]
    params = _params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, config.vocab_size)

    def loss(p):
        return jnp.mean(jax.nn.log_softmax(models.forward(config, p, tokens))[..., 0])

    value, grad = jax.value_and_grad(loss)(params)
    monkeypatch.setattr(transformer, "swiglu", lambda g, u: jax.nn.silu(g) * u)
    value_ref, grad_ref = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
