"""Flax (linen) decoder-only transformer for the Llama-3 / Qwen2 / Qwen3 dense family.

The layers are Flax modules; everything a caller touches is a pure function of a `ModelConfig`, a
parameter pytree and arrays:

  * `init_params(config, rng) -> params`
  * `forward(config, params, tokens, positions=None, segment_ids=None) -> logits [B, T, V]`
  * `init_cache(config, batch_size, max_length) -> KVCache`
  * `prefill(config, params, tokens, cache) -> (logits [B, T, V], cache)`
  * `decode_step(config, params, tokens [B], positions [B], cache) -> (logits [B, V], cache)`

The L decoder blocks run under `nn.scan`, so their parameters are stacked along a leading layer
axis (`params['layers'][...]['kernel']` is `[L, ...]`) and one block is compiled regardless of
depth. The KV cache holds, per layer, keys `[B, K, D, S]` and values `[B, K, S, D]` (see
`KVCache`): one head's entries are contiguous over the sequence, which decodes faster on CPU than
`[L, B, S, K, D]`, and a token at position p always lives in
cache slot p, written in place. The cached path runs the layers unrolled over per-layer buffers.

Logits and every softmax are computed in float32 whatever `config.dtype` is.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_agent.models.config import ModelConfig, RopeScaling

Params = Any  # nested dict of arrays

# Added to masked attention scores; finite so that a fully masked row (padding) gives a uniform
# distribution instead of NaN.
_MASK_VALUE = -1e30


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies theta^(-2i/D), i < D/2, with optional Llama-3 scaling. Shape [D/2]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [B, T, heads, D] by angle positions [B, T] * inv_freq (half-split convention)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich, 2019)."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


class KVCache(flax.struct.PyTreeNode):
    """Per layer (tuples of length L): keys k [B, K, D, S] and values v [B, K, S, D]; slot p holds
    position p.

    Keys are stored transposed so that both attention products read the cache in its natural
    layout — scores q [G, D] x k [D, S] and outputs p [G, S] x v [S, D] per (row, KV head) — and no
    [S, D] -> [D, S] copy of the keys is made at every decode step (on XLA:CPU that transposed
    product took ~5x as long as the values' product at S = 96). Per-layer buffers rather than one
    stacked [L, ...] array: each decode step then updates every layer's cache in place, where
    slicing a stacked cache per layer copies it (measured ~3x slower on CPU at S = 576)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_length(self) -> int:
        return self.v[0].shape[2]

    def put_rows(self, rows: "KVCache", slots: jax.Array) -> "KVCache":
        """Copies row i of `rows` (a cache of N rows and P <= S positions) into the first P
        positions of row slots[i] of this cache, per layer; a slot >= B drops that row."""
        p = rows.max_length
        keys = tuple(c.at[slots, :, :, :p].set(r.astype(c.dtype), mode="drop") for c, r in zip(self.k, rows.k))
        values = tuple(c.at[slots, :, :p, :].set(r.astype(c.dtype), mode="drop") for c, r in zip(self.v, rows.v))
        return KVCache(keys, values)


def _dense(features, axis, use_bias, config: ModelConfig, name):
    return nn.DenseGeneral(
        features=features,
        axis=axis,
        use_bias=use_bias,
        dtype=config.jnp_dtype,
        param_dtype=config.jnp_param_dtype,
        # 1/sqrt(fan_in): with a fixed 0.02, q.k logits of a narrow model start near zero and
        # attention patterns (e.g. copying from the prompt) take much longer to form.
        kernel_init=nn.initializers.lecun_normal(),
        name=name,
    )


@jax.custom_jvp
def attention_softmax(scores: jax.Array) -> jax.Array:
    """softmax over the last axis, p = exp(s - max s) / sum exp(s - max s), whose derivative is
    computed from p alone: dp = p * (ds - sum(p * ds)), and in the backward pass
    ds = p * (dp - sum(p * dp)).

    The same values as `jax.nn.softmax`, whose derivative (this JAX's default, without
    `jax_softmax_custom_jvp`) differentiates the exp, the sum and the division and keeps their
    [B, K, G, T, S] intermediates for the backward pass: on XLA:CPU the default model's SFT step
    took 0.88x the time with this one (benchmarks/RESULTS.md)."""
    unnormalized = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)


