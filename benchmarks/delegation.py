"""Delegation to frozen sub-agents against inline-only, at equal RL wall time and context, one invocation.

  python benchmarks/delegation.py --workdir /tmp/delegation [--sft_steps N (the config's)] [--rl_minutes 4]
      [--eval_tasks 32] [--levels 1,2,3] [--rl_mixture chain_sum:1] [--subagent_sft_steps N (0)]
      [--delegate_share 1.0] [--sft_from DIR] [--rl_override=--config.x.y=v ...]

configs/chain_sum_tiny.py (composite `chain_sum` tasks: the sum of two or three chains' values;
`rollout.max_context` = 240 tokens, which an inline episode outgrows past level 1). Two arms, each
an SFT cold start on its own expert demonstrations (the same mixture with `chain`, the same number
of updates), then RL from that checkpoint for the same wall time (`--rl_minutes`: the run's time
budget is its SFT time plus that):
  * delegate: `rollout.delegate='initial'` — the SFT policy, frozen, is every sub-agent; RL trains
    the orchestrator only. With `--subagent_sft_steps N` the sub-agents are a separate checkpoint
    instead: first a run of N SFT updates on `chain` alone (the levels' reads per chain), exported
    as a Hugging Face folder (`launch/export_hf.py`) and named by `rollout.delegate=<folder>`, so
    the orchestrator's own SFT can stop short of its sub-agents' ceiling. With `--delegate_share s`
    only that share of its demonstrations delegate and the rest are inline (`sft.delegate_share`),
    so the SFT policy has not settled when to delegate and RL learns it;
  * inline: `rollout.delegate=''` — no `delegate` tool, inline demonstrations.
RL trains on chain_sum alone (`--rl_mixture`): the chain skill the sub-agents use is SFT's, frozen,
and chain tasks in RL would train only the orchestrator's own chain reading, which no chain_sum
episode uses (in the second attempt they were half of every RL batch).
The reward is correctness only in both. Held-out greedy success on chain_sum is each run's own
evaluation after SFT and at the end (`eval/chain_sum/success`, with its binomial standard error over
the evaluated tasks). The trained policies are then deployed (`agent.run_many`, the run's episode
code, with its sub-agents) on the same held-out chain_sum tasks: delegations per episode,
sub-agent success, the critical path (the longest chain of dependent turns: a delegating turn
counts its longest sub-agent) and total turns (every sub-agent's included), per level.

Each arm's folder after SFT is kept as `<workdir>/<arm>_sft`; `--sft_from DIR` starts each arm's RL
from DIR's (and reuses DIR's sub-agent run), so that RL settings (`--rl_override`, e.g. the
sampling temperature) can be compared from the same SFT policies.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys

import launcher_runs
from launcher_runs import ROOT, records, sft_elapsed_seconds, standard_error

sys.path.insert(0, ROOT)


def deploy(workdir: str, levels: list[int], tasks: int) -> dict[int, dict[str, float]]:
    """Per level: greedy held-out success and the delegation numbers of the run's final policy."""
    from jaxrl_agent import agent, envs, evaluation, rollout
    from jaxrl_agent.rollout import delegation

    out = {}
    with agent.load(workdir) as deployment:
        env = envs.make("chain_sum")
        for level in levels:
            batch = [env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, level) for i in range(tasks)]
            results = agent.run_many(batch, deployment.sampler, lambda t: envs.make(t.env),
                                     tokenizer=deployment.tokenizer, template=deployment.template,
                                     settings=deployment.settings,
                                     seeds=[rollout.episode_seed(evaluation.EVAL_GREEDY_SEED, i, 0)
                                            for i in range(tasks)])
            subs = [d for r in results for d in delegation.all_delegations(r.trajectory.turns)]
            out[level] = {
                "success": sum(r.success for r in results) / tasks,
                "delegations": len(subs) / tasks,
                "subagent_success": sum(d["success"] for d in subs) / len(subs) if subs else float("nan"),
                "critical_path": sum(delegation.critical_path_turns(r.trajectory.turns) for r in results) / tasks,
                "total_turns": sum(delegation.total_turns(r.trajectory.turns) for r in results) / tasks,
                "context_limit": sum(r.trajectory.finish_reason == "context_limit" for r in results) / tasks}
    return out


