"""Forgetting across stages, with and without cross-stage distillation, one invocation.

  python benchmarks/forgetting.py --workdir /tmp/forgetting [--distill_coef 0.1] [--iterations 40]
      [--eval_tasks 32]
  python benchmarks/forgetting.py --workdir /tmp/forgetting --reevaluate_tasks 256
  python benchmarks/forgetting.py --workdir /tmp/forgetting2 --stages_from /tmp/forgetting --distill_coef 0.05


configs/stages_tiny.py (its stage list `sft,A,B`, read from the config): SFT on both environments'
demonstrations, RL on A's environment (calculator), then RL on B's (chain, with a quarter of
calculator tasks that `rl.distill_envs` trains by distillation alone). Stages SFT and A run once;
stage B then runs twice from A's final policy, with `rl.distill_coef` = `--distill_coef` (on-policy
distillation from A's policy, on the calculator tasks) and with 0 (the same tasks sampled, the
calculator ones not trained), for the same number of iterations. Each B's
final policy is evaluated (greedy, held-out, `--eval_tasks` tasks per level) on both environments:
forgetting is A's success falling from its value after stage A.

`--stages_from DIR` (a finished invocation with the same flags but `--distill_coef`) copies its SFT
and A stages and its plain B, and trains only the distilled B: another coefficient from the same A.
With the same `--distill_coef` its distilled B is copied too and nothing is trained before
`--b_seeds`' pairs.

`--b_seeds 1,2` adds, after that pair, one more pair of B's (distilled and plain) per listed seed, each
from the same A with stage B's own `seed` set to it (B's sampling and task stream; SFT and A
unchanged), in `distilled_b<seed>` / `plain_b<seed>`: B's outcome varies between runs, so the arms
are compared by the mean of the paired differences over all pairs and its standard error over pairs.

`--reevaluate_tasks N` trains nothing: it evaluates the policies a finished invocation left in
`--workdir` (after SFT, after A, both B's) again, on N held-out tasks per level (the first
`--eval_tasks` of them the same tasks), and prints the same table: a smaller standard error for the
same policies.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys

import launcher_runs
from launcher_runs import ROOT, records, standard_error

sys.path.insert(0, ROOT)


def stage_evals(workdir: str) -> dict[str, dict]:
    return {r["stage_name"]: r for r in records(workdir) if r["stage"] == "stage_eval"}


def stage_list() -> list[tuple[str, str, str]]:
    """[(stage name, its folder under the workdir, its environment)] of configs/stages_tiny.py: SFT, A, B."""
    from jaxrl_agent import config_lib, stages

    listed = stages.stage_configs(config_lib.load_config(os.path.join(ROOT, "configs", "stages_tiny.py")), "")
    if len(listed) != 3:
        raise SystemExit(f"configs/stages_tiny.py: stages {[n for n, _, _ in listed]}, expected 'sft,A,B'")
    return [(name, folder, config.env.name) for name, folder, config in listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--distill_coef", type=float, default=0.1)
    parser.add_argument("--iterations", type=int, default=40, help="RL iterations of each of stages A and B.")
    parser.add_argument("--sft_steps", type=int, default=200)
    parser.add_argument("--eval_tasks", type=int, default=32, help="Held-out tasks per level.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reevaluate_tasks", type=int, default=0,
                        help="Train nothing: evaluate a finished invocation's policies on this many tasks per level.")
    parser.add_argument("--stages_from", default="",
                        help="A finished invocation's workdir, run with the same flags but --distill_coef: "
                             "its SFT and A stages and its plain B (which does not depend on the coefficient) "
                             "are copied, and only the distilled B is trained.")
    parser.add_argument("--b_seeds", default="",
                        help="Seeds of further B pairs from the same A (comma-separated; stage B's seed alone).")
    parser.add_argument("--override", action="append", default=[],
                        help="A further --config.x.y=v for both lists (repeatable), e.g. "
                             "--override=--config.stage.chain.env.train_difficulties=4,5")
    args = parser.parse_args()
    (stage_sft, dir_sft, _), (stage_a, dir_a, _), (stage_b, dir_b, _) = stage_list()

    common = [f"--config.seed={args.seed}", f"--config.sft.steps={args.sft_steps}",
              f"--config.eval.tasks_per_difficulty={args.eval_tasks}", "--config.metrics.tensorboard=False",
              "--config.metrics.progress=off", "--config.eval.every=0",
              # Both B runs train exactly --iterations (the default config's wall-clock budget would
              # end the slower, distilled one first).
              "--config.rl.time_budget_minutes=0",
              f"--config.stage.{stage_a}.rl.iterations={args.iterations}",
              f"--config.stage.{stage_b}.rl.iterations={args.iterations}", *args.override]
    distilled = os.path.join(args.workdir, "distilled")
    plain = os.path.join(args.workdir, "plain")
    if args.reevaluate_tasks:
        evals = reevaluate(args.workdir, args.reevaluate_tasks)
        report(args, evals, args.reevaluate_tasks, None)
        return
    if args.stages_from and os.path.abspath(args.stages_from) == os.path.abspath(args.workdir):
        raise SystemExit("--stages_from: expected another invocation's workdir than --workdir")
    shutil.rmtree(args.workdir, ignore_errors=True)
    seconds = {}
    distill = [f"--config.stage.{stage_b}.rl.distill_coef={args.distill_coef}"]
    if args.stages_from:
        check_same_run(args, os.path.join(args.stages_from, "plain"), stage_a, stage_b)
        source = os.path.join(args.stages_from, "distilled")
        shutil.copytree(os.path.join(args.stages_from, "plain"), plain)
        if finished_with_coef(source, stage_b, dir_b, args.distill_coef):
            # The same coefficient: the earlier distilled B is this one (used with --b_seeds).
            shutil.copytree(source, distilled)
            seconds["distilled"] = 0.0
        else:
            copy_stages(source, distilled, (dir_sft, dir_a), stage_b)
            seconds["distilled"] = launcher_runs.launch(distilled, [*common, *distill, "--config.resume=True"],
                                                        config="stages_tiny")
    else:
        seconds["distilled"] = launcher_runs.launch(distilled, [*common, *distill], config="stages_tiny")
        # The same list without distillation: its SFT and A stages are the distilled list's (copied,
        # finished), so B starts from the same policy.
        copy_stages(distilled, plain, (dir_sft, dir_a), stage_b)
        seconds["plain"] = launcher_runs.launch(plain, [*common, f"--config.stage.{stage_b}.rl.distill_coef=0.0",
                                                        "--config.resume=True"], config="stages_tiny")

    evals = {"sft": stage_evals(distilled)[stage_sft], "a": stage_evals(distilled)[stage_a],
             "distilled": stage_evals(distilled)[stage_b], "plain": stage_evals(plain)[stage_b]}
    report(args, evals, args.eval_tasks, seconds)
    seeds = [int(s) for s in args.b_seeds.split(",") if s.strip()]
    if seeds:
        pairs = [(args.seed, evals["distilled"], evals["plain"])]
        for seed in seeds:
            pair = []
            for arm, coef in (("distilled", args.distill_coef), ("plain", 0.0)):
                target = os.path.join(args.workdir, f"{arm}_b{seed}")
                copy_stages(distilled, target, (dir_sft, dir_a), stage_b)
                launcher_runs.launch(target, [*common, f"--config.stage.{stage_b}.rl.distill_coef={coef}",
                                              f"--config.stage.{stage_b}.seed={seed}", "--config.resume=True"],
                                     config="stages_tiny")
                pair.append(stage_evals(target)[stage_b])
            pairs.append((seed, *pair))
        report_pairs(pairs, args.eval_tasks)


def report_pairs(pairs: list[tuple[int, dict, dict]], tasks: int) -> None:
    """Each B pair's held-out success on both environments, and the mean paired difference
    (distilled - plain) with its standard error over pairs."""
    (_, _, _), (_, _, env_a), (_, _, env_b) = stage_list()
    print(f"\nB pairs from the same A (stage B's seed), held-out greedy success, {tasks} tasks per level\n")
    print(f"| B seed | {env_a} distilled | {env_a} plain | {env_b} distilled | {env_b} plain |")
    print("|---|---|---|---|---|")
    for seed, with_d, without in pairs:
        print(f"| {seed} | {with_d[f'eval/{env_a}/success']:.3f} | {without[f'eval/{env_a}/success']:.3f} | "
              f"{with_d[f'eval/{env_b}/success']:.3f} | {without[f'eval/{env_b}/success']:.3f} |")
    for env in (env_a, env_b):
        diffs = [w[f"eval/{env}/success"] - p[f"eval/{env}/success"] for _, w, p in pairs]
        mean = statistics.fmean(diffs)
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        print(f"{env} success, distilled - plain, mean over {len(diffs)} pairs: {mean:+.3f} "
              f"(s.e. over pairs {se:.3f}" + (f", {mean / se:+.2f} s.e.)" if se > 0 else ")"))


def copy_stages(source: str, target: str, folders: tuple[str, ...], stage_b: str) -> None:
    """A stage list's finished `folders` (SFT and A), its config and its records but B's, from
    `source` into a new `target`: a list resumed there starts B from the same policy."""
    os.makedirs(target)
    for folder in folders:
        shutil.copytree(os.path.join(source, folder), os.path.join(target, folder))
    shutil.copy(os.path.join(source, "config.json"), os.path.join(target, "config.json"))
    with open(os.path.join(source, "metrics.jsonl")) as f, open(os.path.join(target, "metrics.jsonl"), "w") as out:
        out.writelines(line for line in f if f'"stage_name": "{stage_b}"' not in line)


def finished_with_coef(distilled: str, stage_b: str, dir_b: str, coef: float) -> bool:
    """Whether an earlier invocation's distilled list finished stage B at distillation coefficient `coef`."""
    from jaxrl_agent import config_lib

    if stage_b not in stage_evals(distilled):
        return False
    return config_lib.run_config(os.path.join(distilled, dir_b)).rl.distill_coef == coef


