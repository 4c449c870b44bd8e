"""Compiled learner-step memory against `learner.logits_chunk`, at a real vocabulary size.

  python benchmarks/learner_memory.py [--chunks 0,128,64,16] [--batch 4] [--length 256]

Model: Qwen3-style with Qwen3's vocabulary (151,936), 1 layer, d=64 (the vocabulary side dominates,
as it does in RL batches of small and mid-size models); float32; one RL train step (the default
objective, AdamW) on [batch, length] packed rows. Nothing runs: each variant is compiled and XLA's
`memory_analysis()` reports its temporary buffers. `0` is the whole row at once (the [B, T, V]
logits exist in full, as before chunking).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/learner_memory.py --devices 8

With `--devices N` (simulated CPU devices), the same step at the first chunk of `--chunks` is also
compiled on a mesh of N devices (fsdp), once with the learner pinning its activations to the batch
rows (`make_train_step(..., mesh=)`, what the trainer builds) and once without: each device's
temporary memory against one device's.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_agent import learner, models  # noqa: E402


def temp_bytes(chunk: int, batch: int, length: int) -> tuple[int, int]:
    config = models.ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, qk_norm=True,
                                tie_word_embeddings=True)
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    optimizer = learner.make_optimizer(learning_rate=1e-6, warmup_steps=1, total_steps=10)
    state = jax.eval_shape(lambda p: learner.init_state(p, optimizer), params)
    spec = lambda dtype: jax.ShapeDtypeStruct((batch, length), dtype)
    batch_spec = learner.PackedBatch(
        tokens=spec(jnp.int32), segment_ids=spec(jnp.int32), positions=spec(jnp.int32), loss_mask=spec(jnp.int32),
        advantages=spec(jnp.float32), sampler_logprobs=spec(jnp.float32), old_logprobs=spec(jnp.float32),
        policy_version=spec(jnp.int32))
    step = jax.jit(learner.make_train_step(config, optimizer, logits_chunk=chunk), donate_argnums=(0,))
    analysis = step.lower(state, batch_spec).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.argument_size_in_bytes


def mesh_temp_bytes(chunk: int, batch: int, length: int, devices: int, pinned: bool) -> int:
    """One device's temporary bytes of the step on a mesh of `devices` (rows over fsdp)."""
    from jaxrl_agent import sharding

    config = models.ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, qk_norm=True,
                                tie_word_embeddings=True)
    mesh = sharding.make_mesh(devices=jax.devices()[:devices])
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    optimizer = learner.make_optimizer(learning_rate=1e-6, warmup_steps=1, total_steps=10)
    state = jax.eval_shape(lambda p: learner.init_state(p, optimizer), params)
    spec = lambda dtype: jax.ShapeDtypeStruct((batch, length), dtype)
    batch_spec = learner.PackedBatch(
        tokens=spec(jnp.int32), segment_ids=spec(jnp.int32), positions=spec(jnp.int32), loss_mask=spec(jnp.int32),
        advantages=spec(jnp.float32), sampler_logprobs=spec(jnp.float32), old_logprobs=spec(jnp.float32),
        policy_version=spec(jnp.int32))
    step_fn = learner.make_train_step(config, optimizer, logits_chunk=chunk, mesh=mesh if pinned else None)
    step, _ = learner.jit_train_step(step_fn, state, mesh)
    return step.lower(state, batch_spec).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="0,128,64,16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--devices", type=int, default=1, help="Also compare the step on a mesh of this many.")
    args = parser.parse_args()
    rows = [(int(c), *temp_bytes(int(c), args.batch, args.length)) for c in args.chunks.split(",")]
    base = rows[0][1]
    logits_mib = args.batch * args.length * 151936 * 4 / 2**20
    print(f"\nbatch {args.batch} x {args.length} tokens, vocabulary 151,936: one float32 [B, T, V] array is "
          f"{logits_mib:,.0f} MiB\n")
    print("| logits_chunk | temporary memory (MiB) | vs first row | parameters + optimizer (MiB) |")
    print("|---|---|---|---|")
    for chunk, temp, arguments in rows:
        print(f"| {chunk} | {temp / 2**20:,.0f} | {temp / base:.2f} | {arguments / 2**20:,.0f} |")
    if args.devices > 1:
        if len(jax.devices()) < args.devices:
            raise SystemExit(f"--devices {args.devices}: only {len(jax.devices())} devices (set XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={args.devices})")
        chunk = rows[0][0]
        one = mesh_temp_bytes(chunk, args.batch, args.length, 1, True)
        print(f"\nthe step at logits_chunk {chunk} on a mesh: one device's temporary memory\n")
        print("| devices | activations pinned to the rows | temporary memory per device (MiB) | vs one device |")
        print("|---|---|---|---|")
        print(f"| 1 | yes | {one / 2**20:,.0f} | 1.00 |")
        for pinned in (False, True):
            temp = mesh_temp_bytes(chunk, args.batch, args.length, args.devices, pinned)
            print(f"| {args.devices} | {'yes' if pinned else 'no'} | {temp / 2**20:,.0f} | {temp / one:.2f} |")


if __name__ == "__main__":
    main()
