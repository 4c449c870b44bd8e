"""The invariants' measures over an iteration's episodes (host-side, NumPy).

Exploration:

  * `pass_at_k(n, c, k)` — the unbiased estimator of Chen et al. (2021), "Evaluating Large
    Language Models Trained on Code", eq. 1:  pass@k = 1 - C(n - c, k) / C(n, k)  for n samples of
    which c are correct, computed as a stable product.
  * `solution_signature` / `distinct_solutions` — episodes grouped by their normalised tool-call
    sequence (names and arguments, whitespace-insensitive): how many different ways a task was
    attacked. A collapse to one cluster per task is the exploration collapse DAPO and ProRL warn of.
  * `entropy_by_env` — sampled-token entropy estimate per environment.
  * `identical_group_share` — share of groups whose samples are all the same token sequence: the
    sampler no longer explores within a group at all.

Learning signal:
  * `group_signal` — share of groups whose rewards are not all equal (only those carry gradient
    under group-relative advantages).
  * `outcome_shares_by_difficulty` — per difficulty, the shares of groups all correct and all wrong
    (the two ways a group has no signal: too easy, too hard).
  * `advantage_magnitude` — mean |advantage| over trained episodes.

Drift:
  * `gap_stats` — mean, 99th percentile and max of |log pi_learner - log pi_sampler| over tokens.
  * `lag_quantiles` — the policy-lag distribution (versions between sampling and training).
"""

from __future__ import annotations

