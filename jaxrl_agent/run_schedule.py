"""When a run acts and when it stops: periodic actions, the reasons RL ends early, and the time
left. Pure functions of the config's numbers and the run's clock (the trainer only calls them)."""

from __future__ import annotations

# Why RL ends before `rl.iterations`, in order of precedence when processes disagree.
STOP_REASONS = (None, "time_budget", "trained_tokens")


def every(period: int, iteration: int) -> bool:
    """Whether a periodic action (`eval.every`, `checkpoint.every`, `sft.log_every`, ...) falls on
    `iteration`; a period of 0 means never periodically (the run still logs, evaluates and
    checkpoints at its end)."""
    return period > 0 and iteration % period == 0


def stop_reason(rl, iteration: int, *, trained_tokens_total: int, elapsed_seconds: float, durations: list[float],
                last_eval_seconds: float) -> str | None:
    """Why RL ends after `iteration` before `rl.iterations` (one of STOP_REASONS), pure:
    'trained_tokens' once `rl.stop_after_trained_tokens` (> 0) tokens were trained; 'time_budget'
    when one more iteration, then the final checkpoint and evaluation, would not fit in
    `rl.time_budget_minutes` (> 0) of run time — the next iteration estimated as the slowest of the
    last five `durations` (an evaluation or checkpoint may fall in it), the final evaluation as the
    last one's `last_eval_seconds`; None otherwise (and after the last iteration)."""
    if rl.stop_after_trained_tokens and trained_tokens_total >= rl.stop_after_trained_tokens:
        return "trained_tokens"
    budget = 60.0 * rl.time_budget_minutes
    if iteration < rl.iterations and budget > 0 and durations and \
            elapsed_seconds + max(durations[-5:]) + last_eval_seconds > budget:
        return "time_budget"
    return None


def eta_seconds(rl, iteration: int, iteration_seconds: float, elapsed_seconds: float) -> float:
    """The RL time left after `iteration`: the remaining iterations at this one's pace, capped by
    what is left of `rl.time_budget_minutes` (when set)."""
    left = (rl.iterations - iteration) * iteration_seconds
    budget = 60.0 * rl.time_budget_minutes
    return left if budget <= 0 else min(left, max(budget - elapsed_seconds, 0.0))
