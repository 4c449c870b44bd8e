"""The learner's train step against tunix's GRPO update, same shape, same session.

  python benchmarks/learner_step.py [--steps 10] [--tunix_python /path/to/tunix_venv/bin/python]

Shape: Qwen3-style, 2 layers, d=256, 4 heads / 2 KV heads, head_dim 64, MLP 768, vocab 8192, tied
embeddings, float32; 8 sequences of 128 tokens (16 prompt + 112 sampled). Ours: `learner.make_train_step`
with the trainer's default objective (token-level mirror descent + token clipping + TIS) and AdamW
after global-norm clipping, jitted with explicit shardings on one device, logits only at the 112
trained positions (the batch's `target_index`, as the trainer packs it with `learner.target_multiple`
> 0, the Hugging Face configs' setting; `--target_multiple 0` = at every position); tunix:
`benchmarks/tunix_learner_baseline.py`. Prints median step times, trained tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def ours(steps: int, batch: int, prompt: int, completion: int, logits_chunk: int = 0,
         target_multiple: int = 16) -> float:
    from jaxrl_agent import learner, losses, models, replay, sharding

    config = models.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
                                tie_word_embeddings=True, scan_layers=False)
    params = models.init_params(config, jax.random.PRNGKey(0))
    optimizer = learner.make_optimizer(learning_rate=1e-6, warmup_steps=1, total_steps=1000)
    state = learner.init_state(params, optimizer)
    step_fn, _ = learner.jit_train_step(
        learner.make_train_step(config, optimizer, objective=losses.make_objective(losses.default_objective_spec()),
                                logits_chunk=logits_chunk),
        state, sharding.make_mesh(1, 1, 1))
    rng = np.random.RandomState(0)
    t = prompt + completion
    mask = np.zeros((batch, t), np.int32)
    mask[:, prompt:] = 1
    batch_arrays = learner.PackedBatch(
        tokens=jnp.asarray(rng.randint(2, 8000, (batch, t)), jnp.int32),
        segment_ids=jnp.ones((batch, t), jnp.int32), positions=jnp.broadcast_to(jnp.arange(t), (batch, t)),
        loss_mask=jnp.asarray(mask), advantages=jnp.asarray(rng.randn(batch, 1) * mask, jnp.float32),
        sampler_logprobs=jnp.asarray(-rng.rand(batch, t) * 9 * mask, jnp.float32),
        old_logprobs=jnp.asarray(-rng.rand(batch, t) * 9 * mask, jnp.float32),
        policy_version=jnp.asarray(np.where(mask == 1, 0, -1), jnp.int32))
    if target_multiple:  # as replay.pack builds it for the trainer (learner.target_multiple)
        batch_arrays = batch_arrays.replace(target_index=jnp.asarray(replay.target_index(mask, target_multiple)))
    state, metrics = step_fn(state, batch_arrays)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step_fn(state, batch_arrays)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=112)
    parser.add_argument("--tunix_python", default=None)
    parser.add_argument("--logits_chunk", type=int, default=0, help="learner.logits_chunk (0 = whole rows)")
    parser.add_argument("--target_multiple", type=int, default=16,
                        help="learner.target_multiple (0 = logits at every position, as before)")
    args = parser.parse_args()
    ours_s = ours(args.steps, args.batch, args.prompt, args.completion, args.logits_chunk, args.target_multiple)
    tokens = args.batch * args.completion
    rows = [("jaxrl_agent train_step", ours_s)]
    if args.tunix_python:
        out = subprocess.run([args.tunix_python, __file__.replace("learner_step.py", "tunix_learner_baseline.py"),
                              "--steps", str(args.steps), "--batch", str(args.batch), "--prompt", str(args.prompt),
                              "--completion", str(args.completion)], capture_output=True, text=True, check=True)
        line = next(l for l in out.stdout.splitlines() if l.startswith("tunix_step_s="))
        rows.append(("tunix GRPO update", float(line.split("=")[1])))
    print(f"\nshape: {args.batch} x {args.prompt + args.completion} tokens ({tokens} trained), median of {args.steps}\n")
    print("| learner | step time (ms) | trained tokens/s |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} |")
    if len(rows) == 2:
        print(f"\nratio ours / tunix step time: {rows[0][1] / rows[1][1]:.2f} (target <= 0.8)")


if __name__ == "__main__":
    main()
