"""Exploration and learning-signal metrics over finished episodes (host-side, NumPy).

  * `pass_at_k(n, c, k)` — the unbiased estimator of Chen et al. (2021), "Evaluating Large
    Language Models Trained on Code", eq. 1:  pass@k = 1 - C(n - c, k) / C(n, k)  for n samples of
    which c are correct, computed as a stable product.
  * `solution_signature` / `distinct_solutions` — episodes grouped by their normalised tool-call
    sequence (names and arguments, whitespace-insensitive): how many different ways a task was
    attacked. A collapse to one cluster per task is the exploration collapse DAPO and ProRL warn of.
  * `group_signal` — share of groups whose rewards are not all equal (only those carry gradient
    under group-relative advantages).
  * `entropy_by_env` — sampled-token entropy estimate per environment.
"""

from __future__ import annotations

import collections
import json
import math
from typing import Iterable, Mapping, Sequence

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
