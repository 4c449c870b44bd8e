"""The learner's train step against tunix's GRPO update, same shape, same session.

  python benchmarks/learner_step.py [--steps 10] [--rounds 1] [--tunix_python /path/to/tunix_venv/bin/python]
      [--host_allocator reuse|system] [--tunix_host_allocator system|reuse]
  python benchmarks/learner_step.py --model default --batch 24   # the embedded default's model, ours only

Shape: Qwen3-style, 2 layers, d=256, 4 heads / 2 KV heads, head_dim 64, MLP 768, vocab 8192, tied
embeddings, float32; 8 sequences of 128 tokens (16 prompt + 112 sampled). Ours: `learner.make_train_step`
with the trainer's default objective (token-level mirror descent + token clipping + TIS) and AdamW
after global-norm clipping, jitted with explicit shardings on one device, logits only at the 112
trained positions (the batch's `target_index`, as the trainer packs it with `learner.target_multiple`
> 0, the Hugging Face configs' setting; `--target_multiple 0` = at every position); tunix:
`benchmarks/tunix_learner_baseline.py`, kept running in a subprocess. Both are compiled first; then
`--rounds` rounds alternate `--steps` timed steps of ours with `--steps` of tunix's, so that a slow
spell of this (shared, noisy) machine falls on both. Prints median step times over all rounds,
trained tokens/s, the ratio of the medians and the median of the per-round ratios. Ours runs under
the launcher's `host_allocator` (default 'reuse': freed memory kept for the next step, CPU
computations on the calling thread; jaxrl_agent/heap.py), tunix under the C library's defaults
unless `--tunix_host_allocator reuse` gives it the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from served_baseline import ServedBaseline

from jaxrl_agent import heap


def model_config(model: str):
    """'issue6': the benchmark shape above (tunix's baseline builds the same); 'default': the embedded
    default's model (`configs/calculator_tiny.py`: 4 layers, width 128, a character vocabulary)."""
    from jaxrl_agent import config_lib, models

    if model == "default":
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "calculator_tiny.py")
        return models.ModelConfig.from_config_dict(config_lib.load_config(path).model)
    return models.ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
                              tie_word_embeddings=True, scan_layers=False)


def ours(batch: int, prompt: int, completion: int, logits_chunk: int = 0, target_multiple: int = 16,
         model: str = "issue6"):
    """Compiles our train step on the benchmark shape; returns `timed(steps) -> [seconds per step]`."""
    from jaxrl_agent import learner, losses, models, replay, sharding

    config = model_config(model)
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
        tokens=jnp.asarray(rng.randint(2, min(8000, config.vocab_size), (batch, t)), jnp.int32),
        segment_ids=jnp.ones((batch, t), jnp.int32), positions=jnp.broadcast_to(jnp.arange(t), (batch, t)),
        loss_mask=jnp.asarray(mask), advantages=jnp.asarray(rng.randn(batch, 1) * mask, jnp.float32),
        sampler_logprobs=jnp.asarray(-rng.rand(batch, t) * 9 * mask, jnp.float32),
        old_logprobs=jnp.asarray(-rng.rand(batch, t) * 9 * mask, jnp.float32),
        policy_version=jnp.asarray(np.where(mask == 1, 0, -1), jnp.int32))
    if target_multiple:  # as replay.pack builds it for the trainer (learner.target_multiple)
        batch_arrays = batch_arrays.replace(target_index=jnp.asarray(replay.target_index(mask, target_multiple)))
    state = jax.block_until_ready(step_fn(state, batch_arrays)[0])  # compile

    def timed(steps: int) -> list[float]:
        nonlocal state
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step_fn(state, batch_arrays)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return times

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round, per learner")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (ours, then tunix)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=112)
    parser.add_argument("--tunix_python", default=None)
    parser.add_argument("--model", choices=("issue6", "default"), default="issue6",
                        help="issue6: the shape above; default: configs/calculator_tiny.py's model (ours only)")
    parser.add_argument("--logits_chunk", type=int, default=0, help="learner.logits_chunk (0 = whole rows)")
    parser.add_argument("--target_multiple", type=int, default=16,
                        help="learner.target_multiple (0 = logits at every position, as before)")
    parser.add_argument("--host_allocator", choices=heap.HOST_ALLOCATORS, default="reuse",
                        help="ours: config.host_allocator (the launcher's default: reuse; jaxrl_agent/heap.py)")
    parser.add_argument("--tunix_host_allocator", choices=heap.HOST_ALLOCATORS, default="system",
                        help="the same setting in tunix's process (system = as tunix runs by default)")
    args = parser.parse_args()
    if args.tunix_python and args.model != "issue6":
        parser.error("--tunix_python compares the issue6 shape only (tunix_learner_baseline.py builds that one)")
    heap.set_host_allocator(args.host_allocator)  # as the launcher does, before the first computation
    learners = [("jaxrl_agent train_step", ours(args.batch, args.prompt, args.completion, args.logits_chunk,
                                                args.target_multiple, args.model))]
    tunix = ServedBaseline(args.tunix_python, __file__.replace("learner_step.py", "tunix_learner_baseline.py"),
                           ["--batch", str(args.batch), "--prompt", str(args.prompt), "--completion", str(args.completion),
                            "--host_allocator", args.tunix_host_allocator],
                           "tunix_times=") if args.tunix_python else None
    if tunix:
        learners.append(("tunix GRPO update", tunix.request))
    for _, timed in learners:  # one untimed step each after both have compiled (first-touch costs)
        timed(1)
    times = {name: [] for name, _ in learners}
    round_ratios = []
    for _ in range(args.rounds):
        medians = []
        for name, timed in learners:
            round_times = timed(args.steps)
            times[name] += round_times
            medians.append(statistics.median(round_times))
        if tunix:
            round_ratios.append(medians[0] / medians[1])
    if tunix:
        tunix.close()
    tokens = args.batch * args.completion
    print(f"\nmodel: {args.model}; shape: {args.batch} x {args.prompt + args.completion} tokens ({tokens} trained); "
          f"{args.rounds} round(s) of {args.steps} steps each; medians over all steps; host allocator: ours "
          f"{args.host_allocator}" + (f", tunix {args.tunix_host_allocator}" if tunix else "") + "\n")
    print("| learner | step time (ms) | trained tokens/s |")
    print("|---|---|---|")
    medians = [statistics.median(times[name]) for name, _ in learners]
    for (name, _), seconds in zip(learners, medians):
        print(f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} |")
    if tunix:
        print(f"\nratio ours / tunix step time: {medians[0] / medians[1]:.2f} (target <= 0.8); per round: "
              + ", ".join(f"{r:.2f}" for r in round_ratios) + f" (median {statistics.median(round_ratios):.2f})")


if __name__ == "__main__":
    main()