def train_subagent(workdir: str, levels: list[int], args) -> dict:
    """The sub-agents' own checkpoint: `--subagent_sft_steps` SFT updates on `chain` alone, at the
    reads per chain of `levels` (the sub-tasks `chain_sum.subtask` makes), exported to
    `<workdir>/hf`. Returns the folder and its held-out greedy chain success (the run's sft_eval).
    A finished sub-agent run of the same updates, seed, levels and evaluation in `workdir` (a stopped
    invocation's) is reused, and says so."""
    from jaxrl_agent import config_lib
    from jaxrl_agent.envs import chain_sum

    hops = ",".join(str(h) for h in sorted({chain_sum.LEVELS[level][1] for level in levels}))
    folder = os.path.join(workdir, "hf")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):  # a stopped invocation's, if it is this one's
        ran = config_lib.run_config(workdir)
        if (ran.sft.steps, ran.seed, ran.env.train_difficulties, ran.eval.tasks_per_difficulty) == \
                (args.subagent_sft_steps, args.seed, hops, args.eval_tasks):
            return subagent_record(workdir, folder, hops, args.eval_tasks, reused=True)
    shutil.rmtree(workdir, ignore_errors=True)
    launcher_runs.launch(workdir, [f"--config.sft.steps={args.subagent_sft_steps}", "--config.env.name=chain",
                                   "--config.env.mixture=chain:1", f"--config.env.train_difficulties={hops}",
                                   f"--config.sft.difficulties={hops}", f"--config.env.eval_difficulties={hops}",
                                   f"--config.seed={args.seed}", "--config.rollout.delegate=",
                                   f"--config.eval.tasks_per_difficulty={args.eval_tasks}", "--config.eval.every=0",
                                   "--config.metrics.tensorboard=False", "--config.metrics.progress=off",
                                   "--config.rl.iterations=0"], config="chain_sum_tiny")
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "export_hf.py"), f"--workdir={workdir}",
                    f"--out={folder}"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return subagent_record(workdir, folder, hops, args.eval_tasks, reused=False)


def copy_sft(source: str, workdir: str, args) -> None:
    """An earlier invocation's SFT folder of an arm (`<arm>_sft`) as this arm's `workdir`, after
    checking that it ran this invocation's SFT flags."""
    from jaxrl_agent import config_lib

    ran = config_lib.run_config(source)
    expected = {"sft.steps": (ran.sft.steps, args.sft_steps), "seed": (ran.seed, args.seed),
                "env.train_difficulties": (ran.env.train_difficulties, args.levels),
                "eval.tasks_per_difficulty": (ran.eval.tasks_per_difficulty, args.eval_tasks)}
    if ran.rollout.delegate:
        expected["sft.delegate_share"] = (ran.sft.delegate_share, args.delegate_share)
    launcher_runs.require_same_settings("--sft_from", source, expected)
    if not any(r["stage"] == "sft_eval" for r in records(source)):
        raise SystemExit(f"--sft_from {source}: its SFT did not finish")
    shutil.copytree(source, workdir)


def subagent_record(workdir: str, folder: str, hops: str, eval_tasks: int, *, reused: bool) -> dict:
    """The sub-agent run's exported folder and its held-out greedy chain success (its sft_eval
    record), with the binomial standard error over `eval_tasks` per level."""
    evaluated = next(r for r in records(workdir) if r["stage"] == "sft_eval")
    n = eval_tasks * len(hops.split(","))
    return {"folder": folder, "levels": hops, "success": evaluated["eval/success"], "reused": reused,
            "se": standard_error(evaluated["eval/success"], n),
            "per_level": {k: v for k, v in evaluated.items() if "/pass@1/d" in k}}