@attention_softmax.defjvp
def _attention_softmax_jvp(primals, tangents):
    (scores,), (scores_dot,) = primals, tangents
    probs = attention_softmax(scores)
    return probs, probs * (scores_dot - jnp.sum(probs * scores_dot, axis=-1, keepdims=True))


def _write_cache(cache: jax.Array, new: jax.Array, start: jax.Array, *, keys: bool) -> jax.Array:
    """Writes new [B, K, T, D] at positions start[b] + 0..T-1 of cache [B, K, D, S] (keys) or
    [B, K, S, D] (values), in place.

    Positions past S are dropped (not clamped): a right-padded suffix may run past the end of the
    cache, and only its padding lands there."""
    b, _, t, _ = new.shape
    rows = jnp.arange(b)[:, None]
    positions = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    # Both index forms put the indexed axes first: the update is [B, T, K, D] either way.
    new = new.transpose(0, 2, 1, 3).astype(cache.dtype)
    if keys:
        return cache.at[rows, :, :, positions].set(new, mode="drop")
    return cache.at[rows, :, positions, :].set(new, mode="drop")


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v bias and q/k RMSNorm."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, layer_cache, cache_start, at=None):
        """x [B, T, H] -> ([B, T, H], the layer's updated cache or None). With `at` ([N] flat
        indices b * T + t), keys and values still come from every position (and go into the
        cache), but only those N positions query: the output is [N, 1, H]."""
        cfg = self.config
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, t = x.shape[:2]
        # Projections act on [B*T, H] rows: with 3-D operands XLA:CPU materialises transposed
        # copies for the weight gradients (measured ~3x slower backward).
        rows = x.reshape(b * t, x.shape[-1])
        q_rows, q_positions = (rows, positions) if at is None else (rows[at], positions.reshape(-1)[at][:, None])
        q = _dense((n, d), -1, cfg.attention_bias, cfg, "q_proj")(q_rows).reshape(*q_positions.shape, n, d)
        key = _dense((k, d), -1, cfg.attention_bias, cfg, "k_proj")(rows).reshape(b, t, k, d)
        value = _dense((k, d), -1, cfg.attention_bias, cfg, "v_proj")(rows).reshape(b, t, k, d)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name="q_norm")(q)
            key = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name="k_norm")(key)
        inv_freq = rope_inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling)
        # The 1/sqrt(D) of the scores applied to the queries ([B, T, N, D], fused with RoPE) rather
        # than to the [B, K, G, T, S] scores: on XLA:CPU scaling the scores was a pass of its own
        # over them in the forward pass and a materialised broadcast of the constant in the backward.
        q = apply_rope(q, q_positions, inv_freq) * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
        key = apply_rope(key, positions, inv_freq)
        key = key.transpose(0, 2, 1, 3)  # [B, K, T, D]
        value = value.transpose(0, 2, 1, 3)
        new_cache = None
        if layer_cache is not None:
            cache_k, cache_v = layer_cache
            key = _write_cache(cache_k, key, cache_start, keys=True)  # [B, K, D, S]
            value = _write_cache(cache_v, value, cache_start, keys=False)
            new_cache = (key, value)
        if at is not None:
            # Each query attends over its own row's keys and values; from here the batch is the
            # N queried positions, one position each (b, t = N, 1).
            key, value = key[at // t], value[at // t]
            mask = mask.reshape(b * t, -1)[at][:, None, :]  # [N, 1, S]
            b, t = q.shape[:2]
        g, s = n // k, value.shape[2]
        # Query heads sharing a KV head are folded into the query axis: [B, K, G*T, D], so both
        # attention products are plain 4-D batched matmuls.
        q = q.reshape(b, t, k, g, d).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, d)
        key_spec = "bkqd,bkds->bkqs" if layer_cache is not None else "bkqd,bksd->bkqs"
        scores = jnp.einsum(key_spec, q, key, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, k, g, t, s)
        # An additive bias rather than a select: the backward of `where` materialised a
        # [L, B, K, G, T, S] broadcast of its constant per step on XLA:CPU.
        scores = scores + jnp.where(mask, 0.0, _MASK_VALUE).astype(jnp.float32)[:, None, None, :, :]
        probs = attention_softmax(scores).astype(cfg.jnp_dtype).reshape(b, k, g * t, s)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, value.astype(cfg.jnp_dtype))
        out = out.reshape(b, k, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b * t, n, d)
        out = _dense(cfg.hidden_size, (-2, -1), False, cfg, "o_proj")(out).reshape(b, t, cfg.hidden_size)
        return out, new_cache


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's gating (Shazeer, 2020): silu(gate) * up = gate * sigmoid(gate) * up, elementwise.

    Its derivative is written out, with s = sigmoid(gate):
      d gate = d out * up * (s + gate * s * (1 - s)),   d up = d out * gate * s,
    from the saved gate and up (the projections' outputs), s recomputed. The forward pass is one
    elementwise pass over the [B*T, intermediate] activations; the backward pass writes s once and
    reads it for both derivatives. Differentiated through `jax.nn.silu`, XLA:CPU ran the gating as
    three single-op passes in the forward pass and more in the backward; the default model's
    learner step took ~0.97x the time with this one, and ~0.90x more once the backward's sigmoid was
    kept apart from the forward's (benchmarks/RESULTS.md). Reverse mode only (a `custom_vjp`):
    `jax.jvp` through the model is not supported."""
    return gate * jax.nn.sigmoid(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, d_out):
    # The barrier keeps XLA from merging this sigmoid (and gate * s) with the forward pass's: merged,
    # the forward pass wrote s, gate * s and the output as three [B*T, intermediate] arrays for the
    # backward pass to read, where alone it is one elementwise pass and this one recomputes s.
    gate, up = jax.lax.optimization_barrier(residuals)
    s = jax.nn.sigmoid(gate)
    silu = gate * s
    return d_out * up * (s + silu * (1 - s)), d_out * silu


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        rows = x.reshape(-1, x.shape[-1])  # [B*T, H]: see Attention on 3-D operands
        gate = _dense(cfg.intermediate_size, -1, False, cfg, "gate_proj")(rows)
        up = _dense(cfg.intermediate_size, -1, False, cfg, "up_proj")(rows)
        return _dense(cfg.hidden_size, -1, False, cfg, "down_proj")(swiglu(gate, up)).reshape(x.shape)


class Block(nn.Module):
    """Pre-norm decoder block; the signature is nn.scan's (carry, per-layer input)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, positions, mask, cache_start, at=None):
        """x [B, T, H] -> (x [B, T, H], new cache); with `at` ([N] flat indices b * T + t) the
        block's output at those positions alone, [N, 1, H] (see `Attention`)."""
        cfg = self.config
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name=name)
        attn_out, new_cache = Attention(cfg, name="attn")(
            norm("input_norm")(x), positions, mask, layer_cache, cache_start, at
        )
        if at is not None:
            x = x.reshape(-1, x.shape[-1])[at][:, None, :]  # [N, 1, H], as attn_out
        x = x + attn_out
        x = x + MLP(cfg, name="mlp")(norm("post_attn_norm")(x))
        return x, new_cache


