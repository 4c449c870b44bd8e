"""A run pushed toward collapse, with the invariants' responses off and on (issue 21).

The default run (configs/calculator_tiny.py) with its RL learning rate multiplied by `--lr_scale`
(5x by default: the learning notes saw 6e-4, 3x, collapse). SFT runs once; every variant resumes
RL from that same checkpoint (a copy of the workdir), so all variants start from identical weights
and the same task stream. RL runs a fixed number of iterations with no time budget and held-out
evaluation every `--eval_every`, so host load changes wall time but not the curves.

Each variant is `label:key=value,key=value` (config overrides on top of the pushed run); the
default pair is responses off (`invariants.respond=False`) and on. Prints, per window of
iterations, each variant's lowest sampled-token entropy (`invariants/exploration/entropy_min`)
and the entropy bonus the exploration response set, then each held-out evaluation, then a summary:
iterations with entropy below `invariants.entropy_floor`, the last window's entropy, final
held-out success and its gain over SFT. `--out` writes every curve as JSON.

  python benchmarks/invariants_collapse.py --iterations 120
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LR = 2e-4  # configs/calculator_tiny.py's rl.learning_rate
ENTROPY = "invariants/exploration/entropy_min"


def launch(workdir: str, overrides: list[str], log_path: str) -> float:
    started = time.perf_counter()
    command = [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), "--config",
               os.path.join(ROOT, "configs", "calculator_tiny.py"), f"--config.workdir={workdir}",
               "--config.metrics.tensorboard=False", *[f"--config.{o}" for o in overrides]]
    with open(log_path, "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"{command} failed (rc {done.returncode}):\n{f.read()[-3000:]}")
    return time.perf_counter() - started


def records(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def curves(recs: list[dict]) -> dict:
    rl = [r for r in recs if r.get("stage") == "rl"]
    evals = [r for r in recs if r.get("stage") in ("sft_eval", "rl_eval")]
    return {
        "iteration": [r["step"] for r in rl],
        "entropy_min": [r.get(ENTROPY, float("nan")) for r in rl],
        "entropy_bonus": [r.get("controls/entropy_coef", 0.0) for r in rl],
        "signal": [r.get("nonzero_advantage_group_share", float("nan")) for r in rl],
        "success": [r.get("success", float("nan")) for r in rl],
        "alarms": [sorted(k.split("/")[-1] for k, v in r.items() if k.startswith("invariants/alarm/") and v)
                   for r in rl],
        "eval_iteration": [0 if r["stage"] == "sft_eval" else r["step"] for r in evals],
        "eval_success": [r["eval/success"] for r in evals],
        "responses": [(r["step"], r["invariant"], r["event"]) for r in recs if r.get("stage") == "response"],
        "alarm_events": [(r["step"], r["alarm"], r["event"]) for r in recs if r.get("stage") == "alarm"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", help="label:key=value,... (default: off and on)")
    parser.add_argument("--lr_scale", type=float, default=5.0)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--window", type=int, default=10, help="Iterations per row of the entropy table.")
    parser.add_argument("--jobs", type=int, default=1, help="Variants run at once (1: one after another).")
    parser.add_argument("--entropy_floor", type=float, default=0.01, help="As invariants.entropy_floor.")
    parser.add_argument("--out", default=None, help="Write the curves as JSON here.")
    parser.add_argument("--base", action="append", default=[], help="key=value for every launch (SFT too).")
    args = parser.parse_args(argv)
    specs = args.variant or ["off:invariants.respond=False", "on:invariants.respond=True"]
    variants = [(s.split(":", 1)[0], [o for o in (s.split(":", 1)[1].split(",") if ":" in s else []) if o])
                for s in specs]
    pushed = [f"rl.learning_rate={DEFAULT_LR * args.lr_scale:g}", f"rl.iterations={args.iterations}",
              "rl.time_budget_minutes=0", f"eval.every={args.eval_every}", "checkpoint.every=0",
              f"invariants.entropy_floor={args.entropy_floor:g}"]
    scratch = tempfile.mkdtemp(prefix="invariants_collapse_")
    try:
        sft_dir = os.path.join(scratch, "sft")
        seconds = launch(sft_dir, [*args.base, "rl.iterations=0"], os.path.join(scratch, "sft.log"))
        print(f"SFT (shared by every variant): {seconds:.0f} s; RL lr {DEFAULT_LR * args.lr_scale:g} "
              f"({args.lr_scale:g}x), {args.iterations} iterations", flush=True)

        def run(variant):
            label, overrides = variant
            workdir = os.path.join(scratch, label)
            shutil.copytree(sft_dir, workdir)
            seconds = launch(workdir, [*args.base, *pushed, *overrides, "resume=True"], os.path.join(scratch, f"{label}.log"))
            print(f"{label}: {seconds:.0f} s", flush=True)
            return label, curves(records(workdir)), seconds

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            results = list(pool.map(run, variants))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    labels = [label for label, _, _ in results]
    by_label = {label: c for label, c, _ in results}

    print(f"\nlowest sampled-token entropy (nats) per {args.window} iterations: window mean [min]; "
          f"entropy bonus at the window's end")
    print(f"{'iterations':>11} " + " ".join(f"{label + ' entropy':>22} {label + ' bonus':>9}" for label in labels))
    for start in range(0, args.iterations, args.window):
        cells = []
        for label in labels:
            c = by_label[label]
            window = [(e, b) for i, e, b in zip(c["iteration"], c["entropy_min"], c["entropy_bonus"])
                      if start < i <= start + args.window]
            ent = np.array([e for e, _ in window], dtype=float)
            cells.append(f"{np.nanmean(ent):>13.4f} [{np.nanmin(ent):.4f}] {window[-1][1]:>9.3f}" if window
                         else f"{'':>22} {'':>9}")
        print(f"{start + 1:>5}-{start + args.window:<5} " + " ".join(cells))

    print("\nheld-out success (greedy pass@1)")
    print(f"{'iteration':>9} " + " ".join(f"{label:>8}" for label in labels))
    for k, iteration in enumerate(by_label[labels[0]]["eval_iteration"]):
        print(f"{iteration:>9} " + " ".join(
            f"{by_label[label]['eval_success'][k]:>8.3f}" if k < len(by_label[label]["eval_success"]) else f"{'':>8}"
            for label in labels))

    print(f"\n{'variant':>8} {'iters < floor':>13} {'last-window entropy':>19} {'min entropy':>11} "
          f"{'final success':>13} {'gain':>6} {'responses':>9} {'RL s':>6}")
    summary = {}
    for label, c, seconds in results:
        ent = np.array(c["entropy_min"], dtype=float)
        below = int(np.sum(ent < args.entropy_floor))
        last = float(np.nanmean(ent[-args.window:]))
        gain = 100.0 * (c["eval_success"][-1] - c["eval_success"][0])
        summary[label] = {"iterations_below_floor": below, "last_window_entropy": last,
                          "min_entropy": float(np.nanmin(ent)), "final_success": c["eval_success"][-1],
                          "gain_points": gain, "response_events": len(c["responses"]), "rl_seconds": seconds}
        print(f"{label:>8} {below:>13} {last:>19.4f} {np.nanmin(ent):>11.4f} {c['eval_success'][-1]:>13.3f} "
              f"{gain:>+6.1f} {len(c['responses']):>9} {seconds:>6.0f}")
    for label, c, _ in results:
        if c["alarm_events"] or c["responses"]:
            print(f"{label} alarms: {c['alarm_events']}\n{label} responses: {c['responses']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "curves": by_label, "summary": summary}, f)


if __name__ == "__main__":
    main()
