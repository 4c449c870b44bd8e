"""Memory plans for Qwen3-0.6B, 1.7B and 8B on one H200, a TPU v5e-8 and a v5p-8, and their check
against XLA's compiled peak at tiny scale.

  python benchmarks/memory_plan.py            # the tables (shapes only; nothing is allocated)
  python benchmarks/memory_plan.py --check    # plan vs compiled peak on tiny models (exit 1 if > 10% off)
  python benchmarks/memory_plan.py --fit 36 --dtype float32   # re-derive the live-array counts

Plans come from `jaxrl_agent.memory_plan` (see its docstring for the formula). Settings are
configs/qwen3_0_6b_agentic.py's: bfloat16 parameters and compute, block remat, rows of 1,024
tokens with 256 trained positions each (`target_multiple`), logits in chunks of 128, and the
in-process sampler's 128 slots of 1,024 tokens plus 32 prefix-cache entries (bfloat16 cache).
On a slice the learner's state is split over every chip (fsdp) and its rows over them too, while the
in-process sampler lives on the first chip (`AgentEngine` takes `jax.devices()[:1]`), so the first
chip is the one that must fit. `sampler slots` is the config's 128 (with 32 prefix-cache entries) when
they fit beside one learner row under 90% of a chip's memory, else the largest power of two that does
(a quarter of it as prefix entries); `rows / chip` is then the largest power of two of learner rows
per microbatch per chip that fits (64+: the largest tried); 0 = not even one row.

The check compiles the learner step (`learner.make_train_step`, default objective, AdamW, remat)
for tiny shapes the counts were not fitted on and compares the plan with XLA's peak
(arguments + temporaries + outputs - donated aliases), for float32 and for bfloat16 parameters with
float32 master weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_agent import learner, memory_plan, models  # noqa: E402

QWEN3 = {  # Hugging Face config.json shapes
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                       tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                       tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     tie_word_embeddings=False),
}
# (chips, bytes per chip): H200 141 GB HBM3e (nvidia-smi: 143,771 MiB); v5e 16 GiB; v5p 95 GiB per chip.
DEVICES = {"1x H200": (1, 143771 * 2**20), "TPU v5e-8": (8, 16 * 2**30), "TPU v5p-8": (4, 95 * 2**30)}
SAMPLER = dict(slots=128, cache_length=1024, prefix_cache_entries=32)
ROWS = (1, 2, 4, 8, 16, 32, 64)
# Held-out check shapes: (rows, T, V, H, I, L, N, K, D, targets, chunk); none of them was in the fit.
CHECK_SHAPES = [
    (2, 256, 4096, 128, 384, 4, 4, 2, 32, 64, 16),
    (4, 128, 2048, 64, 256, 3, 4, 1, 16, 32, 16),
    (1, 512, 8192, 96, 256, 2, 2, 1, 48, 128, 32),
    (8, 64, 1024, 256, 768, 2, 8, 4, 32, 32, 32),
]


def qwen3(name: str, **changes) -> models.ModelConfig:
    return models.ModelConfig(architecture="qwen3", vocab_size=151936, head_dim=128, qk_norm=True,
                              rope_theta=1000000.0, param_dtype="bfloat16", dtype="bfloat16", remat=True,
                              **{**QWEN3[name], **changes})


def tiny(shape, dtype: str) -> tuple[models.ModelConfig, dict]:
    rows, t, v, h, i, l, n, k, d, targets, chunk = shape
    model = models.ModelConfig(architecture="qwen3", vocab_size=v, hidden_size=h, intermediate_size=i, num_layers=l,
                               num_heads=n, num_kv_heads=k, head_dim=d, qk_norm=True, tie_word_embeddings=True,
                               remat=True, dtype=dtype, param_dtype=dtype)
    return model, dict(rows=rows, row_length=t, targets=targets, logits_chunk=chunk, master_dtype="float32")


def compiled_peak(model: models.ModelConfig, *, rows: int, row_length: int, targets: int, logits_chunk: int,
                  master_dtype: str) -> dict:
    """XLA's buffer assignment for one learner step at these shapes (compiled, never run)."""
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    optimizer = learner.make_optimizer(learning_rate=1e-6, warmup_steps=1, total_steps=10)
    state = jax.eval_shape(lambda p: learner.init_state(p, optimizer, master_dtype=master_dtype or None), params)
    spec = lambda dtype, shape=(rows, row_length): jax.ShapeDtypeStruct(shape, dtype)
    batch = learner.PackedBatch(
        tokens=spec(jnp.int32), segment_ids=spec(jnp.int32), positions=spec(jnp.int32), loss_mask=spec(jnp.int32),
        advantages=spec(jnp.float32), sampler_logprobs=spec(jnp.float32), old_logprobs=spec(jnp.float32),
        policy_version=spec(jnp.int32), target_index=spec(jnp.int32, (rows, targets)) if targets else None)
    step = jax.jit(learner.make_train_step(model, optimizer, logits_chunk=logits_chunk), donate_argnums=(0,))
    analysis = step.lower(state, batch).compile().memory_analysis()
    arguments, temp = analysis.argument_size_in_bytes, analysis.temp_size_in_bytes
    outputs, alias = analysis.output_size_in_bytes, analysis.alias_size_in_bytes
    return dict(arguments=arguments, temp=temp, outputs=outputs, alias=alias, peak=arguments + temp + outputs - alias)