class Transformer(nn.Module):
    """Embeddings, L scanned blocks, final norm, and the (tied or untied) output projection.

    `__call__` runs the whole stack without a cache (training, scoring); the cached decode path
    (`extend`) calls `embed_tokens`, each block, and `logits` separately.
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            embedding_init=nn.initializers.normal(0.02),
        )
        block = nn.remat(Block, prevent_cse=False) if cfg.remat else Block
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size), cfg.jnp_param_dtype
            )

    def __call__(self, tokens, positions, mask):
        return self.logits(self.hidden(tokens, positions, mask))

    def hidden(self, tokens, positions, mask):
        """The last block's output [B, T, H], before the final norm."""
        x, _ = self.layers(self.embed_tokens(tokens), None, positions, mask, None)
        return x

    def embed_tokens(self, tokens):
        return self.embed(tokens)

    def normed(self, x):
        return self.final_norm(x)

    def output_kernel(self):
        """The output projection [H, V]: the embedding's transpose when tied, else lm_head."""
        cfg = self.config
        kernel = self.embed.embedding.T if cfg.tie_word_embeddings else self.lm_head
        return kernel.astype(cfg.jnp_dtype)

    def logits(self, x):
        return jnp.einsum("bth,hv->btv", self.final_norm(x), self.output_kernel(),
                          preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------------
# Pure API
# --------------------------------------------------------------------------------------------
def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Position of each token within its segment: [B, T] ints restarting at 0 at each new segment."""
    t = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - start_idx


def _causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    return q_positions[:, :, None] >= k_positions[:, None, :]


def _check_tokens(config: ModelConfig, tokens: jax.Array, ndim: int):
    if tokens.ndim != ndim:
        raise ValueError(f"tokens must have rank {ndim}, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
    """Random parameters (normal(0.02) kernels, unit norms)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    positions = jnp.zeros((1, 1), jnp.int32)
    mask = jnp.ones((1, 1, 1), bool)
    return Transformer(config).init(rng, tokens, positions, mask)["params"]


def forward(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Full-sequence logits.

    Args:
      config: the architecture (static under jit).
      params: parameter pytree from `init_params` or `load_hf`.
      tokens: [B, T] int token ids.
      positions: [B, T] RoPE positions; default: 0..T-1, or restarting at every segment when
        `segment_ids` is given.
      segment_ids: [B, T] ints; tokens attend only to earlier tokens of the same segment, so
        sequences packed into one row never see each other.

    Returns:
      logits [B, T, V] in float32.
    """
    x = _last_block_output(config, params, tokens, positions, segment_ids)
    return Transformer(config).apply({"params": params}, x, method=Transformer.logits)


def hidden_states(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The final-normed hidden states [B, T, H] that `forward` projects to logits (same arguments):
    `forward(...) == hidden_states(...) @ output_kernel(...)`. With `chunked_logprobs_and_entropy`
    the learner never materialises the [B, T, V] logits."""
    x = _last_block_output(config, params, tokens, positions, segment_ids)
    return Transformer(config).apply({"params": params}, x, method=Transformer.normed)


def output_kernel(config: ModelConfig, params: Params) -> jax.Array:
    """The output projection [H, V] (the embedding's transpose when tied)."""
    return Transformer(config).apply({"params": params}, method=Transformer.output_kernel)


def _last_block_output(config: ModelConfig, params: Params, tokens, positions, segment_ids) -> jax.Array:
    _check_tokens(config, tokens, 2)
    if positions is None:
        if segment_ids is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        else:
            positions = positions_from_segments(segment_ids)
    # Causality by index (not by position) so packed segments with restarting positions stay causal.
    idx = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    mask = _causal_mask(idx, idx)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if config.scan_layers:
        return Transformer(config).apply({"params": params}, tokens, positions, mask, method=Transformer.hidden)
    x, _ = _blocks(config, params, tokens, positions, mask, None, None)
    return x


def _blocks(config: ModelConfig, params: Params, tokens, positions, mask, cache: KVCache | None, cache_start,
            at: jax.Array | None = None):
    """Embeddings and each block (unrolled): the last block's output [B, T, H] and the cache. With
    `at` ([N] flat indices b * T + t) the last block queries at those positions alone and its output
    is [N, 1, H]: every layer's keys and values are still those of all positions."""
    model = Transformer(config)
    x = model.apply({"params": params}, tokens, method=Transformer.embed_tokens)
    block = Block(config)

    def run_block(layer_params, x, layer_cache, at=None):
        return block.apply({"params": layer_params}, x, layer_cache, positions, mask, cache_start, at)

    if config.remat and cache is None:
        run_block = jax.checkpoint(run_block)
    new_k, new_v = [], []
    stacked = params["layers"]
    for layer in range(config.num_layers):
        if isinstance(stacked, (list, tuple)):  # from `unstack_layers`
            layer_params = stacked[layer]
        else:
            layer_params = jax.tree.map(lambda p: p[layer], stacked)
        layer_cache = None if cache is None else (cache.k[layer], cache.v[layer])
        x, kv = run_block(layer_params, x, layer_cache, at if layer == config.num_layers - 1 else None)
        if kv is not None:
            new_k.append(kv[0])
            new_v.append(kv[1])
    return x, (KVCache(tuple(new_k), tuple(new_v)) if cache is not None else None)


def unstack_layers(params: Params) -> Params:
    """The same parameters with `layers` as a tuple of per-layer trees instead of stacked arrays.

    `extend` / `prefill` / `decode_step` accept either form. Use this outside a decode loop: slicing
    a layer out of the stacked arrays inside a `lax.scan` body copies that layer's weights at every
    step (XLA:CPU does not hoist the slices; measured ~1 ms of a ~4 ms decode step on the benchmark
    shape).
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda p: p[i], layers) for i in range(num_layers))}


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """Zeroed KV cache (per layer: keys [B, K, D, S], values [B, K, S, D]) for `batch_size` rows of up
    to `max_length` tokens."""
    b, k, s, d = batch_size, config.num_kv_heads, max_length, config.head_dim
    dtype = dtype or config.jnp_dtype
    return KVCache(k=tuple(jnp.zeros((b, k, d, s), dtype) for _ in range(config.num_layers)),
                   v=tuple(jnp.zeros((b, k, s, d), dtype) for _ in range(config.num_layers)))


def extend(
    config: ModelConfig, params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, *,
    kernel: jax.Array | None = None, at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs T new tokens per row against the cache and writes their keys/values into it.

    Row b's tokens must have contiguous positions starting at `positions[b, 0]`; they are
    written into slots positions[b, 0] ... and attend to every slot <= their own position.
    Slots beyond a row's current position may hold stale values from padding; the mask hides them.

    Args:
      tokens: [B, T] ids.  positions: [B, T] ints.  cache: from `init_cache`.
      kernel: the output projection [H, V] (default `output_kernel(config, params)`). A decode loop
        passes it in, made once outside the loop: with tied embeddings the default is the
        embedding's transpose, which XLA:CPU folds into the product as a [B, H] x [V, H]ᵀ matmul,
        ~25% slower at B = 8 than the same product against a materialised [H, V] kernel.
      at: optional [N] int, flat indices b * T + t of the only positions whose logits are wanted
        (a prefill samples from its prompt's last token alone): the last block's queries, attention
        output, MLP and the output projection then run on N rows instead of B * T (every layer's
        keys and values, the cache's content, are still those of all B * T positions): the sampler
        benchmark's 8-prompt prefill (2 layers) took ~0.75x the time, the default run's admissions
        (4 layers) ~0.92x (benchmarks/RESULTS.md).

    Returns:
      (logits [B, T, V] float32 — or [N, V] with `at` — and the updated cache).
    """
    _check_tokens(config, tokens, 2)
    slots = jnp.arange(cache.max_length)[None, :]
    mask = positions[:, :, None] >= slots[:, None, :]  # [B, T, S]
    x, cache = _blocks(config, params, tokens, positions, mask, cache, positions[:, 0], at)
    if kernel is None:
        kernel = output_kernel(config, params)
    x = Transformer(config).apply({"params": params}, x, method=Transformer.normed)
    if at is not None:
        x = x[:, 0]  # [N, H]
    return jnp.einsum("...h,hv->...v", x, kernel, preferred_element_type=jnp.float32), cache


def prefill(
    config: ModelConfig, params: Params, tokens: jax.Array, cache: KVCache, *, at: jax.Array | None = None
) -> tuple[jax.Array, KVCache]:
    """Processes prompts [B, T] from position 0 (right padding is harmless); see `extend`."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return extend(config, params, tokens, positions, cache, at=at)


def decode_step(
    config: ModelConfig, params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, *,
    kernel: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """One token per row: tokens [B] at positions [B] -> (logits [B, V] float32, cache); `kernel` as
    in `extend`."""
    _check_tokens(config, tokens, 1)
    logits, cache = extend(config, params, tokens[:, None], positions[:, None], cache, kernel=kernel)
    return logits[:, 0], cache


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets] in float32. logits [..., V], targets [...] -> [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p(targets), H(p)) with p = softmax(logits), both differentiable, in float32.

    logits [..., V] float32, targets [...] int -> ([...], [...]). The same values as
    `token_logprobs` and `losses.entropy_from_logits`, in one pass over the vocabulary instead of
    three: with lse = logsumexp(logits),
        log p_y = z_y - lse,     H = lse - sum_v p_v z_v,
    and the backward pass reuses the saved probabilities (no exp) through
        d log p_y / dz = onehot(y) - p,     dH / dz = -p * (z - lse + H).
    On CPU at vocabulary 8192 the softmax passes cost more than the output projection itself.
    """
    return _logprobs_entropy(logits.astype(jnp.float32), targets)


@jax.custom_vjp
def _logprobs_entropy(logits, targets):
    return _logprobs_entropy_fwd(logits, targets)[0]


def _logprobs_entropy_fwd(logits, targets):
    z = logits
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    e = jnp.exp(z - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / total
    lse = (m + jnp.log(total))[..., 0]
    target_logit = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    logp = target_logit - lse
    entropy = lse - jnp.sum(p * z, axis=-1)
    return (logp, entropy), (z, p, lse, entropy, targets)


def _logprobs_entropy_bwd(residuals, cotangents):
    z, p, lse, entropy, targets = residuals
    return _logits_cotangent(z, p, lse, entropy, targets, *cotangents), None


def _logits_cotangent(z, p, lse, entropy, targets, g_logp, g_entropy):
    """dz = onehot(y) g_lp - p (g_lp + g_H (z - lse + H)): the cotangent of the logits z [..., V].
    A cotangent given as None is zero and its terms are skipped (one vocabulary-wide pass each)."""
    if g_logp is None and g_entropy is None:
        return jnp.zeros_like(z)
    dz = 0.0
    if g_logp is not None:
        onehot = targets[..., None] == jnp.arange(z.shape[-1], dtype=targets.dtype)
        dz = jnp.where(onehot, g_logp[..., None], 0.0) - p * g_logp[..., None]
    if g_entropy is not None:
        dz = dz - p * (g_entropy[..., None] * (z - lse[..., None] + entropy[..., None]))
    return dz


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd)


def chunked_logprobs_and_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *,
                                 temperature: float = 1.0, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs_and_entropy(hidden @ kernel / temperature, targets)` without the logits.

    hidden [B, T, H] (from `hidden_states`), kernel [H, V] (from `output_kernel`), targets [B, T]
    int -> (log p(targets) [B, T], H(p) [B, T]) in float32, differentiable in hidden and kernel.
    The sequence axis is cut into chunks of `chunk` positions (0 = one chunk), and the backward pass
    recomputes each chunk's logits z = h W / T instead of saving [B, T, V] logits and probabilities:
    memory O(B * chunk * V) instead of O(B * T * V) (at Qwen3's V = 151,936 that is 0.6 MB per token
    and array). With lse = logsumexp(z) and the cotangents g_lp, g_H:
        dz = onehot(y) g_lp - p (g_lp + g_H (z - lse + H)),   dh = dz Wᵀ / T,   dW = hᵀ dz / T,
    the weight gradient accumulated chunk by chunk as hᵀ dz, so that dz is read in the [tokens, V]
    layout it is computed in (accumulating dzᵀ h made XLA:CPU write a transposed copy of the whole
    softmax gradient first: 61 ms of a 453 ms learner step in a trace). Cost: one more h W product
    per chunk (XLA may share it with the forward's when everything is one chunk in one jit).
    """
    b, t, _ = hidden.shape
    c = t if chunk <= 0 or chunk >= t else int(chunk)
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    logp, entropy = _chunked_lp_ent(hidden, kernel, targets, float(temperature), c)
    return logp[:, :t], entropy[:, :t]


def _as_chunks(x: jax.Array, c: int) -> jax.Array:
    """[B, n*c, ...] -> [n, B, c, ...] (chunks along the sequence, each holding every row)."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, c, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array) -> jax.Array:
    """[n, B, c, ...] -> [B, n*c, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _chunk_logits(h, kernel, temperature):
    return jnp.einsum("bch,hv->bcv", h, kernel, preferred_element_type=jnp.float32) / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_lp_ent(hidden, kernel, targets, temperature, c):
    return _chunked_lp_ent_fwd(hidden, kernel, targets, temperature, c)[0]


def _chunked_lp_ent_fwd(hidden, kernel, targets, temperature, c):
    # symbolic_zeros=True: the differentiable inputs arrive as CustomVJPPrimal records.
    hidden, kernel, targets = (x.value if isinstance(x, jax.custom_derivatives.CustomVJPPrimal) else x
                               for x in (hidden, kernel, targets))

    def one(args):
        h, y = args
        (logp, entropy), (_, _, lse, _, _) = _logprobs_entropy_fwd(_chunk_logits(h, kernel, temperature), y)
        return logp, entropy, lse

    logp, entropy, lse = jax.lax.map(one, (_as_chunks(hidden, c), _as_chunks(targets, c)))
    logp, entropy, lse = _from_chunks(logp), _from_chunks(entropy), _from_chunks(lse)
    return (logp, entropy), (hidden, kernel, targets, lse, entropy)


def _chunked_lp_ent_bwd(temperature, c, residuals, cotangents):
    hidden, kernel, targets, lse, entropy = residuals
    # An output the loss does not use (the entropy, when it is only logged) has a symbolic zero
    # cotangent: its vocabulary-wide term is left out of the backward pass.
    g_logp, g_entropy = (None if isinstance(g, jax.custom_derivatives.SymbolicZero) else g for g in cotangents)
    if g_logp is None and g_entropy is None:
        return jnp.zeros_like(hidden), jnp.zeros_like(kernel), None

    def one(d_kernel, args):
        h, y, lse_c, ent_c, g_lp, g_h = args
        z = _chunk_logits(h, kernel, temperature)
        p = jnp.exp(z - lse_c[..., None])
        dz = (_logits_cotangent(z, p, lse_c, ent_c, y, g_lp, g_h) / temperature).astype(kernel.dtype)
        dh = jnp.einsum("bcv,hv->bch", dz, kernel, preferred_element_type=jnp.float32)
        d_kernel = d_kernel + jnp.einsum("bch,bcv->hv", h.astype(kernel.dtype), dz,
                                         preferred_element_type=jnp.float32)
        return d_kernel, dh.astype(hidden.dtype)

    chunks = tuple(None if x is None else _as_chunks(x, c) for x in (hidden, targets, lse, entropy, g_logp, g_entropy))
    zeros = jnp.zeros(kernel.shape, jnp.float32)
    d_kernel, d_hidden = jax.lax.scan(one, zeros, chunks)
    return _from_chunks(d_hidden), d_kernel.astype(kernel.dtype), None


_chunked_lp_ent.defvjp(_chunked_lp_ent_fwd, _chunked_lp_ent_bwd, symbolic_zeros=True)


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
