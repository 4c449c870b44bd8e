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

With `tool` (summarize only) the policy itself decides when: it calls the `context` tool,
`{"name": "context", "arguments": {"summary": ...}}`, advertised with the environment's tools, and
the episode goes on from the head plus `summary_prefix` + that summary, as a new learner sequence;
the call is the policy's action (a turn, trained, marked as a summary for `learner.summary_weight`)
and never reaches the environment. The trigger then no longer asks: an episode whose policy never
calls the tool ends at `max_context`. A scripted expert demonstrates the call where the trigger
would fire (MiniMax Forge's context management as an action).

`max_edits` > 0 caps the edits per episode (after that the strategy no longer fires and an episode
that reaches `max_context` ends): training can allow fewer edits than deployment (test-time
scaling of the context).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from jaxrl_agent.envs import api as env_api
from jaxrl_agent.envs import tool_protocol as tp

CONTEXT_STRATEGIES = ("none", "keep_recent", "discard_all", "summarize")
DEFAULT_NOTE = "(Earlier turns removed.)"
DEFAULT_SUMMARY_REQUEST = "Summarize the context."
DEFAULT_SUMMARY_PREFIX = "Summary: "
CONTEXT_TOOL = tp.ToolSpec(
    name="context",
    description="Replace the conversation after the task with your summary of it; write what you still need.",
    parameters={"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"],
                "additionalProperties": False})


@dataclasses.dataclass(frozen=True)
class ContextSettings:
    """strategy: one of CONTEXT_STRATEGIES. keep_turns: turns kept by keep_recent. trigger: the
    share of max_context the next context may reach before it is edited. note: the user message
    that stands for what was removed. max_edits: edits per episode at most (0 = no limit).
    summary_request / summary_prefix: summarize's request after the tool result, and the text
    before the summary in the edited conversation. tool: summarize only — the policy asks for the
    edit itself by calling the `context` tool (CONTEXT_TOOL) instead of the trigger asking it."""

    strategy: str = "none"
    keep_turns: int = 2
    trigger: float = 0.75
    note: str = DEFAULT_NOTE
    max_edits: int = 0
    summary_request: str = DEFAULT_SUMMARY_REQUEST
    summary_prefix: str = DEFAULT_SUMMARY_PREFIX
    tool: bool = False

    def __post_init__(self):
        if self.strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"rollout.context={self.strategy!r}: expected one of {CONTEXT_STRATEGIES}")
        if self.keep_turns < 0:
            raise ValueError(f"rollout.context_keep_turns={self.keep_turns}: expected >= 0")
        if not 0.0 < self.trigger <= 1.0:
            raise ValueError(f"rollout.context_trigger={self.trigger}: expected in (0, 1]")
        if self.max_edits < 0:
            raise ValueError(f"rollout.context_max_edits={self.max_edits}: expected >= 0 (0 = no limit)")
        if self.tool and self.strategy != "summarize":
            raise ValueError(f"rollout.context_tool=True with rollout.context={self.strategy!r}: the context tool "
                             "writes a summary, so it needs rollout.context='summarize'")


def advertised(settings: ContextSettings, first: env_api.Observation) -> env_api.Observation:
    """An episode's first observation with the `context` tool among its tools (settings.tool)."""
    return env_api.with_runner_tool(first, CONTEXT_TOOL) if settings.tool else first


def context_call(settings: ContextSettings, action: str) -> str | tp.ToolCallError | None:
    """A reply's call of the `context` tool (settings.tool): its summary, the error of a malformed
    call of it, or None when the reply is for the environment (it calls no `context` tool, or it
    also calls other tools or answers: the environment sees it and records the unknown tool)."""
    if not settings.tool:
        return None
    parsed = tp.parse_tool_calls(action)  # names only: the arguments are checked below
    if parsed.errors or parsed.answer is not None or len(parsed.calls) != 1 or \
            parsed.calls[0].name != CONTEXT_TOOL.name:
        return None
    arguments = parsed.calls[0].arguments
    problem = tp.validate_arguments(arguments, CONTEXT_TOOL.parameters)
    if problem:
        return tp.ToolCallError(action, f"bad arguments for {CONTEXT_TOOL.name}: {problem}")
    return str(arguments["summary"])


def context_call_action(summary: str) -> str:
    """The protocol action that calls the `context` tool with `summary` (a scripted expert's)."""
    return tp.format_tool_call(tp.ToolCall(CONTEXT_TOOL.name, {"summary": summary}))


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
