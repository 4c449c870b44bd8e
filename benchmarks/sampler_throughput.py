"""Generated tokens per second: in-process engine, gRPC server, and a naive full-forward loop.

  python benchmarks/sampler_throughput.py [--concurrency 1,8,32] [--new_tokens 64] [--repeats 3]
  python benchmarks/sampler_throughput.py --breakdown --steps_per_call 16 [--temperature 1]   # prefill / decode alone
  python benchmarks/sampler_throughput.py --compare_options --concurrency 8,16,32,64 --steps_per_call 16
  python benchmarks/sampler_throughput.py --model 0.5b --dtype bfloat16 --peak_gbs 4800   # an accelerator
  python benchmarks/sampler_throughput.py --concurrency 8 --skip_server --steps_per_call 16 \
      --tunix_python /path/to/tunix_venv/bin/python --rounds 5   # against tunix, alternating rounds

Model: Qwen3-style, 2 layers, d=256, 4 heads (2 KV), head_dim 64, MLP 768, vocab 8192, random
weights, float32. Each run submits `concurrency` requests at once (prompt 16 tokens, `new_tokens`
greedy tokens each, no early stop) and measures wall time until all complete, after a warm-up run
that compiles everything. Baselines measured in the same run:
  * naive: one jitted full forward over the whole (padded) sequence per new token, batch =
    concurrency — what decoding costs without a KV cache;
  * in-process: `LocalSampler` over our `AgentEngine` (continuous batching, KV cache,
    `steps_per_call` decode steps per call), its decode options chosen for this host as a run
    chooses them (`--decode_options`, default 'auto'; `sampling.host_tuning`);
  * server: `launch/sampler_server.py` in a subprocess, reached through `SamplerClient` over gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_agent import models, tokenizer as tok  # noqa: E402
from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams, host_tuning  # noqa: E402
from served_baseline import ServedBaseline  # noqa: E402
import launcher_runs  # noqa: E402

MODEL = dict(architecture="qwen3", qk_norm=True, vocab_size=8192, hidden_size=256, intermediate_size=768,
             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
# `--model 0.5b`: the Qwen2.5-0.5B shape (494M parameters with tied embeddings), random weights — the
# device run of the issue ("a ~0.5B-parameter random model"), with `--dtype bfloat16 --peak_gbs`.
MODEL_0_5B = dict(architecture="qwen2", attention_bias=True, vocab_size=151936, hidden_size=896,
                  intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                  rope_theta=1000000.0, tie_word_embeddings=True)
MODELS = {"tiny": MODEL, "0.5b": MODEL_0_5B}
PROMPT_LEN = 16


def _prompts(n, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(200, 8000, PROMPT_LEN).tolist() for _ in range(n)]


def bench_naive(config, params, concurrency, new_tokens):
    total = PROMPT_LEN + new_tokens
    forward = jax.jit(lambda p, t: models.forward(config, p, t))

    def run():
        tokens = np.zeros((concurrency, total), np.int32)
        tokens[:, :PROMPT_LEN] = np.asarray(_prompts(concurrency))
        tokens = jnp.asarray(tokens)
        for i in range(new_tokens):
            logits = forward(params, tokens)
            nxt = jnp.argmax(logits[:, PROMPT_LEN + i - 1], axis=-1).astype(jnp.int32)
            tokens = tokens.at[:, PROMPT_LEN + i].set(nxt)
        tokens.block_until_ready()

    run()
    start = time.perf_counter()
    run()
    return concurrency * new_tokens / (time.perf_counter() - start)


def _cache_length(new_tokens):
    return PROMPT_LEN + new_tokens + 16  # as tunix_sampler_baseline.py sizes its cache


# --max_steps_per_call (the engine's max_steps_per_call for every engine this script builds).
MAX_STEPS_PER_CALL = 16
# --decode_options: how the engines this script builds choose their decode loop's XLA:CPU options,
# as `sampler.decode_options` does in a run ('auto': the choice cached for this host and shape, else
# measured now and cached beside the default config's compilation cache, as the trainer does).
DECODE_OPTIONS = "auto"


def _engine(config, params, slots, steps, new_tokens, decode_compiler_options=None):
    """An engine of the benchmark's shape: with `decode_compiler_options` those options, else the
    ones `DECODE_OPTIONS` chooses for this host (`host_tuning.tune_engine`, as a run's engine)."""
    engine = AgentEngine(config, params, tok.CharTokenizer(), max_concurrent_decodes=slots, max_prefill_length=16,
                         max_cache_length=_cache_length(new_tokens), steps_per_call=steps,
                         max_steps_per_call=MAX_STEPS_PER_CALL, stop_token_ids=[-1],
                         decode_compiler_options=decode_compiler_options)
    if decode_compiler_options is None and jax.default_backend() == "cpu":
        host_tuning.tune_engine(engine, DECODE_OPTIONS, cache_path=launcher_runs.host_choices_path())
    return engine


def _decode_choice(engine) -> str:
    """'decode options ...' as the engine's host tuning chose them ('' where it made no choice)."""
    choice = getattr(engine, "decode_choice", None)
    return f"decode options {choice.describe()}" if choice is not None else ""


def bench_local(sampler, concurrency, new_tokens):
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    sampler.generate_many(_prompts(concurrency), sampling)  # warm-up / compile
    start = time.perf_counter()
    completions = sampler.generate_many(_prompts(concurrency, 1), sampling)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for c in completions) / elapsed