def check_same_run(args, plain: str, stage_a: str, stage_b: str) -> None:
    """--stages_from: the earlier invocation trained what this one's flags say (SFT updates,
    iterations, seed; B's learning rate when an override sets it), and its plain B finished."""
    from jaxrl_agent import config_lib

    ran = config_lib.run_config(plain)
    expected = {"sft.steps": (ran.sft.steps, args.sft_steps), "seed": (ran.seed, args.seed),
                "eval.tasks_per_difficulty": (ran.eval.tasks_per_difficulty, args.eval_tasks),
                f"stage.{stage_a}.rl.iterations": (ran.stage[stage_a].rl.iterations, args.iterations),
                f"stage.{stage_b}.rl.iterations": (ran.stage[stage_b].rl.iterations, args.iterations)}
    for flag in args.override:
        key, _, value = flag.removeprefix("--config.").partition("=")
        if key == f"stage.{stage_b}.rl.learning_rate":
            expected[key] = (ran.stage[stage_b].rl.learning_rate, float(value))
    launcher_runs.require_same_settings("--stages_from", plain, expected)
    if stage_b not in stage_evals(plain):
        raise SystemExit(f"--stages_from {plain}: its plain stage {stage_b} did not finish")


def reevaluate(workdir: str, tasks: int) -> dict[str, dict]:
    """The stage_eval results of a finished invocation's four policies, on `tasks` per level."""
    from jaxrl_agent import config_lib, stages

    out = {}
    for key, arm, index in (("sft", "distilled", 0), ("a", "distilled", 1), ("distilled", "distilled", 2),
                            ("plain", "plain", 2)):
        config = config_lib.run_config(os.path.join(workdir, arm))
        listed = stages.stage_configs(config, os.path.join(workdir, arm))
        levels = stages.environment_levels(listed)
        _, stage_dir, stage = listed[index]
        stage.eval.tasks_per_difficulty = tasks
        out[key] = stages.evaluate_stage(stage, stage_dir, levels)
        print(f"{key}: " + ", ".join(f"{k} {v:.3f}" for k, v in out[key].items() if k.endswith("success")), flush=True)
    return out


