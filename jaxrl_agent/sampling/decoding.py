"""Pure token sampling: temperature, top-k, top-p, and the log-prob of what was sampled.

The reported log-probability is log q(token) under the distribution q the token was actually drawn
from: softmax(logits / T) restricted to the top-k / top-p set and renormalised. With top-k and
top-p off, that is exactly what the learner recomputes as log_softmax(logits / T)[token]. Greedy
decoding (T = 0) reports log_softmax(logits)[argmax], the untempered model's log-prob.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits [B, V] outside each row's top-k (0 = off) and top-p nucleus (1 = off) to -inf."""
    v = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = mass_before < top_p[:, None]
    cutoff = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


_FOLD_TO = 128  # `_reduce_rows` folds a row in halves down to this many entries before reducing
_FOLD_MAX_ROWS = 32  # ... and only at this many rows or fewer


def _reduce_rows(x: jax.Array, fold, reduce) -> jax.Array:
    """reduce(x, axis=-1) for an associative `fold` (jnp.maximum, jnp.minimum, jnp.add) and its
    reduction (jnp.max, jnp.min, jnp.sum): [B, V] -> [B].

    With B <= 32 rows the row is first folded in halves, fold(x[:, :V/2], x[:, V/2:]), while its
    length is even and above 128, then the rest reduced. XLA:CPU emits a reduction along the minor
    axis of a few rows as a barely vectorised loop: a max over [8, 8192] took ~33 us and a sum
    ~55 us, against ~7 us folded, whose elementwise halves are vectorised (the sampler benchmark's
    decode step, Intel host). From ~64 rows XLA's own reduction is the faster (a log-sum-exp over
    [128, 8192]: 0.76 against 0.95 ms folded), so more rows are reduced as they are. Max and min
    are exact in any order; a sum is added pairwise (no less accurate than a running sum), so it
    may differ from jnp.sum in the last bits.
    """
    if math.prod(x.shape[:-1]) <= _FOLD_MAX_ROWS:
        while x.shape[-1] > _FOLD_TO and x.shape[-1] % 2 == 0:
            half = x.shape[-1] // 2
            x = fold(x[..., :half], x[..., half:])
    return reduce(x, axis=-1)


def _first_index_of(z: jax.Array, top: jax.Array) -> jax.Array:
    """The first index v with z[b, v] == top[b] (jnp.argmax of z when top is its row max), int32.

    Two plain reductions (the row max, then the smallest index holding it) instead of XLA's variadic
    (value, index) argmax reduce, which XLA:CPU runs unvectorised: ~120 us of a ~1.4 ms decode step
    at [8, 8192]. A row holding NaN has no index equal to its max and gives 0.
    """
    v = z.shape[-1]
    first = _reduce_rows(jnp.where(z == top, jnp.arange(v, dtype=jnp.int32), v), jnp.minimum, jnp.min)
    return jnp.where(first == v, 0, first)


_CHUNK = 128  # tokens per chunk of the two-level running sum in `draw_from_weights`


def _last_positive(weights: jax.Array) -> jax.Array:
    """Per row b, the last index v with weights[b, v] > 0 (0 when there is none): [B] int32."""
    idx = jnp.arange(weights.shape[-1], dtype=jnp.int32)
    return jnp.maximum(jnp.max(jnp.where(weights > 0, idx, -1), axis=-1), 0)


