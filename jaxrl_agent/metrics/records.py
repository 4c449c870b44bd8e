"""Pure builders of the records the trainer writes: one RL iteration's record, the exploration
guards' flags, and the run's headline summary. Inputs are finished trajectories and plain numbers;
nothing here touches a model, a sampler or a file."""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxrl_agent.invariants import measures as invariants

SAMPLER_COUNTERS = ("idle_seconds", "prefill_tokens", "reused_tokens", "generate_calls", "decode_seconds",
                    "admit_seconds", "live_slots", "decoded_slots")


def success(trajectory) -> float:
    return float(trajectory.reward_components.get("success", 0.0))


def actions(trajectory, decode: Callable[[Sequence[int]], str]) -> list[str]:
    """The text of each assistant turn (contiguous sampled spans), end markers included."""
    mask = np.asarray(trajectory.loss_mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [decode(trajectory.tokens[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def sampler_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in SAMPLER_COUNTERS}


def _mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else 0.0


def iteration_record(*, groups: Sequence[Sequence[Any]], trained: Sequence[Any], signal: Mapping[str, float],
                     learner_metrics: Mapping[str, float], sampler: Mapping[str, float], group_size: int,
                     decode: Callable[[Sequence[int]], str], trained_version: int,
                     extra: Mapping[str, Any] | None = None,
                     distill_only_envs: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One RL iteration's metrics.

    Args:
      groups: every group sampled this iteration (after reward shaping).
      trained: the trajectories the learner trained on.
      signal: post-processing's signal metrics (groups, nonzero share, stale drops...).
      learner_metrics: the last update's metrics (every objective metric is kept).
      sampler: the sampler's counters over the iteration (`sampler_delta`).
      trained_version: the policy version the learner trained at (for the lag of each token).
      extra: schedule position, timings and counts the trainer knows.
      distill_only_envs: `rl.distill_envs` (left out of the learning-signal invariants).
    """
    episodes = [t for g in groups for t in g]
    successes = [[success(t) > 0 for t in g] for g in groups]
    clusters = {g[0].task_id: [invariants.solution_signature(actions(t, decode)) for t in g] for g in groups}
    lag = np.concatenate([trained_version - t.policy_version[t.loss_mask == 1] for t in trained]) \
        if trained else np.zeros(0)
    calls = max(sampler.get("generate_calls", 0), 1)
    names = sorted({k for t in episodes for k in t.reward_components})
    record: dict[str, Any] = {
        **signal,
        "success": _mean(success(t) for t in episodes),
        f"pass@{group_size}": invariants.mean_pass_at_k([s for s in successes if len(s) == group_size], group_size),
        "distinct_solutions": invariants.distinct_solutions(clusters),
        **{f"sampled_entropy/{env}": v for env, v in invariants.entropy_by_env(episodes).items()},
        "reward": _mean(t.reward for t in episodes),
        **{f"reward/{name}": _mean(t.reward_components.get(name, 0.0) for t in episodes) for name in names},
        "trained_trajectories": len(trained),
        "rollouts": len(episodes),
        "generated_tokens": int(sum(t.generated_tokens for t in episodes)),
        "trained_tokens": int(sum(int(t.loss_mask.sum()) for t in trained)),
        "policy_lag_mean": float(lag.mean()) if lag.size else 0.0,
        "policy_lag_max": int(lag.max()) if lag.size else 0,
        "sampler_idle_seconds": sampler.get("idle_seconds", 0.0),
        # Prompt tokens run through the model, and those taken from the prefix cache instead.
        "sampler_prefill_tokens": sampler.get("prefill_tokens", 0),
        "sampler_reused_tokens": sampler.get("reused_tokens", 0),
        # Where the sampler's time went and how full its decode calls were: live requests and
        # slots run, per generate call (remote servers' counters summed over the servers, the
        # in-process sampler's over its engines: seconds are engine-seconds).
        "sampler_decode_seconds": sampler.get("decode_seconds", 0.0),
        "sampler_admit_seconds": sampler.get("admit_seconds", 0.0),
        "sampler_generate_calls": sampler.get("generate_calls", 0),
        "sampler_live_per_call": sampler.get("live_slots", 0) / calls,
        "sampler_rows_per_call": sampler.get("decoded_slots", 0) / calls,
        "finish_reasons": dict(collections.Counter(t.finish_reason for t in episodes)),
        **dict(learner_metrics),
    }
    by_env: dict[str, list] = collections.defaultdict(list)
    for g in groups:
        by_env[g[0].env].append(g)
    if len(by_env) > 1:
        for env, env_groups in sorted(by_env.items()):
            env_episodes = [t for g in env_groups for t in g]
            record[f"success/{env}"] = _mean(success(t) for t in env_episodes)
            record[f"reward/{env}"] = _mean(t.reward for t in env_episodes)
            record[f"signal_share/{env}"] = _mean(len({t.reward for t in g}) > 1 for g in env_groups)
            record[f"rollouts/{env}"] = len(env_episodes)
    record.update(context_metrics(episodes))
    record.update(extra or {})
    record.update(invariants.iteration_invariants(groups, trained, record, group_size=group_size, success=success,
                                                  lags=lag, distill_only_envs=distill_only_envs))
    return record


def context_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """Context management's numbers (`rollout.context`): edits per episode, the longest learner
    sequence (the context an episode needed) as mean and max, and, once any episode was edited,
    success split by its number of edits (`context/success/edits_<n>`); with summaries
    ('summarize'), the share of generated tokens that are summary tokens."""
    if not episodes:
        return {}
    edits = [sum("context_edit" in turn for turn in t.turns) for t in episodes]
    longest = [t.longest_segment for t in episodes]
    out = {"context/edits_per_episode": _mean(edits), "context/longest_sequence_mean": _mean(longest),
           "context/longest_sequence_max": max(longest)}
    summary = sum(b - a for t in episodes for a, b in t.summary_spans)
    if summary:
        out["context/summary_token_share"] = summary / max(sum(t.generated_tokens for t in episodes), 1)
    if any(edits):
        for n in sorted(set(edits)):
            out[f"context/success/edits_{n}"] = _mean(success(t) for t, e in zip(episodes, edits) if e == n)
    return out


def delegation_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """Sub-agents' numbers (`rollout.delegate`): delegations (sub-agent episodes, all levels) per
    episode, the sub-agents' success, the share of episodes that delegated, and an episode's
    critical-path turns (its longest chain of dependent turns: a delegating turn counts its
    longest sub-agent) against its total turns (its own and every sub-agent's)."""
    from jaxrl_agent.rollout import delegation

    if not episodes:
        return {}
    records = [list(delegation.all_delegations(t.turns)) for t in episodes]
    flat = [d for r in records for d in r]
    return {"delegation/per_episode": _mean(len(r) for r in records),
            "delegation/episode_share": _mean(bool(r) for r in records),
            "delegation/subagent_success": _mean(float(d.get("success", 0.0)) for d in flat) if flat else 0.0,
            "delegation/critical_path_turns": _mean(delegation.critical_path_turns(t.turns) for t in episodes),
            "delegation/total_turns": _mean(delegation.total_turns(t.turns) for t in episodes)}


# How an iteration's per-process numbers combine into the job's (several processes): counts and
# rates add up, the slowest process's seconds and the largest maxima stand, minima take the
# smallest; every other number is the mean over processes (each samples an equal share).
SUMMED = {"groups", "rollouts", "trained_trajectories", "generated_tokens", "trained_tokens", "trained_tokens_total",
          "groups_pending", "suspended_episodes", "effective_samples_per_second", "trained_tokens_per_second",
          "sampler_prefill_tokens", "sampler_reused_tokens", "sampler_generate_calls", "stale_dropped",
          "invariants/signal/effective_samples_per_second", "sampler_server_restarts", "sampler_rejoined"}
SUMMED_PREFIXES = ("rollouts/", "env_service/", "replay/")  # each process has its own buffer


def combine_process_records(records: Sequence[Mapping[str, Any]], *, keep: Sequence[str] = ()) -> dict[str, Any]:
    """One record from each process's record of the same iteration (pure; see SUMMED). Keys in
    `keep` (numbers already global, e.g. the learner's) are process 0's; dicts of counts add up;
    lists are concatenated in process order; anything else is process 0's."""
    first = records[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r[key] for r in records if key in r]
        if key in keep or len(values) == 1:
            out[key] = value
        elif isinstance(value, bool) or not isinstance(value, (int, float, dict, list)):
            out[key] = value
        elif isinstance(value, dict):
            merged: collections.Counter = collections.Counter()
            for v in values:
                merged.update({k: x for k, x in v.items() if isinstance(x, (int, float))})
            out[key] = dict(merged)
        elif isinstance(value, list):
            out[key] = [x for v in values for x in v]
        elif key in SUMMED or key.startswith(SUMMED_PREFIXES):
            out[key] = sum(values)
        elif key.endswith("_seconds") or key.endswith("_max") or key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("_min") or key.endswith("/min"):
            out[key] = min(values)
        else:
            out[key] = float(np.mean(values))
    return out


def job_record(record: Mapping[str, Any], *, keep: Sequence[str] = ()) -> dict[str, Any]:
    """`record` combined over every process (`combine_process_records`; itself with one process).
    Every process must call it for the same iteration: all of them get the same record back, so
    the invariants' alarms and responses decide alike everywhere."""
    import jax

    if jax.process_count() == 1:
        return dict(record)
    from jaxrl_agent import sharding

    plain = {k: (float(v) if isinstance(v, (np.floating, np.integer)) else v) for k, v in record.items()}
    return combine_process_records(sharding.gather_objects(plain), keep=keep)


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The run's headline, from its metrics records (all processes of a resumed run): held-out
    success after the cold start (the last `sft_eval`, else the initial evaluation) and at the end
    (the last evaluation of any stage), per level and overall, and the gain in points."""
    evals = [r for r in records if r.get("stage") in ("initial_eval", "sft_eval", "rl_eval")]
    if not evals:
        return {}
    cold = [r for r in evals if r["stage"] == "sft_eval"] or [r for r in evals if r["stage"] == "initial_eval"] \
        or evals[:1]
    before, after = cold[-1], evals[-1]
    keys = [k for k in after if k.startswith("eval/") and ("/pass@1/" in k or k.endswith("/success"))]
    summary = {}
    for key in keys:
        name = key[len("eval/"):]
        summary[f"after_sft/{name}"] = float(before.get(key, 0.0))
        summary[f"final/{name}"] = float(after[key])
    summary["gain_points"] = 100.0 * (summary.get("final/success", 0.0) - summary.get("after_sft/success", 0.0))
    reached = seconds_to_gain(records, 15.0)
    if reached is not None:
        summary["seconds_to_15_points"] = reached
    return summary


def seconds_to_gain(records: Sequence[Mapping[str, Any]], points: float) -> float | None:
    """Time to quality: wall seconds from the run's first record to the first RL evaluation whose
    held-out success is `points` above the cold start's (the last `sft_eval`, else the initial
    evaluation); None if none is. Evaluations are the resolution (`eval.every`)."""
    if not records:
        return None
    cold = [r for r in records if r.get("stage") == "sft_eval"] or [r for r in records if r.get("stage") == "initial_eval"]
    if not cold:
        return None
    bar = float(cold[-1]["eval/success"]) + points / 100.0
    for record in records:
        if record.get("stage") == "rl_eval" and float(record["eval/success"]) >= bar - 1e-12:
            return float(record["time"]) - float(records[0]["time"])
    return None


def console_line(iteration: int, iterations: int, record: Mapping[str, Any], *, seconds: float,
                 eta_seconds: float) -> str:
    """The few numbers a person watches per RL iteration (metrics.jsonl has the whole record)."""
    entropies = [v for k, v in record.items() if k.startswith("sampled_entropy/")]
    return (f"[rl {iteration}/{iterations}] success={record['success']:.3f} reward={record['reward']:.3f} "
            f"signal={record['nonzero_advantage_group_share']:.2f} "
            f"entropy={min(entropies) if entropies else 0.0:.3f} loss={record.get('loss', 0.0):.4g} "
            f"tokens/s={record['trained_tokens_per_second']:.0f} {seconds:.1f}s/it eta={eta_seconds / 60:.1f}min")


def eval_console_line(stage: str, step: int, results: Mapping[str, Any]) -> str:
    """Held-out evaluation in one short line: the headline and greedy pass@1 per level."""
    levels = " ".join(f"{k[len('eval/'):].replace('pass@1/', '')}={v:.2f}" for k, v in results.items()
                      if "/pass@1/" in k and "sampled" not in k)
    return f"[{stage} {step}] eval/success={results['eval/success']:.3f} pass@1 {levels} " \
           f"({results.get('eval/seconds', 0.0):.1f}s)"
