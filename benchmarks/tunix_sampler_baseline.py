"""tunix's vanilla `Sampler` on the benchmark model shape — run with a Python that has google-tunix.

  /path/to/tunix_venv/bin/python benchmarks/tunix_sampler_baseline.py --batch 8 --new_tokens 64

Prints one line `tunix_tokens_per_s=<float>`. With `--serve`, compiles, prints `ready`, then for
each line `N` read from stdin times N batches and prints `tunix_tokens_per_s=<r1,r2,...>`:
`sampler_throughput.py --tunix_python ...` alternates rounds of its own engine with rounds of these,
so that both see the same machine state. Model: tunix's Qwen3 with the same shape as sampler_throughput.py
(2 layers, d=256, 4 heads / 2 KV, head_dim 64, MLP 768, vocab 8192, tied embeddings, float32,
random weights), greedy decoding, prompts of 16 random ids.

With `--agentic`, a unit of work is one batch of multi-turn episodes (benchmarks/agentic_plan.py):
every turn calls the sampler on the whole history so far (re-prefilled, left-padded to a multiple
of 32 so that the shapes repeat), and the reply is `tunix_agentic=<tokens>:<seconds>,...`.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3


class IdTokenizer:
    """Text 't12 t7 ...' <-> ids, so prompts are exact id sequences."""

    def encode(self, text, **kwargs):
        return [int(t[1:]) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self):
        return 1

    def eos_id(self):
        return 8191

    def pad_id(self):
        return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="time batches on request (see the docstring)")
    parser.add_argument("--agentic", action="store_true", help="multi-turn episode batches (see the docstring)")
    args = parser.parse_args()
    if args.agentic:
        return agentic(args)
    config = qwen3.ModelConfig(num_layers=2, vocab_size=8192, embed_dim=256, hidden_dim=768, num_heads=4,
                               head_dim=64, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    model = qwen3.Qwen3(config, rngs=nnx.Rngs(params=0))
    cache = sampler_lib.CacheConfig(cache_size=16 + args.new_tokens + 16, num_layers=2, num_kv_heads=2, head_dim=64)
    sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
    rng = np.random.RandomState(0)
    prompts = [" ".join(f"t{i}" for i in rng.randint(200, 8000, 16)) for _ in range(args.batch)]

    def run():
        start = time.perf_counter()
        out = sampler(prompts, max_generation_steps=args.new_tokens, max_prompt_length=16, temperature=0.0,
                      eos_tokens=[8191])
        tokens = sum(len(t) for t in out.tokens)
        return tokens / (time.perf_counter() - start)

    run()  # compile
    if args.serve:
        print("ready", flush=True)
        for line in sys.stdin:
            rates = [run() for _ in range(int(line))]
            print("tunix_tokens_per_s=" + ",".join(f"{r:.1f}" for r in rates), flush=True)
        return
    print(f"tunix_tokens_per_s={statistics.median(run() for _ in range(args.repeats)):.1f}", flush=True)


def _model():
    config = qwen3.ModelConfig(num_layers=2, vocab_size=8192, embed_dim=256, hidden_dim=768, num_heads=4,
                               head_dim=64, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    return qwen3.Qwen3(config, rngs=nnx.Rngs(params=0))


def agentic(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import agentic_plan

    plays = iter(range(10**9))  # every episode batch has new ids, the same lengths (shapes)
    cache = sampler_lib.CacheConfig(cache_size=agentic_plan.CACHE_LENGTH, num_layers=2, num_kv_heads=2, head_dim=64)
    sampler = sampler_lib.Sampler(_model(), IdTokenizer(), cache)

    def sample(histories, n):
        longest = max(len(h) for h in histories)
        out = sampler([" ".join(f"t{i}" for i in h) for h in histories], max_generation_steps=n,
                      max_prompt_length=-(-longest // 32) * 32, temperature=0.0, eos_tokens=[8191])
        return [list(t) for t in out.tokens]

    def run():
        plan = agentic_plan.episode_batch(args.batch, ids_seed=next(plays))
        start = time.perf_counter()
        tokens, _ = agentic_plan.run_episodes(plan, sample)
        return tokens, time.perf_counter() - start

    run(), run()  # compile every shape the plans meet
    if args.serve:
        print("ready", flush=True)
        for line in sys.stdin:
            runs = [run() for _ in range(int(line))]
            print("tunix_agentic=" + ",".join(f"{t}:{s:.4f}" for t, s in runs), flush=True)
        return
    tokens, seconds = run()
    print(f"tunix_agentic={tokens}:{seconds:.4f}", flush=True)


if __name__ == "__main__":
    main()