def draw_from_weights(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling: per row, the first index v whose running sum of `weights` exceeds
    u * (the row's total), i.e. a draw from the distribution weights / sum(weights).

    weights [B, V] >= 0 (e.g. exp(z - max z)), u [B] uniform in [0, 1) -> [B] int32. A token of
    weight 0 is never drawn. Where `jax.random.categorical` (Gumbel-max) draws B x V random numbers
    and takes two logarithms of each — ~1.1 ms of a ~2.5 ms decode step at [8, 8192] on CPU — this
    needs B numbers and a running sum, done in two levels (sums of 128-token chunks, then within
    the chosen chunk) so that no [B, V]-long scan is run. Rounding can leave u * total at or above
    the last running sum (or land on a zero-weight entry): the draw then falls back to the last
    positive-weight chunk / token.
    """
    b, v = weights.shape
    pad = -v % _CHUNK
    if pad:
        weights = jnp.pad(weights, ((0, 0), (0, pad)))
    chunks = weights.reshape(b, -1, _CHUNK)  # [B, C, 128]
    chunk_sums = jnp.sum(chunks, axis=-1)  # [B, C]
    running = jnp.cumsum(chunk_sums, axis=-1)
    target = u * running[:, -1]  # [B]
    rows = jnp.arange(b)
    c = jnp.sum(running <= target[:, None], axis=-1).astype(jnp.int32)  # first chunk passing the target
    found = (c < running.shape[1]) & (jnp.take_along_axis(chunk_sums, jnp.minimum(c, running.shape[1] - 1)[:, None],
                                                          -1)[:, 0] > 0)
    c = jnp.where(found, c, _last_positive(chunk_sums))
    within = chunks[rows, c]  # [B, 128]
    inner = (running[rows, c] - chunk_sums[rows, c])[:, None] + jnp.cumsum(within, axis=-1)
    i = jnp.sum(inner <= target[:, None], axis=-1).astype(jnp.int32)
    i = jnp.where((i < _CHUNK) & (jnp.take_along_axis(within, jnp.minimum(i, _CHUNK - 1)[:, None], -1)[:, 0] > 0),
                  i, _last_positive(within))
    return c * _CHUNK + i


def _sample_from(z: jax.Array, greedy: jax.Array, uniforms, *, draw: bool) -> tuple[jax.Array, jax.Array]:
    """Tokens and their log-probs from z [B, V], the logits each row samples from: greedy rows take
    the first maximum, the others (when `draw`) an inverse-CDF draw from softmax(z) at `uniforms()`."""
    top = _reduce_rows(z, jnp.maximum, jnp.max)[:, None]  # one row max for the argmax and the log-softmax
    weights = jnp.exp(z - top)  # unnormalised softmax(z): drawn from, and its sum gives the log-prob
    tokens = _first_index_of(z, top)  # jnp.argmax(z): what greedy rows take
    if draw:
        tokens = jnp.where(greedy, tokens, draw_from_weights(weights, uniforms()).astype(tokens.dtype))
    tokens = tokens.astype(jnp.int32)
    # log softmax(z)[token] = (z_token - top) - log sum exp(z - top), as jax.nn.log_softmax computes it
    # (at few rows the sum is added pairwise: `_reduce_rows`).
    log_total = jnp.log(_reduce_rows(weights, jnp.add, jnp.sum))
    return tokens, (jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - top[:, 0]) - log_total


def sample_tokens(
    logits: jax.Array, rng: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row.

    Args:
      logits: [B, V] float32.  rng: one PRNG key for the batch, or [B] keys (one per row: row b then
        draws exactly what `sample_tokens(logits[b:b+1], rng[b], ...)` would).
      temperature: [B] (0 = greedy).  top_k: [B] int (0 = off).  top_p: [B] float (1 = off).

    Returns:
      (tokens [B] int32, logprobs [B] float32 under the distribution sampled from).

    Each row samples from z: the untempered logits on greedy rows, else the top-k / top-p filtered
    logits / temperature. The batch takes one of three branches, so that the common cases spend no
    [B, V] pass on a division by 1, a filter that is off, or a draw no row takes: every row greedy
    (the argmax); no filter and every sampling row at temperature 1 (x / 1 == x exactly, so z is the
    logits: RL's default); anything else. With the folded reductions they cut the sampler
    benchmark's 8-row decode step by 3-6% (`benchmarks/RESULTS.md`); a fourth branch of its own for
    the filters cost compile time and gained nothing.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    divisor = jnp.where(greedy, 1.0, temperature)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    per_row = rng.ndim == (1 if typed else 2)
    # One uniform per row (inverse-CDF sampling).
    uniforms = (lambda: jax.vmap(lambda key: jax.random.uniform(key, (1,))[0])(rng)) if per_row \
        else (lambda: jax.random.uniform(rng, (logits.shape[0],)))

    def general():  # tempered and/or filtered rows: z is built first, then sampled
        z = jax.lax.cond(needs_filter,
                         lambda: jnp.where(greedy[:, None], logits, filter_logits(logits / divisor, top_k, top_p)),
                         lambda: jnp.where(greedy[:, None], logits, logits / divisor))
        return _sample_from(z, greedy, uniforms, draw=True)

    branches = (
        lambda: _sample_from(logits, greedy, uniforms, draw=False),
        lambda: _sample_from(logits, greedy, uniforms, draw=True),
        general,
    )
    which = jnp.where(jnp.all(greedy), 0, jnp.where(~needs_filter & jnp.all(divisor == 1.0), 1, 2))
    return jax.lax.switch(which, branches)
