"""RL iteration time, A/B: the default run under several variants, alternated in rounds.

Each variant is `label:tree[:key=value,key=value]` — a source tree (this checkout `.`, or another
commit's worktree) and config overrides. Every run is the README's default command with
`rl.iterations=N`, no time budget and evaluation only at the ends, launched in a subprocess from
its tree (PYTHONPATH=tree, so that tree's package is imported); variants alternate within each
round, and every other round runs them in reverse order (A B, B A, ...), so that drift of the
host's speed hits all of them alike (in one order, the second of two identical variants ran ~5%
slower, learner time included). The iteration time is the wall time between consecutive `rl`
records (everything an iteration does); the first `--skip` iterations (compilation) are left out.
The table also gives the medians of the sampler's admission (prefill / extend) and decode seconds.

  git worktree add /tmp/base <commit>
  python benchmarks/rl_iteration_ab.py --variant base:/tmp/base --variant new:. --rounds 2
  python benchmarks/rl_iteration_ab.py --variant inprocess:. --variant pool:.:env.service=pool
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np


def run_once(tree: str, overrides: list[str], iterations: int, workdir: str) -> list[dict]:
    tree = os.path.abspath(tree)
    command = [sys.executable, os.path.join(tree, "launch", "tpu_run.py"), "--config",
               os.path.join(tree, "configs", "calculator_tiny.py"), f"--config.workdir={workdir}",
               f"--config.rl.iterations={iterations}", "--config.rl.time_budget_minutes=0", "--config.eval.every=0",
               "--config.metrics.tensorboard=False", *[f"--config.{o}" for o in overrides]]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines() if line]


def iteration_seconds(records: list[dict], skip: int) -> np.ndarray:
    times = [r["time"] for r in records if r["stage"] == "rl"]
    return np.diff(times)[skip:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, help="label:tree[:key=value,...]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--skip", type=int, default=2, help="Iteration intervals left out (compilation).")
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variant:
        label, tree, *rest = spec.split(":", 2)
        variants.append((label, tree, [o for o in (rest[0].split(",") if rest else []) if o]))
    results: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    rows = []
    for round_index in range(args.rounds):
        for label, tree, overrides in (variants if round_index % 2 == 0 else variants[::-1]):
            with tempfile.TemporaryDirectory() as workdir:
                started = time.time()
                records = run_once(tree, overrides, args.iterations, workdir)
            seconds = iteration_seconds(records, args.skip)
            rl = [r for r in records if r["stage"] == "rl"][args.skip + 1:]
            summary = next((r for r in records if r["stage"] == "summary"), {})
            results[label].append(float(np.median(seconds)))
            rows.append((round_index + 1, label, float(np.median(seconds)),
                         float(np.median([r["sample_seconds"] for r in rl])),
                         float(np.median([r["learn_seconds"] for r in rl])), time.time() - started,
                         summary.get("gain_points", float("nan")),
                         float(np.median([r.get("sampler_admit_seconds", np.nan) for r in rl])),
                         float(np.median([r.get("sampler_decode_seconds", np.nan) for r in rl]))))
            print(f"round {round_index + 1} {label}: median iteration {rows[-1][2]:.3f} s", flush=True)
    print(f"\n{'round':>5} {'variant':>12} {'iteration s':>12} {'sample s':>9} {'admit s':>8} {'decode s':>9} "
          f"{'learn s':>8} {'run s':>7} {'gain':>6}")
    for row in rows:
        print(f"{row[0]:>5} {row[1]:>12} {row[2]:>12.3f} {row[3]:>9.3f} {row[7]:>8.3f} {row[8]:>9.3f} {row[4]:>8.3f} "
              f"{row[5]:>7.0f} {row[6]:>6.1f}")
    base = variants[0][0]
    print(f"\nmedian over rounds, and the ratio to {base!r} (per round, then median):")
    for label, _, _ in variants:
        ratios = [a / b for a, b in zip(results[label], results[base])]
        print(f"  {label:>12}: {np.median(results[label]):.3f} s/iteration, ratio {np.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
