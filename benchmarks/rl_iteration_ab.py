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


# The table's columns after round and variant: (heading, width, format), a run's medians by heading.
COLUMNS = (("iteration s", 12, ".3f"), ("sample s", 9, ".3f"), ("admit s", 8, ".3f"), ("decode s", 9, ".3f"),
           ("learn s", 8, ".3f"), ("run s", 7, ".0f"), ("gain", 6, ".1f"))
_MEDIAN_OF = {"sample s": "sample_seconds", "admit s": "sampler_admit_seconds",
              "decode s": "sampler_decode_seconds", "learn s": "learn_seconds"}


def run_medians(records: list[dict], skip: int) -> dict[str, float]:
    """One run's table row but its wall time ('run s'): the median iteration time and the medians
    of the `rl` records' sampling, admission, decode and learner seconds past the first `skip`
    iterations (NaN where a record lacks one), and the summary's gain in points (NaN without one)."""
    rl = [r for r in records if r["stage"] == "rl"][skip + 1:]
    summary = next((r for r in records if r["stage"] == "summary"), {})
    row = {"iteration s": float(np.median(iteration_seconds(records, skip)))}
    row.update({heading: float(np.median([r.get(key, np.nan) for r in rl])) for heading, key in _MEDIAN_OF.items()})
    row["gain"] = float(summary.get("gain_points", np.nan))
    return row


def round_order(variants: list, round_index: int) -> list:
    """The variants in the order round `round_index` (from 0) runs them: as given, reversed every
    other round."""
    return list(variants) if round_index % 2 == 0 else list(variants)[::-1]


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
        for label, tree, overrides in round_order(variants, round_index):
            with tempfile.TemporaryDirectory() as workdir:
                started = time.time()
                records = run_once(tree, overrides, args.iterations, workdir)
            row = {"round": round_index + 1, "variant": label, **run_medians(records, args.skip),
                   "run s": time.time() - started}
            results[label].append(row["iteration s"])
            rows.append(row)
            print(f"round {round_index + 1} {label}: median iteration {row['iteration s']:.3f} s", flush=True)
    print("\n" + f"{'round':>5} {'variant':>12} " + " ".join(f"{h:>{w}}" for h, w, _ in COLUMNS))
    for row in rows:
        print(f"{row['round']:>5} {row['variant']:>12} " + " ".join(f"{row[h]:>{w}{f}}" for h, w, f in COLUMNS))
    base = variants[0][0]
    print(f"\nmedian over rounds, and the ratio to {base!r} (per round, then median):")
    for label, _, _ in variants:
        ratios = [a / b for a, b in zip(results[label], results[base])]
        print(f"  {label:>12}: {np.median(results[label]):.3f} s/iteration, ratio {np.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
