"""SFT + RL against SFT only at equal total wall time, per difficulty, in one invocation.

  python benchmarks/sft_vs_rl.py --workdir /tmp/sft_vs_rl [--flags "--config.x=y ..."]

1. Runs the launcher's default job (plus `--flags`): SFT cold start, then RL.
2. Measures that run's wall time and its SFT stage's seconds per update, then runs the same config
   with RL switched off (`rl.iterations=0`) and SFT extended to fill the same wall time.
3. Prints held-out greedy pass@1 per difficulty for: after the cold start, SFT + RL at the end,
   SFT only at the end.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil

import launcher_runs
from launcher_runs import records


def launch(workdir: str, flags: list[str]) -> float:
    shutil.rmtree(workdir, ignore_errors=True)
    return launcher_runs.launch(workdir, flags)


def levels(record: dict) -> dict[str, float]:
    return {k.split("/")[-1]: v for k, v in record.items() if k.startswith("eval/pass@1/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--flags", default="", help="extra launcher flags for both runs")
    args = parser.parse_args()
    flags = shlex.split(args.flags)

    rl_dir = os.path.join(args.workdir, "sft_rl")
    rl_seconds = launch(rl_dir, flags)
    rs = records(rl_dir)
    sft = [r for r in rs if r["stage"] == "sft"]
    sft_eval = next(r for r in rs if r["stage"] == "sft_eval")
    final_rl = [r for r in rs if r["stage"] == "rl_eval"][-1]
    # Seconds per SFT update, from the logged SFT records (the first includes compilation). The
    # SFT-only run shares start-up and the first logged updates, then trains until the SFT + RL run
    # ended, less one final evaluation (timed by the evaluation after the cold start).
    per_update = (sft[-1]["time"] - sft[0]["time"]) / (sft[-1]["step"] - sft[0]["step"])
    eval_seconds = sft_eval["time"] - sft[-1]["time"]
    steps = sft[0]["step"] + int((rs[-1]["time"] - sft[0]["time"] - eval_seconds) / per_update)
    print(f"SFT + RL: {rl_seconds:.0f} s; SFT at {per_update:.3f} s/update -> SFT only gets {steps} updates",
          flush=True)

    sft_dir = os.path.join(args.workdir, "sft_only")
    sft_seconds = launch(sft_dir, flags + ["--config.rl.iterations=0", f"--config.sft.steps={steps}"])
    final_sft = next(r for r in records(sft_dir) if r["stage"] == "sft_eval")

    rows = [("after the cold start", sft_eval, None), ("SFT + RL (end)", final_rl, rl_seconds),
            (f"SFT only, {steps} updates (end)", final_sft, sft_seconds)]
    names = sorted(levels(sft_eval))
    print("\n| held-out greedy pass@1 | " + " | ".join(names) + " | eval/success | wall time |")
    print("|---|" + "---|" * (len(names) + 2))
    for name, record, seconds in rows:
        cells = " | ".join(f"{levels(record)[n]:.3f}" for n in names)
        wall = f"{seconds / 60:.1f} min" if seconds else ""
        print(f"| {name} | {cells} | {record['eval/success']:.3f} | {wall} |")
    diff = {n: levels(final_rl)[n] - levels(final_sft)[n] for n in names}
    print("\nSFT + RL minus SFT only: " + ", ".join(f"{n} {v:+.3f}" for n, v in diff.items()))


if __name__ == "__main__":
    main()