import collections
import json
import math
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxrl_agent.envs import tool_protocol


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

    Equals 1 - prod_{i=n-c+1}^{n} (1 - k / i), which avoids huge binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"pass_at_k needs non-negative integers, got {name}={value!r}")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct samples exceeds n={n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(successes_per_task: Sequence[Sequence[bool]], k: int) -> float:
    """Mean over tasks of pass@k, each task's estimate from its own samples."""
    values = [pass_at_k(len(s), int(sum(bool(x) for x in s)), k) for s in successes_per_task]
    return float(np.mean(values)) if values else 0.0


def solution_signature(actions: Iterable[str]) -> str:
    """The normalised tool-call sequence of an episode's actions (the answer text is left out).

    Calls are canonicalised (JSON with sorted keys, whitespace removed inside string arguments), so
    `calc(1 + 2)` and `calc(1+2)` are one cluster; unparseable calls count as `!error`.
    """
    parts = []
    for action in actions:
        parsed = tool_protocol.parse_tool_calls(action)
        for call in parsed.calls:
            args = {key: "".join(v.split()) if isinstance(v, str) else v for key, v in call.arguments.items()}
            parts.append(call.name + json.dumps(args, sort_keys=True, separators=(",", ":")))
        parts.extend("!error" for _ in parsed.errors)
    return "|".join(parts)


def distinct_solutions(signatures_per_task: Mapping[str, Sequence[str]]) -> float:
    """Mean number of distinct solution signatures per task."""
    counts = [len(set(s)) for s in signatures_per_task.values()]
    return float(np.mean(counts)) if counts else 0.0


def group_signal(rewards_per_group: Sequence[Sequence[float]]) -> float:
    """Share of groups whose rewards are not all equal (the ones with non-zero advantages)."""
    if not rewards_per_group:
        return 0.0
    mixed = [len(set(float(r) for r in group)) > 1 for group in rewards_per_group]
    return float(np.mean(mixed))


def entropy_by_env(trajectories: Iterable) -> dict[str, float]:
    """Per environment, the Monte-Carlo token entropy estimate  H ~ mean(-log pi(sampled token))
    over the sampled tokens (loss_mask == 1), from the sampler's own log-probs: no extra forward pass.
    """
    total, tokens = collections.defaultdict(float), collections.defaultdict(int)
    for t in trajectories:
        sampled = np.asarray(t.loss_mask) == 1
        total[t.env] += float(-np.asarray(t.sampler_logprobs, np.float64)[sampled].sum())
        tokens[t.env] += int(sampled.sum())
    return {env: total[env] / tokens[env] for env in total if tokens[env] > 0 and math.isfinite(total[env])}


def identical_group_share(token_sequences_per_group: Sequence[Sequence[Sequence[int]]]) -> float:
    """Share of groups (of two or more samples) whose samples are all the same token sequence."""
    groups = [g for g in token_sequences_per_group if len(g) > 1]
    if not groups:
        return 0.0
    return float(np.mean([len({tuple(int(x) for x in seq) for seq in g}) == 1 for g in groups]))


def difficulty_of(task_id: str) -> str | None:
    """The difficulty in a task id of the library's form `env/difficulty/seed` (None otherwise)."""
    parts = task_id.split("/")
    return parts[1] if len(parts) == 3 and parts[1].isdigit() else None


def outcome_shares_by_difficulty(successes_by_group: Sequence[tuple[str, Sequence[bool]]]) -> dict[str, float]:
    """`{'all_correct/d{d}': share, 'all_wrong/d{d}': share}` per difficulty, from each group's
    task id (`difficulty_of`; ids without one count in the totals only) and its samples'
    successes; plus the same over every group ('all_correct', 'all_wrong')."""
    by_level: dict[str, list[tuple[bool, bool]]] = collections.defaultdict(list)
    for task_id, successes in successes_by_group:
        if not successes:
            continue
        outcome = (all(successes), not any(successes))
        level = difficulty_of(task_id)
        if level is not None:
            by_level[level].append(outcome)
        by_level["*"].append(outcome)
    shares = {}
    for level, outcomes in by_level.items():
        suffix = "" if level == "*" else f"/d{level}"
        shares[f"all_correct{suffix}"] = float(np.mean([c for c, _ in outcomes]))
        shares[f"all_wrong{suffix}"] = float(np.mean([w for _, w in outcomes]))
    return shares


def advantage_magnitude(advantages: Iterable[float]) -> float:
    """Mean |advantage| (0 when there are none)."""
    values = np.abs(np.asarray(list(advantages), np.float64))
    return float(values.mean()) if values.size else 0.0


def gap_stats(learner_logprobs: np.ndarray, sampler_logprobs: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """`{'mean', 'p99', 'max'}` of |learner - sampler| log-probs over the tokens where mask is 1
    (zeros when there are none)."""
    gap = np.abs(np.asarray(learner_logprobs, np.float64) - np.asarray(sampler_logprobs, np.float64))
    gap = gap[np.asarray(mask) == 1]
    if not gap.size:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": float(gap.mean()), "p99": float(np.percentile(gap, 99)), "max": float(gap.max())}


def lag_quantiles(lags: np.ndarray) -> dict[str, float]:
    """`{'p50', 'p90', 'max'}` of the policy lag of trained tokens (zeros when there are none)."""
    lags = np.asarray(lags, np.float64)
    if not lags.size:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    return {"p50": float(np.percentile(lags, 50)), "p90": float(np.percentile(lags, 90)), "max": float(lags.max())}


def iteration_invariants(groups: Sequence[Sequence], trained: Sequence, record: Mapping[str, float], *,
                         group_size: int, success: Callable[[object], float], lags: np.ndarray,
                         distill_only_envs: frozenset[str] = frozenset()) -> dict[str, float]:
    """The three invariants' metrics of one RL iteration, under 'invariants/{exploration,signal,drift}/'.

    groups: the iteration's groups of episodes; trained: the trajectories trained on; record: the
    iteration record so far (its entropy, pass@k, distinct-solution, signal and throughput figures
    are reused); success: an episode's success; lags: policy lag of every trained token;
    distill_only_envs: environments trained by distillation alone (`rl.distill_envs`): their
    advantages are 0 by construction, so the learning-signal measures (all-correct / all-wrong
    shares, advantage magnitude) leave them out, as post-processing's signal statistics do.
    """
    entropies = [v for k, v in record.items() if k.startswith("sampled_entropy/")]
    out = {
        "invariants/exploration/entropy_min": min(entropies) if entropies else float("nan"),
        "invariants/exploration/pass_gap": record.get(f"pass@{group_size}", 0.0) - record.get("success", 0.0),
        "invariants/exploration/distinct_solutions": record.get("distinct_solutions", 0.0),
        "invariants/exploration/identical_group_share": identical_group_share([[t.tokens for t in g] for g in groups]),
        "invariants/signal/nonzero_share": record.get("nonzero_advantage_group_share", float("nan"))
        if groups else float("nan"),
        "invariants/signal/advantage_magnitude": advantage_magnitude(
            t.advantage for t in trained if t.env not in distill_only_envs),
        "invariants/signal/effective_samples_per_second": record.get("effective_samples_per_second", 0.0),
        **{f"invariants/drift/lag_{k}": v for k, v in lag_quantiles(lags).items()},
    }
    shares = outcome_shares_by_difficulty([(g[0].task_id, [success(t) > 0 for t in g]) for g in groups
                                           if g and g[0].env not in distill_only_envs])
    out.update({f"invariants/signal/{k}": v for k, v in shares.items()})
    return out
