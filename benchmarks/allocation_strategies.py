"""Rollout allocation strategies at an equal rollout budget: learning-signal density and success.

  python benchmarks/allocation_strategies.py --workdir /tmp/allocation [--sft_steps 200]
      [--iterations 30] [--task_pool 256] [--strategies uniform,variance,knapsack,until_mixed]
      [--eval_tasks 64]

One SFT cold start is trained once; every strategy then runs the same number of synchronous RL
iterations from that checkpoint (the launcher with `--config.resume=True`), each iteration spending
the same budget of prompts_per_iteration x group_size rollouts on a fixed pool of `task_pool`
mixed-difficulty training tasks (d1-d3) that is revisited. `uniform` draws tasks uniformly from the
pool; `variance` and `knapsack` choose among twice as many candidates by their success posteriors;
`until_mixed` samples rounds of G/2 rollouts per task until its outcomes differ (Reinforce-Ada).
Printed: mean share of groups with non-zero advantage (and its ratio to uniform), mean trained
trajectories per iteration, and held-out success at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics

import launcher_runs
from launcher_runs import records


def launch(workdir: str, flags: list[str]) -> float:
    return launcher_runs.launch(workdir, ["--config.metrics.tensorboard=False", *flags])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--sft_steps", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--task_pool", type=int, default=256)
    parser.add_argument("--strategies", default="uniform,variance,knapsack,until_mixed")
    parser.add_argument("--eval_tasks", type=int, default=64, help="held-out tasks per difficulty")
    args = parser.parse_args()

    sft_dir = os.path.join(args.workdir, "sft")
    if not os.path.exists(os.path.join(sft_dir, "checkpoints")):
        seconds = launch(sft_dir, [f"--config.sft.steps={args.sft_steps}", "--config.rl.iterations=0"])
        print(f"SFT cold start: {seconds:.0f} s", flush=True)
    common = [f"--config.sft.steps={args.sft_steps}", "--config.resume=True",
              f"--config.rl.iterations={args.iterations}", f"--config.eval.every={args.iterations}",
              f"--config.allocation.task_pool={args.task_pool}",
              f"--config.eval.tasks_per_difficulty={args.eval_tasks}"]
    rows = []
    for strategy in args.strategies.split(","):
        workdir = os.path.join(args.workdir, strategy)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(os.path.join(sft_dir, "checkpoints"), os.path.join(workdir, "checkpoints"))
        seconds = launch(workdir, common + [f"--config.allocation.strategy={strategy}"])
        rs = records(workdir)
        rl = [r for r in rs if r["stage"] == "rl"]
        final = [r for r in rs if r["stage"] == "rl_eval"][-1]
        rows.append({
            "strategy": strategy, "iterations": len(rl), "rollouts": sum(r["rollouts"] for r in rl),
            "nonzero_share": statistics.mean(r["nonzero_advantage_group_share"] for r in rl),
            "nonzero_share_last10": statistics.mean(r["nonzero_advantage_group_share"] for r in rl[-10:]),
            "trained": statistics.mean(r["trained_trajectories"] for r in rl),
            "train_success": statistics.mean(r["success"] for r in rl),
            "success": final["eval/success"],
            "per_level": {k.split("/")[-1]: v for k, v in final.items() if k.startswith("eval/pass@1/")},
            "wall_s": seconds,
        })
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["strategy"] == "uniform"), rows[0])
    print(f"\n{args.iterations} sync iterations from one {args.sft_steps}-update SFT checkpoint; pool of "
          f"{args.task_pool} training tasks (d1-d3)\n")
    print("| strategy | rollouts | non-zero-advantage group share (mean) | vs uniform | last 10 iterations | "
          "trained trajectories / iteration | training success | held-out success | per level | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        levels = " ".join(f"{k} {v:.3f}" for k, v in sorted(r["per_level"].items()))
        print(f"| {r['strategy']} | {r['rollouts']} | {r['nonzero_share']:.3f} | "
              f"{r['nonzero_share'] / base['nonzero_share']:.2f}x | {r['nonzero_share_last10']:.3f} | "
              f"{r['trained']:.0f} | {r['train_success']:.3f} | {r['success']:.3f} | {levels} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
