"""Sub-agents: an orchestrator's `delegate` calls run episodes of a frozen policy (Kimi K2.5's Agent
Swarm, trained with PARL: only the orchestrator learns; the sub-agents stay frozen, so credit
assignment stays tractable and their skills are not eroded).

The orchestrator calls `delegate` with a sub-task's text,
`{"name": "delegate", "arguments": {"task": ...}}`, one or several calls in one reply. Each call
runs a sub-agent episode with a fresh context: `SubAgents.make_task(text, parent)` gives its task
and environment (`build.build_subagents`: the orchestrator's environment's `subtask(parent, text)`,
e.g. a chain of the parent task's log), and it samples from `SubAgents.sampler`, a sampler whose weights the learner never
updates (a pinned copy, or another checkpoint). The calls of one reply run concurrently; each
sub-agent's final answer comes back as that call's tool result, in call order. The sub-agents'
tokens never enter the orchestrator's trajectory — only the results do, as context (mask 0) — and
each sub-agent's trajectory is kept in the orchestrator's turn record (`"delegations"`) for
analysis, never for the learner.

Limits (`DelegationLimits`), per orchestrator episode, all levels counted: `max_depth` levels of
sub-agents (1: sub-agents cannot delegate), `max_subagents` sub-agent episodes, and
`token_budget` tokens sampled by all of them together. A call past a limit gets an error result
and runs nothing; a sub-agent that spends the last of the budget ends ('delegation_budget').
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from jaxrl_agent.envs import tool_protocol as tp

DELEGATE_TOOL = tp.ToolSpec(
    name="delegate",
    description=("Run a sub-agent with a fresh context on a sub-task; its final answer comes back as this "
                 "call's result. Several calls in one reply run at once."),
    parameters={"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"],
                "additionalProperties": False})


@dataclasses.dataclass(frozen=True)
class DelegationLimits:
    """Per orchestrator episode: levels of sub-agents (1: they cannot delegate), sub-agent episodes
    in all, and tokens all of them may sample together."""

    max_depth: int = 1
    max_subagents: int = 4
    token_budget: int = 1024

    def __post_init__(self):
        for name in ("max_depth", "max_subagents", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"delegation.{name}={getattr(self, name)}: expected >= 1")


@dataclasses.dataclass(frozen=True)
class SubAgents:
    """What `delegate` calls run on. sampler: a frozen policy's sampler. make_task(text, parent
    task) -> (task, episode environment) of a sub-task; it raises on a text that names none. settings: the sub-agents' `EpisodeSettings` (their turns,
    sampling and context). tokenizer / template: the sub-agents' (a frozen checkpoint may have its
    own)."""

    sampler: Any
    make_task: Callable[[str, Any], tuple[Any, Any]]
    settings: Any
    tokenizer: Any
    template: Any
    limits: DelegationLimits = DelegationLimits()


class Ledger:
    """One orchestrator episode's delegation so far, shared by its sub-agents at every level: the
    sub-agent episodes started and the tokens they sampled. As an episode budget (`grant`,
    `spend`), it caps each sub-agent sampler call at what is left of the token budget; a grant is
    reserved until its call's tokens are spent (sub-agents sample at once: two calls must not be
    granted the same tokens)."""

    def __init__(self, limits: DelegationLimits, turns=()):
        """`turns`: a resumed episode's recorded turns; the sub-agents they ran count."""
        self.limits = limits
        done = list(all_delegations(turns))
        self.started = len(done)
        self.tokens = sum(int(d.get("sampled_tokens", 0)) for d in done)
        self.reserved = 0
        self._grants: dict = {}  # the asyncio task of an episode -> its outstanding grant

    def refusal(self, depth: int) -> str | None:
        """Why a `delegate` call made at `depth` (0 = the orchestrator) runs nothing, or None."""
        if depth >= self.limits.max_depth:
            return f"sub-agents at depth {depth} cannot delegate (max_depth {self.limits.max_depth})"
        if self.started >= self.limits.max_subagents:
            return f"no sub-agents left (at most {self.limits.max_subagents} per episode)"
        if self.tokens >= self.limits.token_budget:
            return f"the sub-agents' token budget is spent ({self.limits.token_budget} per episode)"
        return None

    async def grant(self, n: int, progress=None) -> int:
        del progress
        given = max(min(n, self.limits.token_budget - self.tokens - self.reserved), 0)
        self.reserved += given
        self._grants[asyncio.current_task()] = given
        return given

    def spend(self, n: int) -> None:
        self.reserved -= self._grants.pop(asyncio.current_task(), 0)
        self.tokens += n

    @property
    def spent(self) -> bool:
        """Nothing left to grant: the budget is sampled or reserved by calls in flight."""
        return self.tokens + self.reserved >= self.limits.token_budget


