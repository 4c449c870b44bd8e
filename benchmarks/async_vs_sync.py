"""Asynchronous (windowed FIFO + partial rollouts) against synchronous RL, on slow heavy-tailed tools.

  python benchmarks/async_vs_sync.py --workdir /tmp/async_vs_sync [--sft_steps 200]
      [--trained_tokens 30000] [--tool_latency_s 0.1] [--tool_latency_alpha 1.2] [--seeds 0,1]

One SFT cold start is trained once; every schedule then runs RL from that same checkpoint (the
launcher with `--config.resume=True`) on the calculator at mixed difficulty, with every tool call
waiting a Pareto-distributed time (median `tool_latency_s`, capped at 10 s), until it has trained
`trained_tokens` tokens. Printed: RL wall time, its ratio to sync, held-out success at the end, and
the mean learner idle time (waiting for rollouts) and sampler idle time per iteration.

`--seeds 0,1` runs every schedule once per RL seed (`config.seed`: the task stream and the sampler's
draws; the SFT checkpoint is the same), schedules alternating within each seed, and adds a table
per schedule: mean RL wall time and its speed-up over sync's mean, mean held-out success with its
standard error, and the difference to sync's in standard errors. A schedule's standard error is
the larger of the spread over seeds (s.d. / sqrt(seeds)) and the evaluation's binomial one over
all its tasks; the difference's combines the two schedules' in quadrature.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics

import launcher_runs
from launcher_runs import records, standard_error

VARIANTS = {
    "sync": [],
    "windowed_fifo + partial": ["--config.rollout.schedule=windowed_fifo", "--config.rollout.window=128",
                                "--config.rollout.token_budget=64"],
    # The same with decoupled PPO's correction (Hilton et al. 2022; AReaL): the regulariser and trust
    # region around the iteration's starting policy, recomputed by the learner, instead of around the
    # (up to 4 versions stale) sampling policy, which is weighted by pi_prox / pi_sampler (capped).
    "windowed_fifo + partial + decoupled": ["--config.rollout.schedule=windowed_fifo", "--config.rollout.window=128",
                                            "--config.rollout.token_budget=64", "--config.rl.correction=decoupled"],
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
    parser.add_argument("--seeds", default="0", help="RL seeds, comma-separated: each schedule runs once per seed.")
    args = parser.parse_args()
    names = launcher_runs.chosen("--variants", args.variants, VARIANTS)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

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
    for seed in seeds:
        for name in names:
            slug = name.replace(" ", "_").replace("+", "").replace("(", "").replace(")", "").replace("=", "")
            workdir = os.path.join(args.workdir, slug if seed == 0 and len(seeds) == 1 else f"{slug}_s{seed}")
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.copytree(os.path.join(sft_dir, "checkpoints"), os.path.join(workdir, "checkpoints"))
            launch(workdir, common + [f"--config.seed={seed}"] + VARIANTS[name])
            rows.append(run_row(workdir, name, seed))
            print(rows[-1], flush=True)
    base = next((r for r in rows if r["schedule"] == "sync"), rows[0])
    print(f"\ntool latency: median {args.tool_latency_s} s, Pareto alpha {args.tool_latency_alpha}; "
          f"target {args.trained_tokens} trained tokens\n")
    print("| schedule | seed | iterations | trained tokens | RL wall time (s) | speed-up vs sync | held-out success | "
          "learner wait / iter (s) | sampler idle / iter (s) | max policy lag |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same_seed = next((b for b in rows if b["schedule"] == base["schedule"] and b["seed"] == r["seed"]), base)
        print(f"| {r['schedule']} | {r['seed']} | {r['iterations']} | {r['trained_tokens']} | {r['rl_wall_s']:.0f} | "
              f"{same_seed['rl_wall_s'] / r['rl_wall_s']:.2f}x | {r['success']:.3f} | {r['learner_idle_s']:.1f} | "
              f"{r['sampler_idle_s']:.1f} | {r['lag_max']} |")
    if len(seeds) > 1:
        print(f"\nOver seeds {seeds} (speed-up: sync's mean RL wall time over the schedule's)\n")
        print("| schedule | seeds | mean RL wall time (s) | speed-up vs sync | mean held-out success | s.e. | "
              "vs sync (in s.e.) |")
        print("|---|---|---|---|---|---|---|")
        for r in summarize(rows, baseline=base["schedule"]):
            print(f"| {r['schedule']} | {r['seeds']} | {r['rl_wall_s']:.0f} | {r['speedup']:.2f}x | {r['success']:.3f} | "
                  f"{r['se']:.3f} | {r['diff']:+.3f} ({r['diff_in_se']:+.2f}) |")


def run_row(workdir: str, name: str, seed: int) -> dict:
    """One schedule's run from its records: iterations, trained tokens, RL wall time, final held-out
    success and its task count, and per-iteration waits."""
    from jaxrl_agent import config_lib

    rs = records(workdir)
    start = next(r for r in rs if r["stage"] == "resume")["time"]
    rl = [r for r in rs if r["stage"] == "rl"]
    final = [r for r in rs if r["stage"] == "rl_eval"][-1]
    levels = sum(1 for k in final if "/pass@1/d" in k)
    return {
        "schedule": name, "seed": seed, "iterations": len(rl), "trained_tokens": rl[-1]["trained_tokens_total"],
        "rl_wall_s": rl[-1]["time"] - start, "success": final["eval/success"],
        "eval_tasks": levels * config_lib.run_config(workdir).eval.tasks_per_difficulty,
        "learner_idle_s": sum(r["sample_seconds"] for r in rl) / len(rl),
        "sampler_idle_s": sum(r["sampler_idle_seconds"] for r in rl) / len(rl),
        "lag_max": max(r["policy_lag_max"] for r in rl),
    }


def summarize(rows: list[dict], baseline: str = "sync") -> list[dict]:
    """Per schedule over its seeds: mean RL wall time, speed-up (baseline's mean wall time / this
    one's), mean success and its standard error — max(s.d. over seeds / sqrt(seeds), binomial
    s.e. of the mean over seeds x eval_tasks tasks) — and the difference to the baseline's mean
    success, also in units of sqrt(se² + se_baseline²)."""
    by_schedule: dict[str, list[dict]] = {}
    for r in rows:
        by_schedule.setdefault(r["schedule"], []).append(r)
    out = []
    for name, runs in by_schedule.items():
        success = statistics.fmean(r["success"] for r in runs)
        spread = statistics.stdev(r["success"] for r in runs) / math.sqrt(len(runs)) if len(runs) > 1 else 0.0
        binomial = standard_error(success, sum(r["eval_tasks"] for r in runs))
        out.append({"schedule": name, "seeds": len(runs), "rl_wall_s": statistics.fmean(r["rl_wall_s"] for r in runs),
                    "success": success, "se": max(spread, binomial)})
    base = next(r for r in out if r["schedule"] == baseline)
    for r in out:
        r["speedup"] = base["rl_wall_s"] / r["rl_wall_s"]
        r["diff"] = r["success"] - base["success"]
        se = math.hypot(r["se"], base["se"])
        r["diff_in_se"] = r["diff"] / se if se > 0 else 0.0
    return out


if __name__ == "__main__":
    main()
