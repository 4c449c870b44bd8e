"""Time to quality: RL settings compared by held-out success against RL wall time, from one SFT policy.

  python benchmarks/time_to_quality.py --workdir /tmp/ttq [--arms default,windowed_fifo+decoupled,prompts_32]
      [--seeds 0,1] [--rl_minutes 3.5] [--eval_every 10] [--eval_tasks 128] [--points 10]

The default config's SFT cold start is trained once (`<workdir>/sft`, reused when present); every
arm then runs the default config's RL from that policy (`checkpoint.init_from`, no SFT) with its
own flags for `--rl_minutes` of wall time (`rl.time_budget_minutes`), evaluating greedy pass@1 on
`--eval_tasks` held-out tasks per level every `--eval_every` iterations (arms whose iterations are
shorter evaluate at the same spacing in samples: `prompts_32` every 2x as many iterations). Arms
alternate within each seed (`config.seed`: the task stream and the sampler's draws).

What is compared is learning per second of RL: each evaluation is placed at the RL wall time before
it, evaluations excluded (`rl_curve`). Printed per run: iterations, the median iteration, the
held-out success at the last evaluation by each of `--at` seconds, and the RL seconds at which
success first reached the start's + `--points` points; then per arm, the means over seeds.
An evaluation's binomial standard error is ~2.5 points at 3 x 128 tasks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics

import launcher_runs
from launcher_runs import records

# name -> (flags, evaluation spacing in iterations relative to the default's)
ARMS = {
    "default": ([], 1.0),
    # Sampling and learning overlap (MiniMax's windowed FIFO), with decoupled PPO's correction for
    # the stale rollouts (benchmarks/async_vs_sync.py).
    "windowed_fifo+decoupled": (["--config.rollout.schedule=windowed_fifo", "--config.rollout.window=128",
                                 "--config.rl.correction=decoupled"], 1.0),
    # Half the tasks per iteration: twice the updates per sample.
    "prompts_32": (["--config.rollout.prompts_per_iteration=32"], 2.0),
    "temperature_1.3": (["--config.rollout.temperature=1.3"], 1.0),
    "minibatches_4": (["--config.rl.minibatches=4"], 1.0),
    # One update per iteration on the whole batch: the learner's time halves.
    "minibatches_1": (["--config.rl.minibatches=1"], 1.0),
    "lr_3e-4": (["--config.rl.learning_rate=3e-4"], 1.0),
    "lr_4e-4": (["--config.rl.learning_rate=4e-4"], 1.0),
    # Rollout allocation over a revisited pool of 2,048 training tasks (issue 7's strategies: the
    # groups go to the tasks whose success posteriors promise mixed outcomes), and the pool alone.
    "knapsack": (["--config.allocation.strategy=knapsack", "--config.allocation.task_pool=2048"], 1.0),
    "variance": (["--config.allocation.strategy=variance", "--config.allocation.task_pool=2048"], 1.0),
    "pool_2048": (["--config.allocation.task_pool=2048"], 1.0),
    # Advantages and objectives (docs/losses.md).
    "advantage_grpo": (["--config.rl.advantage=grpo"], 1.0),
    "advantage_rloo": (["--config.rl.advantage=rloo"], 1.0),
    "objective_ppo": (["--config.rl.objective=ppo"], 1.0),
    "objective_cispo": (["--config.rl.objective=cispo"], 1.0),
    # A weaker mirror-descent regulariser: the policy may move further from the sampler's per update.
    "tau_0.01": (["--config.rl.tau=0.01"], 1.0),
    # Eight episodes per task on half the tasks (the same 256 episodes an iteration): more groups
    # with mixed outcomes and a baseline over eight; fewer distinct tasks.
    "group_8": (["--config.rollout.group_size=8", "--config.rollout.prompts_per_iteration=32"], 1.0),
    # DAPO's dynamic sampling: each iteration submits ceil(64 / the running non-zero share) groups
    # (up to 4x), so the learner sees ~64 groups with signal; longer iterations, evaluated every 5.
    "dynamic_sampling": (["--config.allocation.dynamic_sampling=True"], 0.5),
    # Negative advantages scaled by w (losses.weight_negative_advantages; the default config's 0.25):
    # 1 = the estimator's own, 0 = only the successes above their group's mean.
    **{f"negative_{w}": ([f"--config.rl.negative_advantage_weight={w}"], 1.0) for w in ("1", "0.5", "0.1", "0")},
}


def rl_curve(rs: list[dict]) -> tuple[float, list[tuple[int, float, float]]]:
    """(the start's held-out success, [(iteration, RL seconds, success)] per RL evaluation).

    RL seconds: the wall time of the RL iterations before the evaluation — the gaps between
    consecutive records, less each evaluation's own (an `rl_eval` record's gap is its evaluation;
    the first iteration's gap is counted from the initial evaluation's record)."""
    first = next(i for i, r in enumerate(rs) if r["stage"] in ("initial_eval", "sft_eval"))
    start = rs[first]
    previous, seconds, curve = start["time"], 0.0, []
    for r in rs[first + 1:]:
        if r["stage"] == "rl":
            seconds += r["time"] - previous
            previous = r["time"]
        elif r["stage"] == "rl_eval":
            previous = r["time"]
            curve.append((int(r["step"]), seconds, float(r["eval/success"])))
    return float(start["eval/success"]), curve


def success_by(curve: list[tuple[int, float, float]], seconds: float) -> float | None:
    """Held-out success at the last evaluation by `seconds` of RL (None before the first)."""
    seen = [s for _, t, s in curve if t <= seconds]
    return seen[-1] if seen else None


def first_reaching(curve: list[tuple[int, float, float]], threshold: float) -> tuple[int, float] | None:
    """(iteration, RL seconds) of the first evaluation with success >= threshold; None if none."""
    return next(((i, t) for i, t, s in curve if s >= threshold - 1e-9), None)


def run_row(rs: list[dict], arm: str, seed: int, at: list[float], points: float) -> dict:
    start, curve = rl_curve(rs)
    rl = [r for r in rs if r["stage"] == "rl"]
    gaps = [b["time"] - a["time"] for a, b in zip(rl, rl[1:])]
    reached = first_reaching(curve, start + points / 100)
    return {"arm": arm, "seed": seed, "start": start, "iterations": len(rl),
            "median_iteration_s": statistics.median(gaps) if gaps else float("nan"),
            "rl_seconds": curve[-1][1] if curve else 0.0, "final": curve[-1][2] if curve else start,
            "at": {t: success_by(curve, t) for t in at}, "reached": reached}


def summarize(rows: list[dict], at: list[float]) -> list[dict]:
    """Per arm over its seeds: mean median iteration, mean success by each `at` (over the seeds
    that had evaluated by then), and the RL seconds to the threshold: mean over the seeds that
    reached it, with how many did."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r for r in rows if r["arm"] == arm]
        by = {}
        for t in at:
            seen = [r["at"][t] for r in runs if r["at"][t] is not None]
            by[t] = statistics.fmean(seen) if seen else None
        reached = [r["reached"][1] for r in runs if r["reached"] is not None]
        out.append({"arm": arm, "seeds": len(runs),
                    "median_iteration_s": statistics.fmean(r["median_iteration_s"] for r in runs),
                    "at": by, "reached": len(reached),
                    "seconds_to_points": statistics.fmean(reached) if reached else None})
    return out


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--arms", default="default,windowed_fifo+decoupled,prompts_32")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rl_minutes", type=float, default=3.5, help="wall budget of each RL run (start-up included)")
    parser.add_argument("--eval_every", type=int, default=10, help="the default arm's evaluation spacing, in iterations")
    parser.add_argument("--eval_tasks", type=int, default=128, help="held-out tasks per level")
    parser.add_argument("--points", type=float, default=10.0, help="the gain over the start that is timed")
    parser.add_argument("--at", default="60,120,150", help="RL seconds at which success is compared")
    args = parser.parse_args()
    arms = launcher_runs.chosen("--arms", args.arms, ARMS)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    at = [float(t) for t in args.at.split(",") if t.strip()]
    common = ["--config.metrics.tensorboard=False", f"--config.eval.tasks_per_difficulty={args.eval_tasks}"]

    sft_dir = os.path.join(args.workdir, "sft")
    if not os.path.exists(os.path.join(sft_dir, "checkpoints")):
        seconds = launcher_runs.launch(sft_dir, common + ["--config.rl.iterations=0"])
        print(f"SFT cold start: {seconds:.0f} s", flush=True)
    rows = []
    for seed in seeds:
        for arm in arms:
            flags, spacing = ARMS[arm]
            workdir = os.path.join(args.workdir, f"{arm}_s{seed}")
            shutil.rmtree(workdir, ignore_errors=True)
            launcher_runs.launch(workdir, common + [
                f"--config.checkpoint.init_from={sft_dir}", "--config.sft.steps=0", "--config.checkpoint.every=0",
                f"--config.rl.time_budget_minutes={args.rl_minutes}", f"--config.seed={seed}",
                f"--config.eval.every={max(1, round(args.eval_every * spacing))}", *flags])
            rows.append(run_row(records(workdir), arm, seed, at, args.points))
            print(rows[-1], flush=True)

    print(f"\nRL wall budget {args.rl_minutes} min per run; held-out success on {args.eval_tasks} tasks per level; "
          f"'+{args.points:g}': RL seconds to the start's success + {args.points:g} points\n")
    heads = " | ".join(f"success by {t:g} s" for t in at)
    print(f"| arm | seed | iterations | median iteration (s) | {heads} | final (at RL s) | +{args.points:g} at |")
    print("|---" * (6 + len(at)) + "|")
    for r in rows:
        cells = " | ".join(_fmt(r["at"][t]) for t in at)
        reached = "not reached" if r["reached"] is None else f"{r['reached'][1]:.0f} s (iteration {r['reached'][0]})"
        print(f"| {r['arm']} | {r['seed']} | {r['iterations']} | {r['median_iteration_s']:.2f} | {cells} | "
              f"{r['final']:.3f} ({r['rl_seconds']:.0f}) | {reached} |")
    print(f"\n| arm | seeds | median iteration (s) | {heads} | reached +{args.points:g} | mean RL s to it |")
    print("|---" * (5 + len(at)) + "|")
    for r in summarize(rows, at):
        cells = " | ".join(_fmt(r["at"][t]) for t in at)
        print(f"| {r['arm']} | {r['seeds']} | {r['median_iteration_s']:.2f} | {cells} | {r['reached']}/{r['seeds']} | "
              f"{_fmt(r['seconds_to_points'], '.0f')} |")


if __name__ == "__main__":
    main()