def scripted_subagent(make_env: Callable[[str], Any] | None = None) -> Callable[[Any, str], str]:
    """A scripted sub-agent for SFT demonstrations (`episode.expert_trajectory(delegate=)`):
    `answer(parent task, text)` makes the sub-task with the parent's environment's `subtask` and
    returns the answer its environment's scripted expert gives (raises where there is none).
    `make_env(name)`: a fresh environment (default `envs.make`)."""
    from jaxrl_agent import envs

    make_env = make_env or envs.make

    def answer(parent, text: str) -> str:
        sub = make_env(parent.env).subtask(parent, text)
        step, _, _ = envs.run_episode(make_env(sub.env), sub, envs.expert_policy(sub.env))
        if step.info.get("answer") is None:
            raise ValueError(f"the scripted expert of {sub.env!r} ended {sub.id!r} without an answer")
        return str(step.info["answer"])

    return answer


def delegate_calls(action: str) -> list[str | tp.ToolCallError] | None:
    """The sub-tasks of a reply that calls only `delegate` (one or several calls): each call's task
    text, or the error of a malformed one; None when the reply is for the environment (no
    `delegate` call, or other tools or an answer beside it: the environment sees it)."""
    parsed = tp.parse_tool_calls(action)  # names only: the arguments are checked below
    if parsed.errors or parsed.answer is not None or not parsed.calls or \
            any(c.name != DELEGATE_TOOL.name for c in parsed.calls):
        return None
    out: list[str | tp.ToolCallError] = []
    for call in parsed.calls:
        problem = tp.validate_arguments(call.arguments, DELEGATE_TOOL.parameters)
        out.append(tp.ToolCallError(tp.format_tool_call(call), f"bad arguments for delegate: {problem}")
                   if problem else str(call.arguments["task"]))
    return out


def delegation_record(task_text: str, trajectory, depth: int) -> dict:
    """A sub-agent's episode as the orchestrator's turn record keeps it (JSON): its task, answer,
    success, end, turns, sampled tokens, depth, and the whole trajectory."""
    answer = next((t.get("answer") for t in reversed(trajectory.turns) if "answer" in t), None)
    return {"task": task_text, "answer": answer, "success": float(trajectory.reward_components.get("success", 0.0)),
            "finish_reason": trajectory.finish_reason, "turns": sum(1 for t in trajectory.turns if "error" not in t),
            "sampled_tokens": int(trajectory.loss_mask.sum()), "depth": depth,
            "critical_path_turns": critical_path_turns(trajectory.turns),
            "trajectory": trajectory.to_dict()}


def all_delegations(turns):
    """Every delegation record of an episode's turns, at every level (a sub-agent's own, nested in
    its trajectory's turns, after it)."""
    for turn in turns:
        for record in turn.get("delegations", ()):
            yield record
            yield from all_delegations((record.get("trajectory") or {}).get("turns", ()))


def critical_path_turns(turns) -> int:
    """The longest chain of dependent turns of an episode: each of its turns, plus, for a turn that
    delegated, the longest of its sub-agents' own critical paths (they ran at once)."""
    total = 0
    for turn in turns:
        if "error" in turn:
            continue
        subs = turn.get("delegations", ())
        total += 1 + max((int(d.get("critical_path_turns", d.get("turns", 0))) for d in subs), default=0)
    return total


def total_turns(turns) -> int:
    """All turns of an episode and of its sub-agents, at every level."""
    return sum(1 + sum(_turns_of(d) for d in turn.get("delegations", ())) for turn in turns if "error" not in turn)


def _turns_of(delegation: dict) -> int:
    trajectory = delegation.get("trajectory")
    if trajectory is None:
        return int(delegation.get("turns", 0))
    return total_turns(trajectory.get("turns", ()))
