"""Weight sync to a sampler server: seconds and GB/s of `SamplerClient.update_weights` (the
StreamWeights stream of chunks) by chunk size, against streaming the same chunks without a server.

  python benchmarks/weight_sync.py [--layers 8 --hidden 512 --vocab 32768] [--chunks_mb 1,16,64] [--rounds 5]

One `launch/sampler_server.py` process on this host serves a Qwen3-style model of the given shape
(float32, random weights); each round pushes the same parameters once per chunk size, in turn. The
baseline, measured in the same invocation, is the client side alone: producing every message of
the stream (`weight_messages`) and copying it into a receiving `WeightAssembly` in this process,
with no gRPC and no engine update. Reported: median seconds per sync, GB/s, and the ratio to the
baseline (what the network hop and the server's swap of the weights add).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_agent import auth, models  # noqa: E402
from jaxrl_agent.sampling.client import SamplerClient  # noqa: E402
from jaxrl_agent.sampling.server import WeightAssembly, weight_messages  # noqa: E402


def start_server(overrides):
    os.environ.setdefault(auth.TOKEN_ENV, auth.new_token())
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "sampler_server.py"), "--config",
                             os.path.join(ROOT, "configs", "calculator_tiny.py"), "--port", "0", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    port = re.search(r":(\d+)$", line.strip()).group(1)
    return proc, f"127.0.0.1:{port}"


def local_stream_seconds(params, chunk_bytes):
    started = time.perf_counter()
    assembly = WeightAssembly()
    for message in weight_messages(params, 1, chunk_bytes):
        assembly.add(message)
    assembly.result()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunks_mb", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shape = dict(architecture="qwen3", qk_norm=True, vocab_size=args.vocab, hidden_size=args.hidden,
                 intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 head_dim=args.hidden // 8, tie_word_embeddings=True)
    config = models.ModelConfig(**shape)
    params = jax.device_get(models.init_params(config, jax.random.PRNGKey(0)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    overrides = [f"--config.model.{k}={v}" for k, v in shape.items()] + [
        "--config.sampler.max_concurrent_decodes=2", "--config.sampler.max_prefill_length=16",
        "--config.sampler.max_cache_length=32"]
    proc, address = start_server(overrides)
    chunks = [int(float(c) * 2**20) for c in args.chunks_mb.split(",")]
    served = {c: [] for c in chunks}
    local = {c: [] for c in chunks}
    try:
        async def push(chunk, version):
            client = SamplerClient([address], weight_chunk_bytes=chunk, timeout_s=600)
            started = time.perf_counter()
            failures = await client.update_weights(params, version)
            seconds = time.perf_counter() - started
            await client.close()
            assert not failures, failures
            return seconds

        asyncio.run(push(chunks[-1], 1))  # warm-up: the server's first swap compiles nothing, but allocates
        version = 2
        for _ in range(args.rounds):
            for chunk in chunks:
                served[chunk].append(asyncio.run(push(chunk, version)))
                local[chunk].append(local_stream_seconds(params, chunk))
                version += 1
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\nmodel: {models.count_params(params) / 1e6:.1f}M parameters, {nbytes / 2**20:,.0f} MiB float32; "
          f"{args.rounds} rounds, medians\n")
    print("| chunk (MiB) | messages | sync to server (s) | GB/s | stream alone (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for chunk in chunks:
        messages = sum(1 for _ in weight_messages(params, 1, chunk))
        s, b = statistics.median(served[chunk]), statistics.median(local[chunk])
        print(f"| {chunk / 2**20:g} | {messages} | {s:.3f} | {nbytes / s / 1e9:.2f} | {b:.3f} | {s / b:.2f} |")


if __name__ == "__main__":
    main()
