"""tunix's GRPO update on the benchmark shape — run with a Python that has google-tunix.

  /path/to/tunix_venv/bin/python benchmarks/tunix_learner_baseline.py [--steps 10]

One update = tunix's registered GRPO policy loss (`tunix.rl.algo_core.grpo_loss_fn`: per-token
log-probs recomputed from prompt + completion, clipped ratio, KL to a reference with beta 0.04,
token-mean aggregation) differentiated with `nnx.value_and_grad` and applied by an
`nnx.Optimizer(optax.adamw)` under `nnx.jit` — the same computation tunix's trainer jits per step.
Shape: tunix's Qwen3, 2 layers, d=256, 4 heads / 2 KV heads, head_dim 64, MLP 768, vocab 8192,
float32; 8 sequences of 128 tokens (16 prompt + 112 completion). Prints `tunix_step_s=<median>`.

With `--serve`, compiles, prints `ready`, then for each line `N` read from stdin runs N timed steps
and prints `tunix_times=<t1,t2,...>` (seconds): `benchmarks/learner_step.py` alternates rounds of
its own steps with rounds of these, so both see the same machine state.
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.rl import algo_core, common
from tunix.rl.grpo import grpo_learner
from tunix.models.qwen3 import model as qwen3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=112)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--host_allocator", choices=("reuse", "system"), default="system",
                        help="reuse: jaxrl_agent's launcher setting (jaxrl_agent/heap.py) in this process too")
    args = parser.parse_args()
    if args.host_allocator == "reuse":  # heap.py needs only the standard library (and jax)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from jaxrl_agent import heap

        heap.set_host_allocator("reuse")
    config = qwen3.ModelConfig(num_layers=2, vocab_size=8192, embed_dim=256, hidden_dim=768, num_heads=4,
                               head_dim=64, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    model = qwen3.Qwen3(config, rngs=nnx.Rngs(params=0))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6)), wrt=nnx.Param)
    algo = grpo_learner.GRPOConfig(num_generations=4, beta=0.04, epsilon=0.2)
    if not hasattr(algo, "temperature"):  # read by grpo_loss_fn in google-tunix 0.1.7, absent from its config
        object.__setattr__(algo, "temperature", 1.0)
    rng = np.random.RandomState(0)
    b, p, c = args.batch, args.prompt, args.completion
    example = common.TrainExample(
        prompt_ids=jnp.asarray(rng.randint(2, 8000, (b, p)), jnp.int32),
        prompt_mask=jnp.ones((b, p), jnp.int32),
        completion_ids=jnp.asarray(rng.randint(2, 8000, (b, c)), jnp.int32),
        completion_mask=jnp.ones((b, c), jnp.int32),
        advantages=jnp.asarray(rng.randn(b), jnp.float32),
        ref_per_token_logps=jnp.asarray(-rng.rand(b, c) * 9, jnp.float32),
        old_per_token_logps=jnp.asarray(-rng.rand(b, c) * 9, jnp.float32),
    )

    @nnx.jit
    def train_step(model, optimizer, example):
        def loss_fn(model):
            loss, _ = algo_core.grpo_loss_fn(model, example, algo, pad_id=0, eos_id=8191)
            return loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def timed(steps):
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(train_step(model, optimizer, example))
            times.append(time.perf_counter() - start)
        return times

    jax.block_until_ready(train_step(model, optimizer, example))  # compile
    if args.serve:
        print("ready", flush=True)
        for line in sys.stdin:
            times = timed(int(line))
            print("tunix_times=" + ",".join(f"{t:.6f}" for t in times), flush=True)
        return
    print(f"tunix_step_s={statistics.median(timed(args.steps)):.6f}", flush=True)


if __name__ == "__main__":
    main()
