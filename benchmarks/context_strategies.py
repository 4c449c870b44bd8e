"""Context strategies on the long-horizon `chain` environment, at equal RL wall time, one invocation.

  python benchmarks/context_strategies.py --workdir /tmp/context_strategies [--rl_minutes 4]
      [--sft_steps 200] [--sft_batch 64] [--strategies none,keep_recent,summarize] [--train_max_edits 3]

For each strategy (`rollout.context`): an SFT cold start on expert demonstrations edited by that
strategy (configs/chain_tiny.py: `rollout.max_context` = 160 tokens, so chains of 3+ reads outgrow
it), then RL from that checkpoint for the same wall time (`--rl_minutes`, the run's time budget
being its SFT time plus that), with at most `--train_max_edits` context edits per episode. Held-out
greedy success is the run's final evaluation on the training levels, with its standard error
(binomial, over all evaluated tasks).

The control, "its policy, context none": each managed strategy's trained policy deployed on the
training levels with no context management, which separates what the strategy does at run time
from what training with it taught.

Test-time scaling: each trained policy is then deployed (`agent.run_many`, the run's own episode
code) on held-out tasks of the training levels and of longer chains (`--scaling_levels`), once
with the training cap on edits and once with no cap: success as deployment allows more edits than
training did.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import launcher_runs
from launcher_runs import ROOT, records, sft_elapsed_seconds, standard_error

sys.path.insert(0, ROOT)


def deploy(workdir: str, levels: list[int], tasks: int, max_edits: int, context: str | None = None) -> dict[int, float]:
    """Greedy held-out success per level of the run's policy, deployed with `max_edits` (0 = no cap)
    and its own context strategy, or `context`."""
    from jaxrl_agent import agent, envs, evaluation, rollout

    out = {}
    with agent.load(workdir) as deployment:
        env = envs.make("chain")
        for level in levels:
            batch = [env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, level) for i in range(tasks)]
            results = agent.run_many(batch, deployment.sampler, lambda t: envs.make(t.env),
                                     tokenizer=deployment.tokenizer, template=deployment.template,
                                     settings=deployment.settings, max_edits=max_edits, context=context,
                                     seeds=[rollout.episode_seed(evaluation.EVAL_GREEDY_SEED, i, 0)
                                            for i in range(tasks)])
            out[level] = sum(r.success for r in results) / tasks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--strategies", default="none,keep_recent,summarize")
    parser.add_argument("--sft_steps", type=int, default=200)
    parser.add_argument("--sft_batch", type=int, default=0, help="Expert episodes per SFT update (0 = the config's).")
    parser.add_argument("--rl_minutes", type=float, default=4.0)
    parser.add_argument("--train_levels", default="1,2,3,4")
    parser.add_argument("--train_max_edits", type=int, default=3)
    parser.add_argument("--eval_tasks", type=int, default=32, help="Held-out tasks per level.")
    parser.add_argument("--scaling_levels", default="6,8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    levels = [int(x) for x in args.train_levels.split(",")]
    common = [f"--config.sft.steps={args.sft_steps}", *([f"--config.sft.batch_size={args.sft_batch}"] if args.sft_batch else []),
              f"--config.env.train_difficulties={args.train_levels}",
              f"--config.sft.difficulties={args.train_levels}",
              f"--config.env.eval_difficulties={args.train_levels}", f"--config.seed={args.seed}",
              f"--config.rollout.context_max_edits={args.train_max_edits}", "--config.metrics.tensorboard=False",
              f"--config.eval.tasks_per_difficulty={args.eval_tasks}", "--config.eval.every=0",
              "--config.metrics.progress=off"]
    rows = []
    for strategy in args.strategies.split(","):
        workdir = os.path.join(args.workdir, strategy)
        shutil.rmtree(workdir, ignore_errors=True)
        flags = [*common, f"--config.rollout.context={strategy}"]
        launcher_runs.launch(workdir, [*flags, "--config.rl.iterations=0"], config="chain_tiny")
        budget = sft_elapsed_seconds(workdir) / 60.0 + args.rl_minutes
        launcher_runs.launch(workdir, [*flags, "--config.resume=True", "--config.rl.iterations=100000",
                                       f"--config.rl.time_budget_minutes={budget:.3f}"], config="chain_tiny")
        rs = records(workdir)
        rl = [r for r in rs if r["stage"] == "rl"]
        after_sft = next(r for r in rs if r["stage"] == "sft_eval")["eval/success"]
        final = [r for r in rs if r["stage"] == "rl_eval"][-1]["eval/success"]
        n = args.eval_tasks * len(levels)
        row = {"strategy": strategy, "iterations": len(rl), "after_sft": after_sft, "final": final,
               "se": standard_error(final, n), "edits": sum(r.get("context/edits_per_episode", 0) for r in rl)
               / max(len(rl), 1), "longest": max((r.get("context/longest_sequence_max", 0) for r in rl), default=0),
               "summary_share": sum(r.get("context/summary_token_share", 0) for r in rl) / max(len(rl), 1),
               "rl_seconds": (rl[-1]["time"] - rl[0]["time"]) if len(rl) > 1 else 0.0}
        scaling = [int(x) for x in args.scaling_levels.split(",") if x]
        if strategy != "none" and scaling:
            row["capped"] = deploy(workdir, [levels[-1], *scaling], args.eval_tasks, args.train_max_edits)
            row["uncapped"] = deploy(workdir, [levels[-1], *scaling], args.eval_tasks, 0)
        if strategy != "none":  # the control: the same weights, deployed without context management
            unmanaged = deploy(workdir, levels, args.eval_tasks, 0, context="none")
            row["unmanaged"] = sum(unmanaged.values()) / len(unmanaged)
        rows.append(row)
        print(row, flush=True)

    base = next((r for r in rows if r["strategy"] == "none"), None)
    print(f"\nchain, levels {args.train_levels}, max_context 160, {args.rl_minutes:g} min of RL after "
          f"{args.sft_steps} SFT updates, at most {args.train_max_edits} edits per episode in training; "
          f"held-out greedy success over {args.eval_tasks} tasks per level\n")
    print("| strategy | RL iterations | after SFT | after RL | ± s.e. | vs none (in s.e.) | its policy, context none | "
          "edits / episode | longest sequence | summary token share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        margin = ""
        if base is not None and r is not base:
            se = math.sqrt(r["se"] ** 2 + base["se"] ** 2)
            margin = f"{(r['final'] - base['final']) / se:+.1f}" if se > 0 else "inf"
        unmanaged = f"{r['unmanaged']:.3f}" if "unmanaged" in r else ""
        print(f"| {r['strategy']} | {r['iterations']} | {r['after_sft']:.3f} | {r['final']:.3f} | {r['se']:.3f} | "
              f"{margin} | {unmanaged} | {r['edits']:.2f} | {r['longest']} | {r['summary_share']:.3f} |")
    scaled = [r for r in rows if "capped" in r]
    if scaled:
        lv = list(scaled[0]["capped"])
        print(f"\ntest-time scaling: deployed success per level, edits capped at {args.train_max_edits} (as in "
              f"training) / uncapped\n")
        print("| strategy | " + " | ".join(f"level {x}" for x in lv) + " |")
        print("|---|" + "---|" * len(lv))
        for r in scaled:
            print(f"| {r['strategy']} | " + " | ".join(f"{r['capped'][x]:.3f} / {r['uncapped'][x]:.3f}" for x in lv)
                  + " |")


if __name__ == "__main__":
    main()