def chain_sum_success(record: dict) -> float:
    """An evaluation record's held-out chain_sum success: its own key when the run evaluated
    several environments (SFT's mixture with chain), `eval/success` when chain_sum was the only one
    (RL on `--rl_mixture chain_sum:1`)."""
    if "eval/chain_sum/success" in record:
        return record["eval/chain_sum/success"]
    others = [k for k in record if k.startswith("eval/") and k.endswith("/success") and k != "eval/success"]
    if others:
        raise KeyError(f"no eval/chain_sum/success among {others}")
    return record["eval/success"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--arms", default="delegate,inline")
    parser.add_argument("--sft_steps", type=int, default=None, help="SFT updates (default: the config's).")
    parser.add_argument("--rl_minutes", type=float, default=4.0)
    parser.add_argument("--levels", default="1,2,3")
    parser.add_argument("--eval_tasks", type=int, default=32, help="Held-out tasks per level.")
    parser.add_argument("--rl_mixture", default="chain_sum:1",
                        help="RL's env.mixture (SFT keeps the config's, with chain: the skill the frozen "
                             "sub-agents bring); '' = the config's.")
    parser.add_argument("--subagent_sft_steps", type=int, default=0,
                        help="0: the delegate arm's sub-agents are its own SFT policy ('initial'); N > 0: a "
                             "separate checkpoint of N SFT updates on chain alone, exported.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delegate_share", type=float, default=1.0,
                        help="The delegate arm's sft.delegate_share: the share of its demonstrations that "
                             "delegate (the rest inline), so that RL decides when to delegate.")
    parser.add_argument("--sft_from", default="",
                        help="An earlier invocation's workdir with the same SFT flags: each arm starts RL from "
                             "its <arm>_sft folder (the SFT checkpoint) instead of training SFT again.")
    parser.add_argument("--rl_override", action="append", default=[],
                        help="A further --config.x.y=v for both arms' RL phase (repeatable), e.g. "
                             "--rl_override=--config.rollout.temperature=0.7")
    args = parser.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    if args.sft_steps is None:
        from jaxrl_agent import config_lib

        args.sft_steps = config_lib.load_config(os.path.join(ROOT, "configs", "chain_sum_tiny.py")).sft.steps
    common = [f"--config.sft.steps={args.sft_steps}", f"--config.env.train_difficulties={args.levels}",
              f"--config.sft.difficulties={args.levels}",
              f"--config.env.eval_difficulties={args.levels}", f"--config.seed={args.seed}",
              f"--config.eval.tasks_per_difficulty={args.eval_tasks}", "--config.eval.every=0",
              "--config.metrics.tensorboard=False", "--config.metrics.progress=off"]
    delegate = {"delegate": "initial", "inline": ""}
    subagent = None
    if args.subagent_sft_steps > 0:
        source = os.path.join(args.sft_from, "subagent")
        if args.sft_from and os.path.isdir(source) and not os.path.isdir(os.path.join(args.workdir, "subagent")):
            shutil.copytree(source, os.path.join(args.workdir, "subagent"))  # reused below if its flags match
        subagent = train_subagent(os.path.join(args.workdir, "subagent"), levels, args)
        delegate["delegate"] = subagent["folder"]
        print(subagent, flush=True)
    rows = []
    for arm in args.arms.split(","):
        workdir = os.path.join(args.workdir, arm)
        shutil.rmtree(workdir, ignore_errors=True)
        flags = [*common, f"--config.rollout.delegate={delegate[arm]}"]
        if arm == "delegate":
            flags.append(f"--config.sft.delegate_share={args.delegate_share}")
        if args.sft_from:
            copy_sft(os.path.join(args.sft_from, f"{arm}_sft"), workdir, args)
        else:
            launcher_runs.launch(workdir, [*flags, "--config.rl.iterations=0"], config="chain_sum_tiny")
            # The SFT checkpoint and records, kept for --sft_from (RL's checkpoints replace them).
            shutil.rmtree(f"{workdir}_sft", ignore_errors=True)
            shutil.copytree(workdir, f"{workdir}_sft")
        budget = sft_elapsed_seconds(workdir) / 60.0 + args.rl_minutes
        rl_flags = [f"--config.env.mixture={args.rl_mixture}"] if args.rl_mixture else []
        rl_flags += args.rl_override
        launcher_runs.launch(workdir, [*flags, *rl_flags, "--config.resume=True", "--config.rl.iterations=100000",
                                       f"--config.rl.time_budget_minutes={budget:.3f}"], config="chain_sum_tiny")
        rs = records(workdir)
        rl = [r for r in rs if r["stage"] == "rl"]
        # delegation/per_episode counts every trained episode; per chain_sum episode it is this over
        # the share of chain_sum episodes (1 with the default --rl_mixture).
        after_sft = chain_sum_success(next(r for r in rs if r["stage"] == "sft_eval"))
        final = chain_sum_success([r for r in rs if r["stage"] == "rl_eval"][-1])
        n = args.eval_tasks * len(levels)
        row = {"arm": arm, "iterations": len(rl), "after_sft": after_sft, "final": final,
               "se_sft": standard_error(after_sft, n), "se": standard_error(final, n),
               "train_delegations": sum(r.get("delegation/per_episode", 0.0) for r in rl) / max(len(rl), 1),
               "deployed": deploy(workdir, levels, args.eval_tasks)}
        rows.append(row)
        print(row, flush=True)

    share = f" (the delegate arm's {args.delegate_share:g} delegating)" if args.delegate_share != 1 else ""
    print(f"\nchain_sum, levels {args.levels}, max_context 240, {args.sft_steps} SFT updates{share} then "
          f"{args.rl_minutes:g} min of RL{' with ' + ' '.join(args.rl_override) if args.rl_override else ''}; "
          f"held-out greedy success over {args.eval_tasks} tasks per level"
          f"{'; SFT from ' + args.sft_from if args.sft_from else ''}\n")
    if subagent is not None:
        print(f"sub-agents: a separate checkpoint{' (reused)' if subagent['reused'] else ''}, "
              f"{args.subagent_sft_steps} SFT updates on chain levels {subagent['levels']}: held-out greedy "
              f"chain success {subagent['success']:.3f} (± {subagent['se']:.3f}); per level {subagent['per_level']}\n")
    print("| arm | RL iterations | after SFT | after RL | ± s.e. | RL gain (in s.e.) | delegations / episode in RL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        se = math.sqrt(r["se"] ** 2 + r["se_sft"] ** 2)
        gain = f"{(r['final'] - r['after_sft']) / se:+.1f}" if se > 0 else "n/a"
        print(f"| {r['arm']} | {r['iterations']} | {r['after_sft']:.3f} | {r['final']:.3f} | {r['se']:.3f} | {gain} | "
              f"{r['train_delegations']:.2f} |")
    print("\ndeployed (the final policy; per level: success, delegations per episode, sub-agent success, "
          "critical-path turns / total turns, ended at the context limit)\n")
    print("| arm | level | success | delegations | sub-agent success | critical path / total turns | context limit |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for level, d in r["deployed"].items():
            print(f"| {r['arm']} | {level} | {d['success']:.3f} | {d['delegations']:.2f} | {d['subagent_success']:.3f} | "
                  f"{d['critical_path']:.2f} / {d['total_turns']:.2f} | {d['context_limit']:.3f} |")


if __name__ == "__main__":
    main()
