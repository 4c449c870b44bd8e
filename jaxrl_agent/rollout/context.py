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
  * `summarize` — the learned variant (SUPO, arXiv 2510.06727): the tool result whose context,
    with the request, passes the trigger is followed by `summary_request` (so the summary has
    `(1 - trigger) × max_context` tokens of room), the policy writes a summary as one more turn (its own
    sampled, trained tokens, conditioned on the whole context), and the episode continues from the
    head plus `summary_prefix` + that summary, as a new learner sequence. Summary turns are marked
    in the turn records (`"summary": True`, `"token_span": [start, end]`) so that the learner can
    weight their tokens separately (`learner.summary_weight`, after FoldAct).

`max_edits` > 0 caps the edits per episode (after that the strategy no longer fires and an episode
that reaches `max_context` ends): training can allow fewer edits than deployment (test-time
scaling of the context).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

CONTEXT_STRATEGIES = ("none", "keep_recent", "discard_all", "summarize")
DEFAULT_NOTE = "(Earlier turns removed.)"
DEFAULT_SUMMARY_REQUEST = "Summarize the context."
DEFAULT_SUMMARY_PREFIX = "Summary: "


@dataclasses.dataclass(frozen=True)
class ContextSettings:
    """strategy: one of CONTEXT_STRATEGIES. keep_turns: turns kept by keep_recent. trigger: the
    share of max_context the next context may reach before it is edited. note: the user message
    that stands for what was removed. max_edits: edits per episode at most (0 = no limit).
    summary_request / summary_prefix: summarize's request after the tool result, and the text
    before the summary in the edited conversation."""

    strategy: str = "none"
    keep_turns: int = 2
    trigger: float = 0.75
    note: str = DEFAULT_NOTE
    max_edits: int = 0
    summary_request: str = DEFAULT_SUMMARY_REQUEST
    summary_prefix: str = DEFAULT_SUMMARY_PREFIX

    def __post_init__(self):
        if self.strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"rollout.context={self.strategy!r}: expected one of {CONTEXT_STRATEGIES}")
        if self.keep_turns < 0:
            raise ValueError(f"rollout.context_keep_turns={self.keep_turns}: expected >= 0")
        if not 0.0 < self.trigger <= 1.0:
            raise ValueError(f"rollout.context_trigger={self.trigger}: expected in (0, 1]")
        if self.max_edits < 0:
            raise ValueError(f"rollout.context_max_edits={self.max_edits}: expected >= 0 (0 = no limit)")


def head_length(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many leading messages are the episode's head (everything before the first reply)."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return i
    return len(messages)


def _head(settings: ContextSettings, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The episode's head without an earlier edit's note or summary (an edited conversation is
    edited again from its original head, so notes and summaries never pile up)."""
    head = [dict(m) for m in messages[:head_length(messages)]]
    while head and head[-1].get("role") == "user" and len(head) > 1 and (
            head[-1].get("content") == settings.note or str(head[-1].get("content", "")).startswith(
                settings.summary_prefix)):
        head.pop()
    return head


def should_edit(settings: ContextSettings, next_context_tokens: int, max_context: int, edits: int = 0) -> bool:
    """Whether a context of `next_context_tokens` passes the strategy's trigger, in an episode that
    has been edited `edits` times so far."""
    if settings.max_edits and edits >= settings.max_edits:
        return False
    return settings.strategy != "none" and next_context_tokens > settings.trigger * max_context


def with_summary_request(settings: ContextSettings, result: str) -> str:
    """summarize: the tool result's text followed by the request for a summary."""
    return f"{result}\n\n{settings.summary_request}"


def after_summary(settings: ContextSettings, messages: Sequence[Mapping[str, Any]], summary: str) -> list[dict]:
    """summarize: the conversation the episode continues from once the policy wrote `summary` —
    the head, then the summary as a user message."""
    return [*_head(settings, messages), {"role": "user", "content": f"{settings.summary_prefix}{summary}"}]


def default_summary(observations: Sequence[str]) -> str:
    """A scripted expert's summary when its environment gives none (`expert.summarize`): the latest
    observation, which is what a Markov task needs to go on."""
    return observations[-1] if observations else ""


def edited(settings: ContextSettings, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The conversation the episode continues from (a new list; `messages` is not changed), for
    the strategies that edit without the policy (summarize: `after_summary`).

    messages: the whole conversation so far, ending with a tool result: the head, then pairs of
    (assistant reply, result)."""
    head = _head(settings, messages)
    turns = [dict(m) for m in messages[head_length(messages):]]
    note = {"role": "user", "content": settings.note}
    if settings.strategy == "discard_all":
        return [*head, note]
    if settings.strategy == "summarize":
        raise ValueError("summarize edits through the policy's summary turn (after_summary), not edited()")
    if settings.strategy == "keep_recent":
        kept = turns[len(turns) - 2 * settings.keep_turns:] if settings.keep_turns else []
        if len(kept) == len(turns):
            return [dict(m) for m in messages]  # nothing to drop
        return [*head, note, *kept]
    return [dict(m) for m in messages]