def report(args, evals: dict[str, dict], tasks: int, seconds: dict[str, float] | None) -> None:
    """The table: each policy's held-out success on A's and B's environments, with standard errors."""
    from jaxrl_agent import config_lib

    (_, _, _), (stage_a, _, env_a), (stage_b, dir_b, env_b) = stage_list()
    distilled = os.path.join(args.workdir, "distilled")
    ran = config_lib.run_config(distilled)  # what the invocation trained (also when re-evaluating it)
    ran_b = config_lib.run_config(os.path.join(distilled, dir_b))  # what its distilled B ran with
    plain = os.path.join(args.workdir, "plain")
    after_a = evals["a"]
    rows = [("after SFT", evals["sft"], None), (f"after stage A ({env_a} RL)", after_a, None)]
    for name, key, workdir in (("B with distillation", "distilled", distilled),
                               ("B without distillation", "plain", plain)):
        rows.append((name, evals[key], records(os.path.join(workdir, dir_b))))
    n_a = tasks * len([k for k in after_a if k.startswith(f"eval/{env_a}/pass@1/")])
    n_b = tasks * len([k for k in after_a if k.startswith(f"eval/{env_b}/pass@1/")])
    print(f"\nstages_tiny: SFT {ran.sft.steps} updates, then {ran.stage[stage_a].rl.iterations} RL iterations on "
          f"{env_a} (A), then {ran.stage[stage_b].rl.iterations} on {env_b} (B) with distill_coef "
          f"{ran_b.rl.distill_coef} or 0; held-out greedy success, {tasks} tasks per level\n")
    print(f"| policy | {env_a} success ± s.e. | {env_b} success ± s.e. | distill KL (last B iteration) |")
    print("|---|---|---|---|")
    for name, record, b_records in rows:
        success_a, success_b = record[f"eval/{env_a}/success"], record[f"eval/{env_b}/success"]
        kl = ""
        if b_records:
            last = [r for r in b_records if r["stage"] == "rl"][-1]
            kl = f"{last['distill/kl_k3']:.4f}" if "distill/kl_k3" in last else "(not computed)"
        print(f"| {name} | {success_a:.3f} ± {standard_error(success_a, n_a):.3f} | {success_b:.3f} ± "
              f"{standard_error(success_b, n_b):.3f} | {kl} |")
    for env, n in ((env_a, n_a), (env_b, n_b)):
        with_d, without = (rows[i][1][f"eval/{env}/success"] for i in (2, 3))
        d = with_d - without
        se = math.sqrt(standard_error(with_d, n) ** 2 + standard_error(without, n) ** 2)
        print(f"{env} success, distilled - plain: {d:+.3f}" + (f" ({d / se:+.2f} s.e.)" if se > 0 else ""))
    if seconds and not seconds["distilled"]:
        print("wall seconds: both B's from --stages_from (the same coefficient), nothing trained")
    elif seconds:
        plain_b = (f"plain B {seconds['plain']:.0f}" if "plain" in seconds
                   else "SFT, A and the plain B from --stages_from")
        print(f"wall seconds: distilled list {seconds['distilled']:.0f}, {plain_b}")


if __name__ == "__main__":
    main()
