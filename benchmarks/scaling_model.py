"""A paper model of one agentic RL iteration at scale: Qwen3-0.6B and 8B on a TPU v5e-256 and on
64 H100s (8 nodes of 8). Nothing runs; every number comes from the constants below.

  python benchmarks/scaling_model.py [--episodes 1024 --turns 4 --reply 512 --context 8192]

The iteration: `episodes` episodes of `turns` assistant turns of `reply` generated tokens each, whose
learner rows are `context` tokens long (prompt, tool results, replies). Per chip:
- **Sampling** (decode) is memory-bound: a step over B slots reads every weight once (2 bytes per
  parameter) and each slot's key/value cache at its mean length (half the context), so
  tokens/s = B / max(bytes / HBM bandwidth, 2 * P * B / peak FLOP/s). B is as many slots as fit in
  what HBM is left after the weights, capped at 256.
- **Learning** is compute-bound: 6 * P FLOPs per token (+ attention, 12 * L * H * T per token) at
  the MFU given (40%, a good dense-transformer figure; our own is not measured on an accelerator).
- **Weight sync**: the learner's new bfloat16 weights (2 * P bytes) reach the samplers once per
  iteration, over the link they cross (ICI within a v5e-256 slice; InfiniBand between H100 nodes).
- **Split**: with sampling and learning overlapped (the async schedule), an iteration takes
  max(sample time, learn time, one episode's decode steps) + sync; the best split of the N chips
  into samplers and learners makes the first two equal. The third is the critical path: an
  episode's turns x reply tokens, one decode step each, which no number of chips shortens.

Where it stops scaling is in the printed notes: per-chip batch and the fixed cost of gathering a
small model's weights.
"""

from __future__ import annotations

import argparse

MODELS = {  # parameters, layers, hidden, kv heads, head dim
    "Qwen3-0.6B": dict(params=0.60e9, layers=28, hidden=1024, kv_heads=8, head_dim=128),
    "Qwen3-8B": dict(params=8.19e9, layers=36, hidden=4096, kv_heads=8, head_dim=128),
}
# chips, bf16 peak FLOP/s, HBM bytes/s, HBM bytes per chip, and the link a weight sync crosses
# (bytes/s per chip): a v5e-256 is one slice, so ICI (1,600 Gbit/s per chip); 64 H100s are 8
# nodes, so the sync from learner nodes to sampler nodes crosses InfiniBand (400 Gbit/s per GPU).
SYSTEMS = {
    "TPU v5e-256": dict(chips=256, flops=197e12, hbm_bw=819e9, hbm=16e9, link=200e9, link_name="ICI"),
    "64x H100 (8 nodes)": dict(chips=64, flops=989e12, hbm_bw=3.35e12, hbm=80e9, link=50e9, link_name="InfiniBand"),
}
MFU = 0.40
MAX_SLOTS = 256


def per_chip(model, system, context):
    """(chips per sampler, slots per sampler, decode tokens/s per chip, learner tokens/s per chip).
    A sampler spans the fewest chips (1, 2, 4, 8: tensor parallel, its weights and cache split)
    that hold its weights and at least 8 slots; the collectives tensor parallelism adds are left out."""
    p = model["params"]
    kv_per_token = model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * 2  # bfloat16 k and v
    for width in (1, 2, 4, 8):
        free = system["hbm"] * 0.9 * width - 2 * p  # weights, then the cache
        slots = int(max(0, min(MAX_SLOTS, free // (kv_per_token * context))))
        if slots >= 8:
            break
    step_bytes = 2 * p + slots * kv_per_token * context / 2
    step_seconds = max(step_bytes / (width * system["hbm_bw"]), 2 * p * slots / (width * system["flops"]))
    decode = slots / step_seconds / width
    flops_per_token = 6 * p + 12 * model["layers"] * model["hidden"] * context
    learn = system["flops"] * MFU / flops_per_token
    return width, slots, decode, learn, step_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply", type=int, default=512)
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    generated = args.episodes * args.turns * args.reply
    trained = args.episodes * args.context
    print(f"\none iteration: {args.episodes} episodes x {args.turns} turns x {args.reply} generated tokens = "
          f"{generated / 1e6:.1f}M generated; {trained / 1e6:.1f}M learner tokens (rows of {args.context})\n")
    print("| model | system | chips per sampler | slots per sampler | decode tok/s/chip | learn tok/s/chip | "
          "best split (sample:learn chips) | sample / learn (s) | one episode's decode steps (s) | sync | "
          "sync time (s) | iteration (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, model in MODELS.items():
        for sname, system in SYSTEMS.items():
            width, slots, decode, learn, step_seconds = per_chip(model, system, args.context)
            n = system["chips"]
            # sample time = generated / (s * decode) equals learn time = trained / ((n - s) * learn) at:
            s = n * (generated / decode) / (generated / decode + trained / learn)
            samplers = max(width, min(n - width, width * round(s / width)))
            t_sample = generated / (samplers * decode)
            t_learn = trained / ((n - samplers) * learn)
            sync = 2 * model["params"]
            sync_seconds = sync / system["link"]
            # An episode's turns are sequential: its tokens take one decode step each, however many
            # chips there are (tool time left out).
            critical = args.turns * args.reply * step_seconds
            iteration = max(t_sample, t_learn, critical) + sync_seconds
            print(f"| {name} | {sname} | {width} | {slots} | {decode:,.0f} | {learn:,.0f} | {samplers}:{n - samplers} | "
                  f"{t_sample:.1f} / {t_learn:.1f} | {critical:.1f} | {sync / 1e9:.1f} GB over {system['link_name']} | "
                  f"{sync_seconds:.3f} | {iteration:.1f} |")


if __name__ == "__main__":
    main()
