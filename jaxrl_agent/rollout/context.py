"""Context management: how an episode's conversation is edited when it outgrows its context.

One piece of code for rollout, evaluation and deployment alike: `run_episode` asks `edit(...)`
after every tool result whether the next context would pass `trigger × max_context` tokens, and if
so continues from the edited conversation, as a new learner sequence (`Trajectory.segment_starts`)
whose prefix is exactly what the sampler conditions on from then on. The episode's reward and
advantage are shared by all its sequences (SUPO's form, arXiv 2510.06727).

Strategies (`rollout.context`), after GLM-5's hierarchical context strategies:
  * `none` — no edit: an episode that reaches `max_context` ends ('context_limit').
  * `keep_recent` — the head (system prompt and task) and the last `keep_turns` turns (each an
    assistant reply and its tool result); older turns are dropped, with a note saying so.
  * `discard_all` — the head and the note only: the policy restarts from the task, knowing that it
    has worked on it before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

CONTEXT_STRATEGIES = ("none", "keep_recent", "discard_all")
DEFAULT_NOTE = "(Earlier turns of this episode were removed to fit the context.)"


@dataclasses.dataclass(frozen=True)
class ContextSettings:
    """strategy: one of CONTEXT_STRATEGIES. keep_turns: turns kept by keep_recent. trigger: the
    share of max_context the next context may reach before it is edited. note: the user message
    that stands for what was removed."""

    strategy: str = "none"
    keep_turns: int = 2
    trigger: float = 0.75
    note: str = DEFAULT_NOTE

    def __post_init__(self):
        if self.strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"rollout.context={self.strategy!r}: expected one of {CONTEXT_STRATEGIES}")
        if self.keep_turns < 0:
            raise ValueError(f"rollout.context_keep_turns={self.keep_turns}: expected >= 0")
        if not 0.0 < self.trigger <= 1.0:
            raise ValueError(f"rollout.context_trigger={self.trigger}: expected in (0, 1]")


def head_length(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many leading messages are the episode's head (everything before the first reply)."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return i
    return len(messages)


def should_edit(settings: ContextSettings, next_context_tokens: int, max_context: int) -> bool:
    """Whether a context of `next_context_tokens` passes the strategy's trigger."""
    return settings.strategy != "none" and next_context_tokens > settings.trigger * max_context


def edited(settings: ContextSettings, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The conversation the episode continues from (a new list; `messages` is not changed).

    messages: the whole conversation so far, ending with a tool result: the head, then pairs of
    (assistant reply, result)."""
    head = [dict(m) for m in messages[:head_length(messages)]]
    turns = [dict(m) for m in messages[len(head):]]
    note = {"role": "user", "content": settings.note}
    if settings.strategy == "discard_all":
        return [*head, note]
    if settings.strategy == "keep_recent":
        kept = turns[len(turns) - 2 * settings.keep_turns:] if settings.keep_turns else []
        if len(kept) == len(turns):
            return [*head, *turns]
        return [*head, note, *kept]
    return [*head, *turns]
