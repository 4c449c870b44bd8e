"""`sampling.decoding` against straightforward float64 references: the folded row reductions and
each of `sample_tokens`' branches (all greedy; temperature 1 without filters; tempered or filtered)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent.sampling import decoding


@pytest.mark.parametrize("rows,length", [(3, 7), (3, 128), (3, 130), (3, 256), (3, 1000), (3, 8192), (40, 1024)])
def test_folded_row_reductions_equal_plain_ones(rows, length):
    x = jax.random.normal(jax.random.PRNGKey(length), (rows, length)) * 4.0
    ints = jax.random.randint(jax.random.PRNGKey(1), (rows, length), -1000, 1000)
    np.testing.assert_array_equal(decoding._reduce_rows(x, jnp.maximum, jnp.max), np.max(np.asarray(x), -1))
    np.testing.assert_array_equal(decoding._reduce_rows(ints, jnp.minimum, jnp.min), np.min(np.asarray(ints), -1))
    np.testing.assert_allclose(decoding._reduce_rows(x, jnp.add, jnp.sum),
                               np.sum(np.asarray(x, np.float64), -1), rtol=1e-5, atol=1e-4)


def test_first_index_of_is_the_first_maximum_past_the_fold():
    """Ties in both halves of a folded row: the smaller index wins."""
    z = jnp.zeros((2, 512)).at[0, 300].set(5.0).at[0, 44].set(5.0).at[1, 511].set(1.0)
    top = jnp.max(z, -1, keepdims=True)
    np.testing.assert_array_equal(decoding._first_index_of(z, top), [44, 511])


def _reference(logits, keys, temperature, top_k, top_p):
    """Per row, in float64: z = logits (greedy) or filter(logits / T); the first argmax for greedy
    rows, else the first index whose running sum of softmax(z) exceeds u (u drawn from the row's
    key as `sample_tokens` draws it); the log-prob log_softmax(z)[token]."""
    tokens, logprobs = [], []
    for b in range(logits.shape[0]):
        t = float(temperature[b])
        if t <= 0:
            z = np.asarray(logits[b], np.float64)
        else:
            filtered = decoding.filter_logits(logits[b:b + 1] / t, top_k[b:b + 1], top_p[b:b + 1])[0]
            z = np.asarray(filtered, np.float64)
        p = np.exp(z - z.max())
        if t <= 0:
            token = int(np.argmax(z))
        else:
            u = float(jax.random.uniform(keys[b], (1,))[0])
            token = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
        tokens.append(token)
        logprobs.append(z[token] - z.max() - np.log(p.sum()))
    return np.asarray(tokens), np.asarray(logprobs)


@pytest.mark.parametrize("case", ["all_greedy_filters_ignored", "temperature_one", "tempered", "filtered"])
def test_each_branch_samples_what_the_reference_samples(case):
    rows, vocab = 6, 1000
    logits = jax.random.normal(jax.random.PRNGKey(3), (rows, vocab)) * 3.0
    keys = jax.vmap(lambda c: jax.random.fold_in(jax.random.PRNGKey(11), c))(jnp.arange(rows))
    top_k, top_p = jnp.zeros((rows,), jnp.int32), jnp.ones((rows,))
    if case == "all_greedy_filters_ignored":
        temperature, top_k = jnp.zeros((rows,)), jnp.full((rows,), 2, jnp.int32)
    elif case == "temperature_one":
        temperature = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    elif case == "tempered":
        temperature = jnp.asarray([0.7, 0.0, 1.0, 1.5, 0.0, 0.7])
    else:
        temperature, top_k = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), jnp.asarray([3, 0, 0, 5, 0, 1], jnp.int32)
        top_p = jnp.asarray([1.0, 1.0, 0.5, 0.9, 1.0, 1.0])
    tokens, logprobs = jax.jit(decoding.sample_tokens)(logits, keys, temperature, top_k, top_p)
    want_tokens, want_logprobs = _reference(logits, keys, temperature, top_k, top_p)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-5)
    assert (np.asarray(temperature) > 0).sum() == 0 or len(set(np.asarray(tokens).tolist())) > 1
