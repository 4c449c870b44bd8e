"""Forgetting across stages, with and without cross-stage distillation, one invocation.

  python benchmarks/forgetting.py --workdir /tmp/forgetting [--distill_coef 0.1] [--iterations 40]
      [--eval_tasks 32]

configs/stages_tiny.py: SFT on calculator and kb_search demonstrations, RL on calculator (stage
A), then RL on kb_search (stage B). Stages SFT and A run once; stage B then runs twice from A's
final policy, with `rl.distill_coef` = `--distill_coef` (on-policy distillation from A's policy)
and with 0, for the same number of iterations. Each B's final policy is evaluated (greedy,
held-out, `--eval_tasks` tasks per level) on calculator (A's levels) and kb_search: forgetting is
A's success falling from its value after stage A.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import launcher_runs
from launcher_runs import ROOT, records, standard_error

sys.path.insert(0, ROOT)


def stage_evals(workdir: str) -> dict[str, dict]:
    return {r["stage_name"]: r for r in records(workdir) if r["stage"] == "stage_eval"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--distill_coef", type=float, default=0.1)
    parser.add_argument("--iterations", type=int, default=40, help="RL iterations of each of stages A and B.")
    parser.add_argument("--sft_steps", type=int, default=200)
    parser.add_argument("--eval_tasks", type=int, default=32, help="Held-out tasks per level.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    common = [f"--config.seed={args.seed}", f"--config.sft.steps={args.sft_steps}",
              f"--config.eval.tasks_per_difficulty={args.eval_tasks}", "--config.metrics.tensorboard=False",
              "--config.metrics.progress=off", "--config.eval.every=0",
              f"--config.stage.calculator.rl.iterations={args.iterations}",
              f"--config.stage.kb_search.rl.iterations={args.iterations}"]
    distilled = os.path.join(args.workdir, "distilled")
    plain = os.path.join(args.workdir, "plain")
    shutil.rmtree(args.workdir, ignore_errors=True)
    seconds = {}
    seconds["distilled"] = launcher_runs.launch(distilled, [*common, f"--config.stage.kb_search.rl.distill_coef="
                                                                      f"{args.distill_coef}"], config="stages_tiny")
    # The same list without distillation: its SFT and A stages are the distilled list's (copied,
    # finished), so B starts from the same policy.
    os.makedirs(os.path.join(plain, "stages"))
    for name in ("0_sft", "1_calculator"):
        shutil.copytree(os.path.join(distilled, "stages", name), os.path.join(plain, "stages", name))
    shutil.copy(os.path.join(distilled, "config.json"), os.path.join(plain, "config.json"))
    with open(os.path.join(distilled, "metrics.jsonl")) as f, open(os.path.join(plain, "metrics.jsonl"), "w") as out:
        out.writelines(line for line in f if '"stage_name": "kb_search"' not in line)
    seconds["plain"] = launcher_runs.launch(plain, [*common, "--config.stage.kb_search.rl.distill_coef=0.0",
                                                    "--config.resume=True"], config="stages_tiny")

    after_a = stage_evals(distilled)["calculator"]
    rows = [("after stage A (calculator RL)", after_a, None)]
    for name, workdir in (("B with distillation", distilled), ("B without distillation", plain)):
        b = stage_evals(workdir)["kb_search"]
        b_records = records(os.path.join(workdir, "stages", "2_kb_search"))
        rows.append((name, b, b_records))
    n_calc = args.eval_tasks * len([k for k in after_a if k.startswith("eval/calculator/pass@1/")])
    n_kb = args.eval_tasks * len([k for k in after_a if k.startswith("eval/kb_search/pass@1/")])
    print(f"\nstages_tiny: SFT {args.sft_steps} updates, then {args.iterations} RL iterations on calculator (A), "
          f"then {args.iterations} on kb_search (B) with distill_coef {args.distill_coef} or 0; held-out greedy "
          f"success, {args.eval_tasks} tasks per level\n")
    print("| policy | calculator success ± s.e. | kb_search success ± s.e. | distill KL (last B iteration) |")
    print("|---|---|---|---|")
    for name, record, b_records in rows:
        calc, kb = record["eval/calculator/success"], record["eval/kb_search/success"]
        kl = ""
        if b_records:
            last = [r for r in b_records if r["stage"] == "rl"][-1]
            kl = f"{last['distill/kl_k3']:.4f}" if "distill/kl_k3" in last else "(not computed)"
        print(f"| {name} | {calc:.3f} ± {standard_error(calc, n_calc):.3f} | {kb:.3f} ± "
              f"{standard_error(kb, n_kb):.3f} | {kl} |")
    d = rows[1][1]["eval/calculator/success"] - rows[2][1]["eval/calculator/success"]
    se = math.sqrt(standard_error(rows[1][1]["eval/calculator/success"], n_calc) ** 2
                   + standard_error(rows[2][1]["eval/calculator/success"], n_calc) ** 2)
    print(f"\ncalculator success, distilled - plain: {d:+.3f} ({d / se:+.1f} s.e.)" if se > 0 else
          f"\ncalculator success, distilled - plain: {d:+.3f}")
    print(f"wall seconds: distilled list {seconds['distilled']:.0f}, plain B {seconds['plain']:.0f}")


if __name__ == "__main__":
    main()
