"""The prepared accelerator check (issue 22): decode tokens/s against the memory-bandwidth roofline,
and learner tokens/s and MFU, at Qwen3-0.6B's shape with random weights, on whatever jax sees.

  bash benchmarks/accelerator_check.sh                      # a GPU or TPU host: the real check
  python benchmarks/accelerator_check.py --model tiny --steps 2 --new_tokens 8 --batches 2   # anywhere

Decode: our engine (`AgentEngine` through `LocalSampler`) generates `--new_tokens` per request for
each batch size in `--batches` (prompts of `--prompt` random ids, sampled at temperature 1, every
slot busy). The roofline is the decode step that reads every weight and each slot's whole key/value
cache once at the device's memory bandwidth (`sampler_throughput.decode_step_floor`): batch /
floor tokens/s. Learner: `learner.make_train_step` (the default objective, AdamW) on `--rows`
packed rows of `--length` tokens, half of them trained; tokens/s over all row tokens, and MFU =
6 * parameters * tokens/s / peak FLOP/s (the usual 6N estimate: forward and backward matmuls,
attention's own FLOPs left out). Memory: the plan of `jaxrl_agent.memory_plan` for the learner step (remat, float32 master weights)
against the backend's own compiled peak for that step. Peaks come from the device kind (table below) or
`--peak_tflops` / `--peak_gbs`; without either the fractions are not printed. Each figure is the
median of `--repeats` timed runs after a compiled warm-up.
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

from jaxrl_agent import learner, losses, models, replay, sharding, tokenizer as tok  # noqa: E402
from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams  # noqa: E402
from sampler_throughput import decode_step_floor  # noqa: E402
from memory_plan import compiled_peak  # noqa: E402
from jaxrl_agent import memory_plan  # noqa: E402

# configs/qwen3_0_6b_agentic.py's shape; `tiny` for a CPU run of the script itself.
MODELS = {
    "0.6b": dict(architecture="qwen3", qk_norm=True, vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                 tie_word_embeddings=True),
    "tiny": dict(architecture="qwen3", qk_norm=True, vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, tie_word_embeddings=True),
}
# Dense bfloat16 TFLOP/s and HBM GB/s per chip, from the vendors' data sheets.
PEAKS = {
    "NVIDIA H200": (989.0, 4800.0),
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 2039.0),
    "TPU v5 lite": (197.0, 819.0),
    "TPU v5p": (459.0, 2765.0),
    "TPU v4": (275.0, 1228.0),
}


def decode_tokens_per_second(config, params, batch: int, prompt: int, new_tokens: int, repeats: int):
    tokenizer = tok.CharTokenizer()
    cache = 1 << (prompt + new_tokens - 1).bit_length()
    engine = AgentEngine(config, params, tokenizer, max_concurrent_decodes=batch,
                         max_prefill_length=1 << (prompt - 1).bit_length(), max_cache_length=cache,
                         steps_per_call=8, stop_token_ids=[])
    rng = np.random.RandomState(0)
    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    rates = []
    with LocalSampler(engine) as sampler:
        for r in range(repeats + 1):  # the first is the compiled warm-up
            prompts = [rng.randint(2, config.vocab_size, prompt).tolist() for _ in range(batch)]
            started = time.perf_counter()
            completions = sampler.generate_many(prompts, sampling)
            elapsed = time.perf_counter() - started
            if r:
                rates.append(sum(len(c.token_ids) for c in completions) / elapsed)
    return statistics.median(rates), engine


def learner_tokens_per_second(config, params, rows: int, length: int, steps: int, repeats: int):
    optimizer = learner.make_optimizer(learning_rate=1e-6, warmup_steps=1, total_steps=1000)
    state = learner.init_state(params, optimizer)
    step_fn, _ = learner.jit_train_step(
        learner.make_train_step(config, optimizer, objective=losses.make_objective(losses.default_objective_spec())),
        state, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))  # one chip: the per-chip figures
    rng = np.random.RandomState(0)
    mask = np.zeros((rows, length), np.int32)
    mask[:, length // 2:] = 1
    batch = learner.PackedBatch(
        tokens=jnp.asarray(rng.randint(2, config.vocab_size, (rows, length)), jnp.int32),
        segment_ids=jnp.ones((rows, length), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
        loss_mask=jnp.asarray(mask), advantages=jnp.asarray(rng.randn(rows, 1) * mask, jnp.float32),
        sampler_logprobs=jnp.asarray(-rng.rand(rows, length) * mask, jnp.float32),
        old_logprobs=jnp.asarray(-rng.rand(rows, length) * mask, jnp.float32),
        policy_version=jnp.asarray(np.where(mask == 1, 0, -1), jnp.int32),
        target_index=jnp.asarray(replay.target_index(mask, 64)))
    for _ in range(2):  # compile (the second call sees the step's own output state)
        state = jax.block_until_ready(step_fn(state, batch)[0])
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        rates.append(rows * length * steps / (time.perf_counter() - started))
    return statistics.median(rates)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="0.6b")
    parser.add_argument("--dtype", default="bfloat16", help="Parameter and activation dtype.")
    parser.add_argument("--batches", default="8,32,128", help="Decode batch sizes (concurrent requests).")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="Learner steps per timed run.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak_tflops", type=float, default=0.0)
    parser.add_argument("--peak_gbs", type=float, default=0.0)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    peak_tflops, peak_gbs = PEAKS.get(device.device_kind, (0.0, 0.0))
    peak_tflops, peak_gbs = args.peak_tflops or peak_tflops, args.peak_gbs or peak_gbs
    config = models.ModelConfig(**MODELS[args.model], param_dtype=args.dtype, dtype=args.dtype)
    params = models.init_params(config, jax.random.PRNGKey(0))
    n_params = models.count_params(params)
    print(f"device: {device.device_kind} ({jax.default_backend()}, one of {jax.device_count()} device(s), jax "
          f"{jax.__version__}); model {args.model}: {n_params / 1e6:.1f}M parameters, {args.dtype}; peaks: "
          f"{peak_tflops or '?'} TFLOP/s, {peak_gbs or '?'} GB/s", flush=True)

    print("\n| decode batch | tokens/s | roofline tokens/s | fraction of roofline |")
    print("|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        rate, engine = decode_tokens_per_second(config, params, batch, args.prompt, args.new_tokens, args.repeats)
        if peak_gbs:
            bound = batch / decode_step_floor(config, params, engine.decode_rows(batch), engine.max_cache_length,
                                              peak_gbs)
            print(f"| {batch} | {rate:,.0f} | {bound:,.0f} | {rate / bound:.2f} |", flush=True)
        else:
            print(f"| {batch} | {rate:,.0f} | ? | ? |", flush=True)

    rate = learner_tokens_per_second(config, params, args.rows, args.length, args.steps, args.repeats)
    mfu = 6 * n_params * rate / (peak_tflops * 1e12) if peak_tflops else None
    print("\n| learner rows x length | tokens/s | MFU (6N) |")
    print("|---|---|---|")
    print(f"| {args.rows} x {args.length} | {rate:,.0f} | {f'{mfu:.3g}' if mfu is not None else '?'} |", flush=True)

    # The memory plan (benchmarks/RESULTS.md's table) against this backend's own buffer assignment
    # for the same step: remat, float32 master weights, logits in chunks of 128, a quarter of each
    # row trained.
    print("\n| learner step (remat, float32 master) | planned (MiB) | compiled peak on this device (MiB) | ratio |")
    print("|---|---|---|---|")
    remat = config.replace(remat=True)
    settings = dict(rows=args.rows, row_length=args.length, targets=args.length // 4, logits_chunk=128,
                    master_dtype="float32")
    planned = memory_plan.learner_memory(remat, **settings).total
    peak = compiled_peak(remat, **settings)["peak"]
    print(f"| {args.rows} x {args.length} | {planned / 2**20:,.1f} | {peak / 2**20:,.1f} | {planned / peak:.3f} |")
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"\ndevice peak bytes in use over the whole check: {stats['peak_bytes_in_use'] / 2**30:,.2f} GiB")


if __name__ == "__main__":
    main()
