"""Several processes on this machine against one: the default run as 1 process and as N processes
of one `jax.distributed` job (`launch/local_cluster.py`), in the same invocation, one after the
other (never together: they would share the cores).

  python benchmarks/process_scaling.py --workdir /tmp/scaling [-n 2] [-- --config.x=y ...]
  python benchmarks/process_scaling.py --report /tmp/scaling/one /tmp/scaling/two   # tables only

Reported per run, from its metrics.jsonl: wall time, RL iterations, rollouts and trained tokens per
second for the job and per process, the median RL iteration, SFT and RL time, held-out success
after SFT and at the end, the gain in points and the gain per minute of wall time; then the N-process
run's ratios to the 1-process one. On a host with fewer cores than processes need, the processes
share the cores: the ratios then show the cost of the job's coordination (collectives, the
per-process sampler and learner), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_agent.metrics.records import summarize  # noqa: E402


def run(workdir: str, processes: int, extra: list[str]) -> float:
    args = ["--config", os.path.join(ROOT, "configs", "calculator_tiny.py"), f"--config.workdir={workdir}", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    if processes == 1:
        command = [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), *args]
    else:
        command = [sys.executable, os.path.join(ROOT, "launch", "local_cluster.py"), f"-n={processes}", "--", *args]
    started = time.monotonic()
    with open(os.path.join(os.path.dirname(workdir.rstrip("/")), os.path.basename(workdir) + ".log"), "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return time.monotonic() - started


def measure(workdir: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    start = next(r for r in records if r["stage"] == "start")
    rl = [r for r in records if r["stage"] == "rl"]
    sft = [r for r in records if r["stage"] == "sft"]
    first, last = records[0]["time"], records[-1]["time"]
    rl_seconds = sum(r.get("sample_seconds", 0) + r.get("learn_seconds", 0) for r in rl)
    summary = summarize(records)
    processes = int(start.get("processes", 1))
    wall = last - first
    rollouts = sum(r["rollouts"] for r in rl)
    trained = sum(r["trained_tokens"] for r in rl)
    return {"processes": processes, "wall_min": wall / 60, "sft_s": sft[-1]["seconds"] if sft else 0.0,
            "rl_iterations": len(rl), "rl_s": rl_seconds,
            "median_iteration_s": statistics.median(r["sample_seconds"] + r["learn_seconds"] for r in rl),
            "rollouts_per_s": rollouts / rl_seconds, "rollouts_per_s_per_process": rollouts / rl_seconds / processes,
            "trained_tok_per_s": trained / rl_seconds, "trained_tok_per_s_per_process": trained / rl_seconds / processes,
            "after_sft": 100 * summary.get("after_sft/success", 0.0), "final": 100 * summary.get("final/success", 0.0),
            "gain_points": summary.get("gain_points", 0.0), "gain_per_min": summary.get("gain_points", 0.0) / (wall / 60)}


COLUMNS = ["processes", "wall_min", "sft_s", "rl_iterations", "rl_s", "median_iteration_s", "rollouts_per_s",
           "rollouts_per_s_per_process", "trained_tok_per_s", "trained_tok_per_s_per_process", "after_sft", "final",
           "gain_points", "gain_per_min"]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS)
                     + " |")
    base = rows[0]
    for row in rows[1:]:
        ratios = {c: row[c] / base[c] for c in ("wall_min", "median_iteration_s", "rollouts_per_s",
                                                 "rollouts_per_s_per_process", "trained_tok_per_s",
                                                 "trained_tok_per_s_per_process", "gain_per_min") if base[c]}
        lines.append("")
        lines.append(f"{row['processes']} processes / 1: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/process_scaling")
    parser.add_argument("-n", type=int, default=2, help="processes of the second run")
    parser.add_argument("--report", nargs="+", help="workdirs of finished runs: print their table only")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.report:
        print(table([measure(w) for w in args.report]))
        return
    os.makedirs(args.workdir, exist_ok=True)
    workdirs = [os.path.join(args.workdir, "one"), os.path.join(args.workdir, f"n{args.n}")]
    for workdir, processes in zip(workdirs, (1, args.n)):
        seconds = run(workdir, processes, extra)
        print(f"{processes} process(es): {seconds / 60:.1f} min", flush=True)
    print(table([measure(w) for w in workdirs]))


if __name__ == "__main__":
    main()
