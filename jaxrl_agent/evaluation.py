"""Held-out evaluation on the rollout path: the same episode coroutine (`rollout.collect_groups`
-> `run_episode`), the same environment launch (`make_env`) and the same per-episode seed scheme
(`rollout.episode_seed`) as training, on held-out task seeds (`envs.HELD_OUT_SEED_OFFSET + i`).

Per environment and level: greedy pass@1 and, with `pass_k > 1`, k samples per task at the
training temperature for unbiased sampled pass@1 and pass@k. `eval/success` — the run's headline —
is greedy pass@1 averaged over the levels RL trains on (and over environments in a mixture, whose
per-environment figures are `eval/<env>/...`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from jaxrl_agent import envs, rollout
from jaxrl_agent.invariants import measures as invariants
from jaxrl_agent.metrics.records import success
from jaxrl_agent.rollout.episode import run_coroutine

EVAL_GREEDY_SEED = 10**6
EVAL_SAMPLED_SEED = 2 * 10**6


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate, per environment: {env name: (evaluated levels, trained levels)}."""

    levels: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]
    tasks_per_difficulty: int
    pass_k: int = 0


def evaluate(sampler, make_env: Callable, environments: Mapping[str, envs.Environment], tokenizer, template,
             spec: EvalSpec, *, greedy: rollout.EpisodeSettings, sampled: rollout.EpisodeSettings,
             progress: Callable[[int], None] | None = None, shard: tuple[int, int] = (0, 1),
             gather: Callable[[dict], list[dict]] | None = None,
             on_episodes: Callable[[str, int, list], None] | None = None) -> dict[str, float]:
    """Runs the held-out episodes; returns the `eval/*` metrics (and `eval/seconds`).
    `progress(levels_done)` is called after each (environment, level).

    With several processes, `shard=(index, count)` runs this process's share of every level's tasks
    (task i where i % count == index, with task i's own seeds) and `gather(outcomes)` — every
    process's outcomes, in process order (`sharding.gather_objects`) — pools them, so every process
    returns the job's metrics over all the tasks.

    `on_episodes(env name, level, results)` receives each level's greedy episodes as
    `agent.AgentResult`s (trajectory and transcript), e.g. to print or keep them."""
    started = time.monotonic()
    index, count = shard
    outcomes: dict[str, dict] = {}  # "name/level" -> this process's per-task successes
    done = 0
    for name, (levels, _) in spec.levels.items():
        env = environments[name]
        for d in levels:
            ids = list(range(index, spec.tasks_per_difficulty, count))
            tasks = [env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, d) for i in ids]
            groups = run_coroutine(rollout.collect_groups(sampler, make_env, tasks, 1, tokenizer, template, greedy,
                                                        seed=EVAL_GREEDY_SEED, group_indices=ids))
            outcome = {"greedy": [success(g[0]) for g in groups]}
            if on_episodes is not None:
                from jaxrl_agent import agent

                on_episodes(name, d, [agent.AgentResult(g[0], agent.transcript(g[0], tokenizer)) for g in groups])
            if spec.pass_k > 1:
                groups = run_coroutine(rollout.collect_groups(sampler, make_env, tasks, spec.pass_k, tokenizer,
                                                            template, sampled, seed=EVAL_SAMPLED_SEED,
                                                            group_indices=ids))
                outcome["sampled"] = [[bool(success(t) > 0) for t in g] for g in groups]
            outcomes[f"{name}/{d}"] = outcome
            done += 1
            if progress is not None:
                progress(done)
    if gather is not None:
        shares = gather(outcomes)
        outcomes = {key: {part: [x for share in shares for x in share[key][part]] for part in outcome}
                    for key, outcome in outcomes.items()}
    results = metrics_from_outcomes(spec, outcomes)
    results["eval/seconds"] = time.monotonic() - started
    return results


def metrics_from_outcomes(spec: EvalSpec, outcomes: Mapping[str, Mapping[str, list]]) -> dict[str, float]:
    """The `eval/*` metrics from per-task outcomes: {"name/level": {"greedy": [success per task],
    "sampled": [[success per sample] per task]}} (sampled with pass_k > 1 only)."""
    results: dict[str, float] = {}
    mixture = len(spec.levels) > 1
    headline = []
    for name, (levels, trained_levels) in spec.levels.items():
        prefix = f"eval/{name}/" if mixture else "eval/"
        for d in levels:
            outcome = outcomes[f"{name}/{d}"]
            results[f"{prefix}pass@1/d{d}"] = float(np.mean(outcome["greedy"])) if outcome["greedy"] else 0.0
            if spec.pass_k > 1:
                results[f"{prefix}sampled_pass@1/d{d}"] = invariants.mean_pass_at_k(outcome["sampled"], 1)
                results[f"{prefix}pass@{spec.pass_k}/d{d}"] = invariants.mean_pass_at_k(outcome["sampled"], spec.pass_k)
        trained = [results[f"{prefix}pass@1/d{d}"] for d in levels if d in trained_levels]
        env_success = float(np.mean(trained)) if trained else 0.0
        if mixture:
            results[f"{prefix}success"] = env_success
        headline.append(env_success)
    # The headline number: greedy success on held-out tasks of the levels RL trains on.
    results["eval/success"] = float(np.mean(headline)) if headline else 0.0
    if spec.pass_k > 1:
        # The deploy gap (drift's third part): what greedy decoding, as deployed, scores against what
        # training's sampling scores on the same held-out tasks, averaged over the evaluated levels.
        gaps = [v - results[k.replace("/pass@1/", "/sampled_pass@1/")] for k, v in results.items()
                if "/pass@1/" in k and "sampled" not in k and k.replace("/pass@1/", "/sampled_pass@1/") in results]
        results["eval/deploy_gap"] = float(np.mean(gaps)) if gaps else 0.0
    return results


def levels_for(env: envs.Environment, wanted: Sequence[int]) -> tuple[int, ...]:
    """The wanted levels this environment has (all of its levels when it has none of them)."""
    have = tuple(d for d in wanted if d in env.difficulties)
    return have or tuple(env.difficulties)