def check(verbose: bool = True) -> list[tuple[str, tuple, float, float, float]]:
    """[(dtype, shape, planned MiB, compiled MiB, planned / compiled)] over CHECK_SHAPES."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        for shape in CHECK_SHAPES:
            model, settings = tiny(shape, dtype)
            planned = memory_plan.learner_memory(model, **settings).total
            peak = compiled_peak(model, **settings)["peak"]
            rows.append((dtype, shape, planned / 2**20, peak / 2**20, planned / peak))
            if verbose:
                print(f"| {dtype} | {shape} | {planned / 2**20:,.1f} | {peak / 2**20:,.1f} | {planned / peak:.3f} |",
                      flush=True)
    return rows


def fit(samples: int, dtype: str, seed: int) -> dict:
    """Counts of the plan's terms that fit the compiled temporaries of random tiny shapes best in the
    worst case (largest relative error)."""
    from scipy.optimize import linprog

    rng = random.Random(seed)
    features, targets = [], []
    names = list(memory_plan.TEMPORARY_COUNTS[dtype])
    for _ in range(samples):
        n = rng.choice([2, 4, 8])
        k = rng.choice([x for x in (1, 2, 4) if n % x == 0])
        t = rng.choice([64, 128, 256, 512])
        shape = (rng.choice([1, 2, 4, 8]), t, rng.choice([256, 1024, 4096, 16384]), rng.choice([32, 64, 128, 256]),
                 rng.choice([64, 256, 512, 1024]), rng.choice([1, 2, 3, 4, 6]), n, k, rng.choice([16, 32, 64]),
                 rng.choice([t // 4, t // 2]), rng.choice([16, 32]))
        model, settings = tiny(shape, dtype)
        measured = compiled_peak(model, **settings)["temp"]
        row = []
        for name in names:  # each term alone, with a count of 1
            counts = {x: float(x == name) for x in names}
            saved = memory_plan.TEMPORARY_COUNTS[dtype]
            memory_plan.TEMPORARY_COUNTS[dtype] = counts
            try:
                plan = memory_plan.learner_memory(model, **settings).parts
            finally:
                memory_plan.TEMPORARY_COUNTS[dtype] = saved
            row.append(sum(plan[p] for p in memory_plan.ACTIVATION_PARTS) + plan["gradients"])
        features.append(row)
        targets.append(measured)
    x, y = np.asarray(features, float), np.asarray(targets, float)
    # Minimise the largest relative error: min e s.t. |x c / y - 1| <= e, c >= 0 (a linear program).
    a, m = x / y[:, None], x.shape[1]
    ones = np.ones((len(y), 1))
    result = linprog(np.r_[np.zeros(m), 1.0], A_ub=np.r_[np.c_[a, -ones], np.c_[-a, -ones]],
                     b_ub=np.r_[np.ones(len(y)), -np.ones(len(y))], bounds=[(0, None)] * (m + 1))
    coef = result.x[:m]
    error = x @ coef / y - 1
    print(f"median |error| {np.median(np.abs(error)):.3f}, max {np.max(np.abs(error)):.3f}")
    return {name: round(float(c), 2) for name, c in zip(names, coef)}


def table() -> None:
    print("| model | hardware | master weights | learner state / chip (GiB) | activations / row (GiB) | "
          "sampler slots | sampler on chip 0 (GiB) | rows / chip | chip-0 peak (GiB) | of memory |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in QWEN3:
        model = qwen3(name)
        for device, (chips, capacity) in DEVICES.items():
            for master in ("float32", ""):
                def learner_plan(rows):
                    return memory_plan.learner_memory(model, rows=rows * chips, row_length=1024, targets=256,
                                                      logits_chunk=128, master_dtype=master, shards=chips,
                                                      batch_shards=chips)

                def sampler_plan(slots):
                    return memory_plan.sampler_memory(model, slots=slots, cache_length=SAMPLER["cache_length"],
                                                      prefix_cache_entries=slots // 4)

                fits = lambda rows, slots: learner_plan(rows).total + sampler_plan(slots).total <= 0.9 * capacity
                # The config's 128 slots (32 prefix entries) when they fit beside one row, else fewer.
                slots = next((s for s in (128, 64, 32, 16, 8) if fits(1, s)), 0)
                rows = max((r for r in ROWS if slots and fits(r, slots)), default=0)
                shown, sampler = learner_plan(max(rows, 1)), sampler_plan(max(slots, 8))
                state = sum(shown.parts[p] for p in ("parameters", "master", "optimizer")) / 2**30
                per_row = (learner_plan(2).activations - learner_plan(1).activations) / 2**30
                peak = (shown.total + sampler.total) / 2**30
                rows_shown = f"{rows}+" if rows == ROWS[-1] else str(rows)
                slots_shown = str(slots) if slots else "- (8 do not fit)"
                print(f"| {name} | {device} | {'float32' if master else 'none (bfloat16 moments)'} | {state:,.1f} | "
                      f"{per_row:,.2f} | {slots_shown} | {sampler.gib():,.1f} | {rows_shown} | {peak:,.1f} | "
                      f"{peak * 2**30 / capacity:.0%} |")


def defaults() -> None:
    """Per size, what remat and the logits chunk buy, per learner row of 1,024 tokens (256 trained)."""
    print("| model | one block's working set (GiB) | x layers without remat (GiB) | saved block inputs with remat "
          "(GiB) | logits at once: 256 / 128 / 64 / 32 positions (GiB) |")
    print("|---|---|---|---|---|")
    for name in QWEN3:
        model = qwen3(name)
        plans = {c: memory_plan.learner_memory(model, rows=1, row_length=1024, targets=256, logits_chunk=c).parts
                 for c in (0, 128, 64, 32)}
        block, saved = plans[0]["block_working_set"] / 2**30, plans[0]["saved_block_inputs"] / 2**30
        logits = " / ".join(f"{plans[c]['logits'] / 2**30:.2f}" for c in (0, 128, 64, 32))
        print(f"| {name} | {block:.2f} | {block * model.num_layers:.1f} | {saved:.2f} | {logits} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--fit", type=int, default=0, help="re-derive the counts from this many compiled shapes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.fit:
        print(json.dumps(fit(args.fit, args.dtype, args.seed)))
    elif args.check:
        print("| compute dtype | (rows, T, V, H, I, L, N, K, D, targets, chunk) | plan (MiB) | compiled peak (MiB) | ratio |")
        print("|---|---|---|---|---|")
        rows = check()
        worst = max(abs(r[-1] - 1) for r in rows)
        print(f"\nlargest error {worst:.1%} (bound 10%)")
        sys.exit(0 if worst <= 0.10 else 1)
    else:
        table()
        print()
        defaults()


if __name__ == "__main__":
    main()
