"""The decode step and the learner step as fractions of their matmul floors, one invocation.

  python benchmarks/matmul_floor.py [--rounds 5] [--decode_rows 8,32]

The floor of a step is a jitted loop of just its matmuls at the same shapes and dtype: the
projections (q, k, v, o), the attention products (scores over the keys, the weighted sum of the
values), the MLP (gate, up, down) and the output head, chained so that each reads the one before
(elementwise work, norms, RoPE, softmax, sampling, the loss and the optimizer left out):
  * decode: one token per row for `rows` rows, attention over the engine's whole cache length (it
    attends over all positions, masked), `steps_per_call` steps per call, like the engine's loop;
    compiled under each of the engine's XLA:CPU option sets, the floor being the fastest of them;
  * learner: forward and backward (`jax.vjp` with a random cotangent, so every backward product is
    a real one) over the learner benchmark's batch, 8 x 128 tokens, the head at its 112 trained
    positions per row.
A decode step at few rows reads more bytes than it computes on, so it also gets a bandwidth floor:
the bytes one step must read (every weight, the output head once, and the keys and values of the
cache it attends over) at the rate this host reads memory, measured in the same rounds as a jitted
loop of sums over as many bytes (the fastest of the engine's option sets).
Steps measured in the same rounds, alternated with their floors: the engine's decode step
(`AgentEngine.decode_step_seconds`, with the decode options chosen for this host) and the train step
of `benchmarks/learner_step.py`. Model: the sampler and learner benchmarks' shape (Qwen3-style,
2 layers, d=256, 4 heads / 2 KV x 64, MLP 768, vocabulary 8192, float32). Medians over rounds.
Run under the launcher's `host_allocator` (default 'reuse', jaxrl_agent/heap.py), steps and floors alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import learner_step  # noqa: E402
import launcher_runs  # noqa: E402
from sampler_throughput import MODEL, _engine  # noqa: E402

from jaxrl_agent import heap  # noqa: E402

from jaxrl_agent import models  # noqa: E402
from jaxrl_agent.sampling import engine as engine_lib, host_tuning  # noqa: E402

D, HEADS, KV, HEAD_DIM, MLP, VOCAB, LAYERS = (MODEL[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                                                  "intermediate_size", "vocab_size", "num_layers"))


def _weights(rng):
    w = lambda *shape: jnp.asarray(rng.randn(*shape) / np.sqrt(shape[0]), jnp.float32)
    layers = [dict(q=w(D, HEADS * HEAD_DIM), k=w(D, KV * HEAD_DIM), v=w(D, KV * HEAD_DIM), o=w(HEADS * HEAD_DIM, D),
                   gate=w(D, MLP), up=w(D, MLP), down=w(MLP, D)) for _ in range(LAYERS)]
    return layers, w(D, VOCAB)


def _layer(p, h, keys, values):
    """h [R, D] (R query rows); keys / values [B, KV, S, HEAD_DIM] with R = B * T rows of queries."""
    b = keys.shape[0]
    q = (h @ p["q"]).reshape(b, -1, KV, HEADS // KV, HEAD_DIM)  # [B, T, KV, G, Dh]
    scores = jnp.einsum("btkgd,bksd->btkgs", q, keys)
    mixed = jnp.einsum("btkgs,bksd->btkgd", scores, values).reshape(h.shape[0], HEADS * HEAD_DIM)
    h = mixed @ p["o"]
    return ((h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def decode_floor(rows: int, cache_length: int, steps: int, options: dict):
    """jit(h) -> h after `steps` decode steps of matmuls alone, compiled with XLA:CPU `options`;
    keys/values fixed [rows, KV, S, Dh] (their per-step projections are in the chain, the cache
    write is not a matmul)."""
    rng = np.random.RandomState(0)
    layers, head = _weights(rng)
    cache = jnp.asarray(rng.randn(rows, KV, cache_length, HEAD_DIM), jnp.float32)

    def step(_, h):
        for p in layers:
            h = h + _layer(p, h, cache + (h @ p["k"]).reshape(rows, KV, 1, HEAD_DIM),
                           cache + (h @ p["v"]).reshape(rows, KV, 1, HEAD_DIM))
        return h + (h @ head)[:, :D]

    fn = jax.jit(lambda h: jax.lax.fori_loop(0, steps, step, h), compiler_options=engine_lib.cpu_compiler_options(options))
    return _seconds_per_iteration(fn, jnp.asarray(rng.randn(rows, D), jnp.float32), steps)


def _seconds_per_iteration(fn, arg, iterations: int):
    """Compiles and runs fn(arg) once; returns `timed(calls=3)` -> seconds per loop iteration of
    `calls` more calls (each runs `iterations`)."""
    jax.block_until_ready(fn(arg))

    def timed(calls: int = 3) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(arg)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / (calls * iterations)

    return timed


def decode_bytes(config, rows: int, cache_length: int) -> int:
    """Bytes one decode step reads at the least: every parameter once (the tied head is the
    embedding's transpose, read once as the head) and the keys and values of `rows` rows over
    `cache_length` positions in every layer."""
    params = models.count_params(jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0))))
    cache = rows * 2 * config.num_layers * config.num_kv_heads * cache_length * config.head_dim
    return params * jnp.dtype(config.jnp_param_dtype).itemsize + cache * jnp.dtype(config.jnp_dtype).itemsize


def read_floor(nbytes: int, options: dict, passes: int = 16):
    """jit() -> seconds per pass of reading `nbytes` of float32 (a sum over them, each pass scaled by
    the last one's result so that none is hoisted), compiled with XLA:CPU `options`."""
    data = jnp.asarray(np.random.RandomState(2).rand(nbytes // 4), jnp.float32)
    fn = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda _, s: s + jnp.sum(a * s) * 1e-9, jnp.float32(1.0)),
                 compiler_options=engine_lib.cpu_compiler_options(options))
    return _seconds_per_iteration(fn, data, passes)


def learner_floor(batch: int, prompt: int, completion: int):
    """jit(weights, x, cotangent) -> gradients: the forward matmuls and their backward products."""
    rng = np.random.RandomState(1)
    layers, head = _weights(rng)
    t = prompt + completion

    def forward(layers, head, x):
        h = x.reshape(batch * t, D)
        for p in layers:
            k = (h @ p["k"]).reshape(batch, t, KV, HEAD_DIM).transpose(0, 2, 1, 3)
            v = (h @ p["v"]).reshape(batch, t, KV, HEAD_DIM).transpose(0, 2, 1, 3)
            h = h + _layer(p, h, k, v)
        trained = h.reshape(batch, t, D)[:, prompt:].reshape(batch * completion, D)
        return trained @ head

    def grads(layers, head, x, cotangent):
        _, vjp = jax.vjp(forward, layers, head, x)
        return vjp(cotangent)

    fn = jax.jit(grads)
    x = jnp.asarray(rng.randn(batch, t, D), jnp.float32)
    cotangent = jnp.asarray(rng.randn(batch * completion, VOCAB), jnp.float32)
    jax.block_until_ready(fn(layers, head, x, cotangent))

    def timed(steps: int = 3) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = fn(layers, head, x, cotangent)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / steps

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode_rows", default="8,32")
    parser.add_argument("--steps_per_call", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=64, help="Sizes the engine's cache as the sampler benchmark.")
    parser.add_argument("--host_allocator", choices=heap.HOST_ALLOCATORS, default="reuse",
                        help="config.host_allocator for the steps and their floors (the launcher's default: reuse)")
    args = parser.parse_args()
    heap.set_host_allocator(args.host_allocator)  # as the launcher does, before the first computation
    config = models.ModelConfig(**MODEL)
    params = models.init_params(config, jax.random.PRNGKey(0))
    pairs, bandwidth = {}, {}  # name -> (step, matmul floor); decode steps: name -> (read floor, bytes)
    for rows in (int(r) for r in args.decode_rows.split(",")):
        engine = _engine(config, params, rows, args.steps_per_call, args.new_tokens)
        choice = host_tuning.tune_engine(engine, "auto",
                                         cache_path=launcher_runs.host_choices_path())
        options = choice.options[1] if rows <= 16 else choice.options[0]
        engine.decode_step_seconds(options, rows)  # compile
        floors = [decode_floor(rows, engine.max_cache_length, args.steps_per_call, o)
                  for o in engine_lib.DECODE_OPTION_SETS.values()]
        nbytes = decode_bytes(config, rows, engine.max_cache_length)
        reads = [read_floor(nbytes, o) for o in engine_lib.DECODE_OPTION_SETS.values()]
        name = f"decode step, {rows} rows ({choice.small if rows <= 16 else choice.large})"
        pairs[name] = (lambda e=engine, o=options, r=rows: e.decode_step_seconds(o, r, calls=3),
                       lambda fs=floors: min(f() for f in fs))
        bandwidth[name] = (lambda rs=reads: min(f() for f in rs), nbytes)
    step = learner_step.ours(8, 16, 112)
    pairs["learner step, 8 x 128 tokens"] = (lambda: statistics.median(step(3)), learner_floor(8, 16, 112))
    times = {name: ([], []) for name in pairs}
    read_times = {name: [] for name in bandwidth}
    for r in range(args.rounds):
        for name, (measured, floor) in pairs.items():
            times[name][0].append(measured())
            times[name][1].append(floor())
            if name in bandwidth:
                read_times[name].append(bandwidth[name][0]())
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    print(f"\n{args.rounds} rounds, step and floors alternated; medians\n")
    print("| step | measured (ms) | matmul floor (ms) | floor / step | step / floor | bytes read (MB) "
          "| bandwidth floor (ms) | read rate (GB/s) | step / bandwidth floor |\n|---|---|---|---|---|---|---|---|---|")
    for name, (measured, floor) in times.items():
        m, f = statistics.median(measured) * 1e3, statistics.median(floor) * 1e3
        row = f"| {name} | {m:.3f} | {f:.3f} | {f / m:.2f} | {m / f:.2f} |"
        if name in bandwidth:
            b, nbytes = statistics.median(read_times[name]) * 1e3, bandwidth[name][1]
            row += f" {nbytes / 1e6:.1f} | {b:.3f} | {nbytes / b / 1e6:.1f} | {m / b:.2f} |"
        else:
            row += " | | | |"
        print(row)


if __name__ == "__main__":
    main()
