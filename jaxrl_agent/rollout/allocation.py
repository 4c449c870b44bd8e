"""Who gets rollouts: per-task success posteriors and allocation rules (host-side, NumPy).

Under group-relative advantages a group whose G rewards are all equal carries no gradient, so
rollouts spent on tasks that are always or never solved are wasted. With a per-task success
probability p, a group of n binary rewards is *degenerate* with probability p^n + (1 - p)^n.

  * `TaskPosterior` — Beta(alpha, beta) success posterior per task with exponential forgetting
    (decay gamma in (0, 1]: alpha <- gamma * alpha + successes, beta <- gamma * beta + failures),
    so the estimate follows a policy that improves.
  * `allocate(strategy, p, budget, ...)` -> rollouts per task, summing to at most `budget`:
      - `uniform`: the same group size for every task (the baseline).
      - `variance`: n_i proportional to sqrt(p_i (1 - p_i)) (Neyman allocation: the per-task
        gradient variance of a binary reward is p(1 - p); rollouts go where they reduce the
        estimator's variance most, as in VIP / GVM-RAFT).
      - `knapsack` (Knapsack RL, Li et al. 2025): greedy marginal value per unit cost under the
        budget. The value of giving task i n rollouts is
        P(non-degenerate) x information = (1 - p^n - (1 - p)^n) x p(1 - p); the cost is n times the
        task's expected tokens. Each step adds one rollout (two at first: a group needs two) to the
        task with the largest value gain per cost.
  * `until_mixed_done(rewards, cap)` — Reinforce-Ada: keep sampling a task until its group has
    mixed outcomes or the cap is reached.
  * `dynamic_sampling_prompts(target_groups, nonzero_share)` — DAPO dynamic filtering: how many
    prompts to submit so that, after all-equal groups are dropped, the batch is still full.
  * `TaskPosterior.retired(...)` — saturated tasks (posterior mean above a threshold with enough
    evidence) are retired and revisited only with a small probability.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

STRATEGIES = ("uniform", "variance", "knapsack")
# Strategies of the trainer's task allocator: the rules above, plus Reinforce-Ada's sequential
# sampling, which decides group sizes while sampling (see `until_mixed_done`).
ALLOCATOR_STRATEGIES = STRATEGIES + ("until_mixed",)


@dataclasses.dataclass
class TaskPosterior:
    """Beta posteriors over task success, keyed by task id; prior Beta(prior, prior)."""

    decay: float = 1.0
    prior: float = 1.0
    alpha: dict = dataclasses.field(default_factory=dict)
    beta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay={self.decay} must be in (0, 1]")
        if self.prior <= 0:
            raise ValueError(f"prior={self.prior} must be > 0")

    def update(self, task_id: str, successes: int, failures: int) -> None:
        """alpha <- decay * alpha + successes, beta <- decay * beta + failures."""
        a, b = self.alpha.get(task_id, self.prior), self.beta.get(task_id, self.prior)
        self.alpha[task_id] = self.decay * a + successes
        self.beta[task_id] = self.decay * b + failures

    def mean(self, task_id: str) -> float:
        a, b = self.alpha.get(task_id, self.prior), self.beta.get(task_id, self.prior)
        return a / (a + b)

    def evidence(self, task_id: str) -> float:
        """Pseudo-observations beyond the prior."""
        return self.alpha.get(task_id, self.prior) + self.beta.get(task_id, self.prior) - 2 * self.prior

    def retired(self, task_id: str, threshold: float = 0.95, min_evidence: float = 8.0) -> bool:
        """Saturated: posterior mean >= threshold with at least `min_evidence` observations."""
        return self.evidence(task_id) >= min_evidence and self.mean(task_id) >= threshold

    def state_dict(self) -> dict:
        return {"decay": self.decay, "prior": self.prior, "alpha": dict(self.alpha), "beta": dict(self.beta)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "TaskPosterior":
        return cls(decay=state["decay"], prior=state["prior"], alpha=dict(state["alpha"]), beta=dict(state["beta"]))


def p_nondegenerate(p, n):
    """P(a group of n Bernoulli(p) rewards is not all equal) = 1 - p^n - (1 - p)^n (0 for n < 2)."""
    p, n = np.asarray(p, np.float64), np.asarray(n, np.float64)
    value = 1.0 - p ** n - (1.0 - p) ** n
    return np.where(n >= 2, value, 0.0)


def knapsack_value(p, n):
    """Value of n rollouts on a task of success rate p: P(non-degenerate) x p(1 - p)."""
    p = np.asarray(p, np.float64)
    return p_nondegenerate(p, n) * p * (1.0 - p)


def allocate(strategy: str, p: Sequence[float], budget: int, *, group_size: int = 4, min_group: int = 2,
             max_group: int = 16, costs: Sequence[float] | None = None) -> np.ndarray:
    """Rollouts per task (ints, sum <= budget; a task gets 0 or between min_group and max_group).

    Args:
      strategy: one of STRATEGIES.
      p: estimated success rate per task (e.g. `TaskPosterior.mean`).
      budget: total rollouts (for `knapsack`, total cost when `costs` is given).
      group_size: `uniform`'s group size.
      costs: per-rollout cost of each task (e.g. expected tokens); default 1.
    """
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    k = len(p)
    if strategy not in STRATEGIES:
        raise ValueError(f"allocation strategy {strategy!r}; expected one of {STRATEGIES}")
    if budget < 0 or min_group < 2 or max_group < min_group:
        raise ValueError(f"need budget >= 0 and 2 <= min_group <= max_group; got {budget}, {min_group}, {max_group}")
    counts = np.zeros(k, np.int64)
    if k == 0 or budget < min_group:
        return counts
    if strategy == "uniform":
        groups = min(k, budget // group_size)
        counts[:groups] = group_size
        return counts
    if strategy == "variance":
        weight = np.sqrt(p * (1.0 - p))
        if weight.sum() == 0:
            return counts
        # Largest weights first; each chosen task gets its proportional share, at least min_group.
        order = np.argsort(-weight, kind="stable")
        remaining, total_weight = budget, weight.sum()
        for i in order:
            if weight[i] == 0 or remaining < min_group:
                break
            share = int(round(budget * weight[i] / total_weight))
            n = int(np.clip(share, min_group, min(max_group, remaining)))
            counts[i] = n
            remaining -= n
        return counts
    # knapsack: greedy on marginal value per unit cost.
    cost = np.ones(k) if costs is None else np.asarray(costs, np.float64)
    if np.any(cost <= 0):
        raise ValueError("costs must be positive")
    remaining = float(budget)
    while True:
        step = np.where(counts == 0, min_group, 1)
        gain = knapsack_value(p, counts + step) - knapsack_value(p, counts)
        ratio = gain / (step * cost)
        feasible = (counts + step <= max_group) & (step * cost <= remaining + 1e-9) & (gain > 1e-12)
        if not feasible.any():
            return counts
        i = int(np.argmax(np.where(feasible, ratio, -np.inf)))
        counts[i] += step[i]
        remaining -= step[i] * cost[i]


def until_mixed_done(rewards: Sequence[float], cap: int) -> bool:
    """Reinforce-Ada's stopping rule: a task's group is done once its rewards differ, or at the cap."""
    return len(rewards) >= cap or (len(rewards) >= 2 and len(set(float(r) for r in rewards)) > 1)


def dynamic_sampling_prompts(target_groups: int, nonzero_share: float, *, max_factor: float = 4.0) -> int:
    """Prompts to submit so that about `target_groups` survive DAPO's all-equal filter:
    ceil(target / share), the over-sampling factor capped at `max_factor`."""
    if target_groups < 0:
        raise ValueError(f"target_groups={target_groups} must be >= 0")
    share = max(float(nonzero_share), 1.0 / max_factor)
    return int(math.ceil(target_groups / share))


class TaskAllocator:
    """A finite pool of training tasks, revisited, with per-task posteriors driving who gets rollouts.

    Each call to `propose(num_groups)` spends a budget of `num_groups * group_size` rollouts:
    `candidates * num_groups` tasks are drawn from the pool without replacement (retired tasks only
    with probability `revisit_prob` each), and `allocate(strategy, ...)` splits the budget over them
    from their posterior success rates. With `min_group = group_size` the adaptive strategies keep
    whole groups and choose *which* tasks get them (those most likely to give mixed outcomes);
    `uniform` takes the first `num_groups` candidates, i.e. a uniform draw from the pool.
    `observe(task_id, rewards)` feeds finished groups back (reward > 0 counts as a success).
    The state (posteriors and the draw RNG) is a plain dict for checkpoints.
    """

    def __init__(self, tasks: Sequence, strategy: str, group_size: int, *, candidates: float = 2.0,
                 min_group: int | None = None, max_group: int = 16, decay: float = 0.9,
                 retire_threshold: float = 0.95, retire_min_evidence: float = 8.0, revisit_prob: float = 0.05,
                 seed: int = 0):
        if strategy not in ALLOCATOR_STRATEGIES:
            raise ValueError(f"allocation strategy {strategy!r}; expected one of {ALLOCATOR_STRATEGIES}")
        if not tasks:
            raise ValueError("the task pool is empty")
        if candidates < 1.0:
            raise ValueError(f"candidates={candidates} must be >= 1 (tasks considered per group of budget)")
        if not 0.0 <= revisit_prob <= 1.0:
            raise ValueError(f"revisit_prob={revisit_prob} must be in [0, 1]")
        self.tasks = list(tasks)
        self.by_id = {t.id: t for t in self.tasks}
        if len(self.by_id) != len(self.tasks):
            raise ValueError("task ids in the pool must be unique")
        self.strategy, self.group_size, self.candidates = strategy, group_size, candidates
        self.min_group = group_size if min_group is None else min_group
        self.max_group = max_group
        self.retire_threshold, self.retire_min_evidence = retire_threshold, retire_min_evidence
        self.revisit_prob = revisit_prob
        self.posterior = TaskPosterior(decay=decay)
        self.rng = np.random.RandomState(seed)

    def retired_count(self) -> int:
        return sum(self.posterior.retired(t.id, self.retire_threshold, self.retire_min_evidence) for t in self.tasks)

    def draw(self, n: int, exclude: Sequence[str] = ()) -> list:
        """n distinct tasks drawn uniformly from the active pool (retired ones with revisit_prob)."""
        excluded = set(exclude)
        active = [t for t in self.tasks if t.id not in excluded and (
            not self.posterior.retired(t.id, self.retire_threshold, self.retire_min_evidence)
            or self.rng.rand() < self.revisit_prob)]
        if not active:
            active = [t for t in self.tasks if t.id not in excluded]
        picks = self.rng.choice(len(active), size=min(n, len(active)), replace=False)
        return [active[i] for i in picks]

    def propose(self, num_groups: int) -> list[tuple[object, int]]:
        """[(task, rollouts)] for a budget of num_groups * group_size rollouts (`until_mixed`: the
        first round, min_group rollouts for each of num_groups tasks; the trainer adds rounds)."""
        if num_groups <= 0:
            return []
        if self.strategy == "until_mixed":
            return [(task, self.min_group) for task in self.draw(num_groups)]
        wanted = num_groups if self.strategy == "uniform" else int(math.ceil(self.candidates * num_groups))
        chosen = self.draw(wanted)
        p = [self.posterior.mean(t.id) for t in chosen]
        counts = allocate(self.strategy, p, num_groups * self.group_size, group_size=self.group_size,
                          min_group=self.min_group, max_group=max(self.max_group, self.min_group))
        return [(task, int(n)) for task, n in zip(chosen, counts) if n > 0]

    def observe(self, task_id: str, rewards: Sequence[float]) -> None:
        successes = int(sum(float(r) > 0 for r in rewards))
        self.posterior.update(task_id, successes, len(rewards) - successes)

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {"posterior": self.posterior.state_dict(),
                "rng": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}

    def load_state_dict(self, state: dict) -> None:
        self.posterior = TaskPosterior.from_state_dict(state["posterior"])
        kind, keys, pos, has_gauss, cached = state["rng"]
        self.rng.set_state((kind, np.asarray(keys, np.uint32), pos, has_gauss, cached))