def bench_server(address, concurrency, new_tokens):
    from jaxrl_agent.sampling.client import SamplerClient

    async def run(seed):
        client = SamplerClient([address])
        sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        start = time.perf_counter()
        completions = await asyncio.gather(*(client.generate(p, sampling) for p in _prompts(concurrency, seed)))
        elapsed = time.perf_counter() - start
        await client.close()
        return sum(len(c.token_ids) for c in completions) / elapsed

    asyncio.run(run(0))
    return asyncio.run(run(1))


def decode_step_floor(config, params, rows: int, cache_length: int, peak_gbs: float) -> float:
    """Seconds a decode step over `rows` slots cannot beat at `peak_gbs` GB/s of memory bandwidth:
    it reads every weight once and each decoded slot's whole key/value cache (the engine attends
    over all `cache_length` positions, masked). With c live requests the generated tokens/s are at
    most c / this."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = (rows * config.num_layers * 2 * config.num_kv_heads * config.head_dim * cache_length
                * np.dtype(config.jnp_dtype).itemsize)
    return (weight_bytes + kv_bytes) / (peak_gbs * 1e9)


def start_server(model, slots, steps, new_tokens):
    from jaxrl_agent import auth

    os.environ.setdefault(auth.TOKEN_ENV, auth.new_token())  # the server and this client share it
    overrides = [f"--config.model.{k}={v}" for k, v in model.items()] + [
        f"--config.sampler.max_concurrent_decodes={slots}", "--config.sampler.max_prefill_length=16",
        f"--config.sampler.max_cache_length={_cache_length(new_tokens)}", f"--config.sampler.steps_per_call={steps}",
        f"--config.sampler.max_steps_per_call={MAX_STEPS_PER_CALL}"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "sampler_server.py"), "--config",
                             os.path.join(ROOT, "configs", "calculator_tiny.py"), "--port", "0"] + overrides,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    port = re.search(r":(\d+)$", line.strip()).group(1)
    return proc, f"127.0.0.1:{port}"


def bench_breakdown(config, params, steps, new_tokens, temperature=0.0, repeats=40):
    """The engine's two compiled pieces at batch 8, each timed to completion (medians of `repeats`):
    a batched prefill of 8 prompts into 8 slots, and one `generate` call of `steps` decode steps
    over 8 live slots (greedy at temperature 0, else sampled). Returns (prefill ms, generate ms)."""
    engine = _engine(config, params, 8, steps, new_tokens)
    if choice := _decode_choice(engine):
        print(choice, flush=True)
    sampling = SamplingParams(temperature=temperature, max_tokens=new_tokens)
    prompts = [np.asarray(p, np.int32) for p in _prompts(8)]
    prefill, generate = [], []
    for i in range(repeats + 2):  # the first two compile
        fresh = jax.block_until_ready(engine.init_decode_state())  # made outside the timed prefill
        start = time.perf_counter()
        state = jax.block_until_ready(engine.prefill_insert_many(prompts, [sampling] * 8, fresh, list(range(8))))
        middle = time.perf_counter()
        state, result = engine.generate(None, state, max_steps=engine.steps_per_call)
        np.asarray(result.data)
        if i >= 2:
            prefill.append(middle - start)
            generate.append(time.perf_counter() - middle)
    return statistics.median(prefill) * 1e3, statistics.median(generate) * 1e3


def compare_with_tunix(config, params, python, steps, new_tokens, repeats, rounds, lanes: int = 1):
    """Batch 8, greedy: `rounds` alternating rounds of `repeats` batches through our 8 slots (one
    engine, or `lanes` engines of 8 / lanes slots each decoding in threads of their own, as
    `sampler.local_engines` makes them), then `repeats` through tunix's Sampler (a subprocess, idle
    while ours runs and vice versa)."""
    tunix = ServedBaseline(python, os.path.join(ROOT, "benchmarks", "tunix_sampler_baseline.py"),
                           ["--batch", "8", "--new_tokens", str(new_tokens)], "tunix_tokens_per_s=")
    ours_all, tunix_all, ratios = [], [], []
    try:
        if 8 % lanes:
            raise SystemExit(f"--lanes={lanes}: expected a divisor of the 8 slots")
        with LocalSampler([_engine(config, params, 8 // lanes, steps, new_tokens) for _ in range(lanes)]) as eight:
            choice = _decode_choice(eight.engine)
            for _ in range(rounds):
                ours = [bench_local(eight, 8, new_tokens) for _ in range(repeats)]
                theirs = tunix.request(repeats)
                ours_all += ours
                tunix_all += theirs
                ratios.append(statistics.median(ours) / statistics.median(theirs))
    finally:
        tunix.close()
    ours, theirs = statistics.median(ours_all), statistics.median(tunix_all)
    print(f"\n| batch 8, {new_tokens} new tokens ({rounds} alternating rounds of {repeats}) | tokens/s |\n|---|---|\n"
          f"| tunix Sampler | {theirs:,.0f} |\n| our engine (8 slots, in-process, {lanes} engine(s)) | {ours:,.0f} |\n"
          f"| ratio ours / tunix | {ours / theirs:.2f} |\n")
    print("per-round ratios: " + ", ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f})"
          + (f"; {choice}" if choice else "") + "\n")


def compare_decode_options(config, params, slots: int, steps: int, new_tokens: int, rounds: int = 30):
    """Decode step time (ms) at `slots` slots, all decoded, under XLA's default CPU options, fast
    min/max alone, and the small-batch set (see `engine.CPU_SMALL_DECODE_COMPILER_OPTIONS`): one
    engine per variant in this process, `rounds` rounds of 3 calls each, variants alternated."""
    from jaxrl_agent.sampling import engine as engine_lib

    variants = {"XLA defaults": {}, "fast min/max": engine_lib.CPU_DECODE_COMPILER_OPTIONS,
                "small-batch set": engine_lib.CPU_SMALL_DECODE_COMPILER_OPTIONS}
    running = {}
    for name, options in variants.items():
        engine = _engine(config, params, slots, steps, new_tokens, decode_compiler_options=options)
        state = engine.init_decode_state()
        state = state.replace(active=jnp.ones_like(state.active))  # every slot decodes (greedy, no stop)
        for _ in range(3):
            state, result = engine.generate(None, state, max_steps=engine.steps_per_call)
            np.asarray(result.data)
        running[name] = [engine, state]
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, entry in running.items():
            start = time.perf_counter()
            for _ in range(3):
                entry[1], result = entry[0].generate(None, entry[1], max_steps=steps)
                np.asarray(result.data)
            times[name].append((time.perf_counter() - start) / (3 * steps) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--lanes", type=int, default=1,
                        help="With --tunix_python: our 8 slots split between this many engines, one thread each.")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps_per_call", type=int, default=4)
    parser.add_argument("--max_steps_per_call", type=int, default=16,
                        help="The most steps a call runs while no request finishes (the configs' default; "
                             "0 = steps_per_call).")
    parser.add_argument("--decode_options", default="auto",
                        help="The in-process engines' decode options, as sampler.decode_options: 'auto' (this "
                             "host's cached or measured choice, as a run makes it), 'builtin', or option set names.")
    parser.add_argument("--skip_server", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="Only time the 8-slot engine's batched prefill and one generate call, then exit.")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="With --breakdown: sampling temperature of the decode steps (0 = greedy).")
    parser.add_argument("--tunix_python", default="",
                        help="A Python with google-tunix: also run tunix's sampler (batch 8) in this session.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="With --tunix_python: alternating rounds of --repeats batches, ours then tunix's.")
    parser.add_argument("--compare_options", action="store_true",
                        help="Only time the decode step under each set of XLA:CPU options, at each --concurrency "
                             "as the slot count (all decoded), variants alternated; then exit.")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: the CPU benchmark shape; 0.5b: Qwen2.5-0.5B's shape (for an accelerator).")
    parser.add_argument("--dtype", default="float32", help="Parameter and activation dtype (e.g. bfloat16).")
    parser.add_argument("--peak_gbs", type=float, default=0.0,
                        help="Memory bandwidth in GB/s: also print the in-process engine against the decode roofline.")
    args = parser.parse_args()
    global MAX_STEPS_PER_CALL, DECODE_OPTIONS
    MAX_STEPS_PER_CALL = args.max_steps_per_call
    DECODE_OPTIONS = args.decode_options
    if args.tunix_python and (args.model != "tiny" or args.dtype != "float32"):
        parser.error("--tunix_python compares the tiny float32 shape only (tunix_sampler_baseline.py builds that one)")
    model = dict(MODELS[args.model], param_dtype=args.dtype, dtype=args.dtype)
    config = models.ModelConfig(**model)
    # The server builds its model from the config's seed (0): the same weights as here.
    params = models.init_params(config, jax.random.PRNGKey(0))
    if args.compare_options:
        print("| slots (all decoded) | XLA defaults | fast min/max | small-batch set |\n|---|---|---|---|")
        for slots in (int(c) for c in args.concurrency.split(",")):
            ms = compare_decode_options(config, params, slots, args.steps_per_call, args.new_tokens)
            base = ms["XLA defaults"]
            print(f"| {slots} | {base:.3f} ms | " + " | ".join(
                f"{ms[k]:.3f} ({ms[k] / base:.2f})" for k in ("fast min/max", "small-batch set")) + " |", flush=True)
        return
    if args.breakdown:
        prefill_ms, generate_ms = bench_breakdown(config, params, args.steps_per_call, args.new_tokens,
                                                  args.temperature)
        print(f"batch 8, temperature {args.temperature:g}: prefill of 8 x {PROMPT_LEN}-token prompts "
              f"{prefill_ms:.2f} ms; one {args.steps_per_call}-step "
              f"generate call {generate_ms:.2f} ms = {generate_ms / args.steps_per_call:.3f} ms per decode step")
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = max(levels)
    rows = []
    sampler = LocalSampler(_engine(config, params, slots, args.steps_per_call, args.new_tokens))
    server = None if args.skip_server else start_server(model, slots, args.steps_per_call, args.new_tokens)
    try:
        for c in levels:
            naive = statistics.median(bench_naive(config, params, c, args.new_tokens) for _ in range(args.repeats))
            local = statistics.median(bench_local(sampler, c, args.new_tokens) for _ in range(args.repeats))
            remote = (statistics.median(bench_server(server[1], c, args.new_tokens) for _ in range(args.repeats))
                      if server else float("nan"))
            rows.append((c, naive, local, remote))
            print(f"concurrency {c}: naive {naive:,.0f}  in-process {local:,.0f}  server {remote:,.0f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        sampler.close()
        if server:
            server[0].kill()
    if args.tunix_python:
        # Same shape, batch 8, greedy: tunix's vanilla sampler vs our engine with 8 slots.
        compare_with_tunix(config, params, args.tunix_python, args.steps_per_call, args.new_tokens, args.repeats,
                           args.rounds, args.lanes)
    print("| concurrency | naive full forward | in-process engine | gRPC server | engine / naive | server / engine |")
    print("|---|---|---|---|---|---|")
    for c, naive, local, remote in rows:
        print(f"| {c} | {naive:,.0f} | {local:,.0f} | {remote:,.0f} | {local / naive:.2f} | {remote / local:.2f} |")
    if args.peak_gbs:
        engine = sampler.engine  # its decode_rows / max_cache_length: pure host-side arithmetic
        print(f"\n| concurrency | decoded slots | roofline at {args.peak_gbs:g} GB/s | in-process engine | fraction |")
        print("|---|---|---|---|---|")
        for c, _, local, _ in rows:
            bound = c / decode_step_floor(config, params, engine.decode_rows(c), engine.max_cache_length, args.peak_gbs)
            print(f"| {c} | {engine.decode_rows(c)} | {bound:,.0f} | {local:,.0f} | {local / bound:.2f} |")


if __name__ == "__main__":
    main()
