"""Asynchronous (windowed FIFO + partial rollouts) against synchronous RL, on slow heavy-tailed tools.

  python benchmarks/async_vs_sync.py --workdir /tmp/async_vs_sync [--sft_steps 200]
      [--trained_tokens 30000] [--tool_latency_s 0.1] [--tool_latency_alpha 1.2]

One SFT cold start is trained once; every schedule then runs RL from that same checkpoint (the
launcher with `--config.resume=True`) on the calculator at mixed difficulty, with every tool call
waiting a Pareto-distributed time (median `tool_latency_s`, capped at 10 s), until it has trained
`trained_tokens` tokens. Printed: RL wall time, its ratio to sync, held-out success at the end, and
the mean learner idle time (waiting for rollouts) and sampler idle time per iteration.
"""

from __future__ import annotations

import argparse
import os
import shutil

import launcher_runs
from launcher_runs import records

VARIANTS = {
    "sync": [],
    "windowed_fifo + partial": ["--config.rollout.schedule=windowed_fifo", "--config.rollout.window=128",
                                "--config.rollout.token_budget=64"],
    "async (S=2) + partial": ["--config.rollout.schedule=async", "--config.rollout.max_staleness=2",
                              "--config.rollout.token_budget=64"],
    # The staleness bound's two knobs: a looser bound, or stale tokens kept with zero loss weight
    # (masked) instead of their episodes dropped.
    "async (S=3) + partial": ["--config.rollout.schedule=async", "--config.rollout.max_staleness=3",
                              "--config.rollout.token_budget=64"],
    "async (S=2) masked + partial": ["--config.rollout.schedule=async", "--config.rollout.max_staleness=2",
                                    "--config.rollout.stale_policy=mask", "--config.rollout.token_budget=64"],
    # More groups open at once (P + 192 = 4P instead of 2P): more episodes to decode while others sleep in tools.
    "async (S=3) + partial + 4P open": ["--config.rollout.schedule=async", "--config.rollout.max_staleness=3",
                                        "--config.rollout.token_budget=64", "--config.rollout.groups_in_flight=192"],
}


def launch(workdir: str, flags: list[str]) -> float:
    return launcher_runs.launch(workdir, ["--config.metrics.tensorboard=False", *flags])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--sft_steps", type=int, default=200)
    parser.add_argument("--trained_tokens", type=int, default=30000)
    parser.add_argument("--tool_latency_s", type=float, default=0.1)
    parser.add_argument("--tool_latency_alpha", type=float, default=1.2)
    parser.add_argument("--variants", default=",".join(list(VARIANTS)[:3]))
    args = parser.parse_args()

    sft_dir = os.path.join(args.workdir, "sft")
    if not os.path.exists(os.path.join(sft_dir, "checkpoints")):
        seconds = launch(sft_dir, [f"--config.sft.steps={args.sft_steps}", "--config.rl.iterations=0"])
        print(f"SFT cold start: {seconds:.0f} s", flush=True)
    # Every schedule runs until the same number of trained tokens: no wall-clock budget.
    common = [f"--config.sft.steps={args.sft_steps}", "--config.resume=True", "--config.rl.iterations=100000",
              f"--config.rl.stop_after_trained_tokens={args.trained_tokens}", "--config.eval.every=100000",
              "--config.rl.time_budget_minutes=0",
              "--config.env.service=inprocess",  # the simulated latency wraps in-process environments
              f"--config.env.tool_latency_s={args.tool_latency_s}",
              f"--config.env.tool_latency_alpha={args.tool_latency_alpha}"]
    rows = []
    for name in args.variants.split(","):
        workdir = os.path.join(args.workdir, name.replace(" ", "_").replace("+", "").replace("(", "")
                               .replace(")", "").replace("=", ""))
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(os.path.join(sft_dir, "checkpoints"), os.path.join(workdir, "checkpoints"))
        launch(workdir, common + VARIANTS[name])
        rs = records(workdir)
        start = next(r for r in rs if r["stage"] == "resume")["time"]
        rl = [r for r in rs if r["stage"] == "rl"]
        final = [r for r in rs if r["stage"] == "rl_eval"][-1]
        rows.append({
            "schedule": name, "iterations": len(rl), "trained_tokens": rl[-1]["trained_tokens_total"],
            "rl_wall_s": rl[-1]["time"] - start, "success": final["eval/success"],
            "learner_idle_s": sum(r["sample_seconds"] for r in rl) / len(rl),
            "sampler_idle_s": sum(r["sampler_idle_seconds"] for r in rl) / len(rl),
            "lag_max": max(r["policy_lag_max"] for r in rl),
        })
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["schedule"] == "sync"), rows[0])
    print(f"\ntool latency: median {args.tool_latency_s} s, Pareto alpha {args.tool_latency_alpha}; "
          f"target {args.trained_tokens} trained tokens\n")
    print("| schedule | iterations | trained tokens | RL wall time (s) | speed-up vs sync | held-out success | "
          "learner wait / iter (s) | sampler idle / iter (s) | max policy lag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['iterations']} | {r['trained_tokens']} | {r['rl_wall_s']:.0f} | "
              f"{base['rl_wall_s'] / r['rl_wall_s']:.2f}x | {r['success']:.3f} | {r['learner_idle_s']:.1f} | "
              f"{r['sampler_idle_s']:.1f} | {r['lag_max']} |")


if __name__ == "__main__":
    main()
