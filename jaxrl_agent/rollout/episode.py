"""One episode as an asyncio coroutine: sample -> parse -> environment step -> append ids -> sample.

The episode's token sequence is built from ids only: the rendered prompt, the sampler's ids (kept
exactly, with their log-probs and versions), and the template + observation ids between turns. The
action text handed to the environment is decoded from the sampled ids, but those ids — not a
re-encoding of the text — are what the learner trains on.

History (`EpisodeSettings.history`): with a model's own chat template ('template', the default),
each turn's context is the template's rendering of the conversation so far, as a deployment that
calls `apply_chat_template` every turn shows it. Where that rendering extends the sequence built so
far, the new ids are appended; where the template renders an earlier turn differently (Qwen3 with
thinking off drops each earlier reply's empty think block), the episode starts a new learner
sequence (`Trajectory.segment_starts`) from the re-rendered context, whose earlier replies are
context there (mask 0) — so every sequence is exactly what the sampler conditioned on, and the
policy is trained in the context it is deployed in. 'append' keeps one append-only sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from jaxrl_agent import tool_formats
from jaxrl_agent.envs import api as env_api
from jaxrl_agent.envs import tool_protocol
from jaxrl_agent.replay.trajectory import PartialRollout, Trajectory
from jaxrl_agent.rollout import context as context_lib
from jaxrl_agent.rollout import delegation as delegation_lib
from jaxrl_agent.sampling.types import PromptTooLongError, SamplingParams
from jaxrl_agent.tokenizer import Tokenizer, TurnTemplate


class EpisodeEnv(Protocol):
    """An environment seen by an episode: either in-process or through an EnvService."""

    async def reset(self, task: env_api.Task, seed: int) -> env_api.Observation: ...

    async def step(self, action: str) -> env_api.Step: ...

    async def close(self) -> None: ...


def run_coroutine(coroutine):
    """`asyncio.run(coroutine)`, also from a thread that already runs an event loop (a Jupyter or
    Colab kernel, an async application): there the coroutine runs to completion on a fresh loop in
    a helper thread, and this call blocks until it has."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="run_coroutine") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _failed(reason: str, err: BaseException | str) -> env_api.Step:
    return env_api.Step(env_api.Observation(""), 0.0, True,
                        {"finish_reason": reason, "success": False, "error": err if isinstance(err, str) else repr(err)})


class InProcessEnv:
    """An environment object in this process. With an `executor`, steps run on its threads, so a
    step that blocks (a slow tool) does not stall the other episodes on the event loop.

    Watchdog: a step that takes longer than `step_timeout_s` ends the episode as 'env_timeout'
    (the run goes on; the stuck thread is abandoned to finish or hang on its own — use the 'pool'
    service to have hung environments killed). An exception ends it as 'env_error'.
    """

    def __init__(self, env: env_api.Environment, executor=None, step_timeout_s: float | None = None):
        self.env = env
        self.executor = executor
        self.step_timeout_s = step_timeout_s

    async def reset(self, task, seed):
        return self.env.reset(task, seed)

    async def step(self, action):
        try:
            if self.executor is None:
                return self.env.step(action)
            call = asyncio.get_running_loop().run_in_executor(self.executor, self.env.step, action)
            return await asyncio.wait_for(call, self.step_timeout_s)
        except asyncio.TimeoutError:
            return _failed("env_timeout", f"step took longer than {self.step_timeout_s}s")
        except Exception as err:  # noqa: BLE001 - an environment bug ends the episode, recorded
            return _failed("env_error", err)

    async def close(self):
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 - a failing close must not lose the episode
            pass


class ServiceEnv:
    """An episode on an EnvService (local pool or remote servers). A service's coroutine calls
    (`areset`, `astep`, `aclose_episode`: `EnvPool`'s, on the event loop) are awaited directly;
    blocking ones run in threads. A service failure during a step (a server gone) ends the episode
    as 'env_crash'."""

    def __init__(self, service, env_name: str, env_kwargs: dict | None = None):
        self.service, self.env_name, self.env_kwargs = service, env_name, env_kwargs or {}
        self.episode_id = None

    async def _call(self, name: str, *args):
        coroutine = getattr(self.service, "a" + name, None)
        if coroutine is not None:
            return await coroutine(*args)
        return await asyncio.to_thread(getattr(self.service, name), *args)

    async def reset(self, task, seed):
        self.episode_id, observation = await self._call("reset", self.env_name, task, seed, self.env_kwargs)
        return observation

    async def step(self, action):
        try:
            return await self._call("step", self.episode_id, action)
        except Exception as err:  # noqa: BLE001 - the service failed: this episode ends, recorded
            self.episode_id = None
            return _failed("env_crash", err)

    async def close(self):
        if self.episode_id is not None:
            try:
                await self._call("close_episode", self.episode_id)
            except Exception:  # noqa: BLE001 - the episode is over either way
                pass


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    sampling: SamplingParams
    max_context: int  # tokens in the whole episode
    include_system_prompt: bool = False
    max_turns: int = 8
    tool_format: str = "env"  # how the policy sees tools, calls and results (`tool_formats`)
    # A thinking model's budget per turn: once a reply has spent this many tokens inside its
    # <think> block, the block is closed for it (template tokens, not trained) and it answers.
    max_think_tokens: int = 0  # 0 = no budget
    # 'template': each turn's context is the chat template's rendering of the conversation so far (a
    # new learner sequence where it rewrites earlier turns); 'append': one append-only sequence.
    history: str = "template"
    # How the conversation is edited when it outgrows the context (`rollout.context`).
    context: context_lib.ContextSettings = context_lib.ContextSettings()
    # The frozen sub-agents the policy's `delegate` calls run on (`rollout.delegation`; built from
    # `rollout.delegate`); None = no `delegate` tool.
    subagents: delegation_lib.SubAgents | None = None

    def __post_init__(self):
        if self.history not in HISTORY_MODES:
            raise ValueError(f"EpisodeSettings.history={self.history!r}: expected one of {HISTORY_MODES}")


HISTORY_MODES = ("template", "append")


def _renders_history(template, settings: EpisodeSettings) -> bool:
    """Whether turns' contexts come from re-rendering the conversation (a model's own chat template
    with history='template'); the built-in templates only append."""
    return settings.history == "template" and hasattr(template, "render_text")


def next_context(template, messages, tokens: list[int], segment_start: int, tokenizer: Tokenizer, *,
                 role: str, content: str, close_assistant: bool, rerender: bool) -> tuple[list[int], bool]:
    """(ids to add, whether they start a new learner sequence) after a turn whose result is a `role`
    message with `content`: the template's continuation appended to the current sequence
    (`tokens[segment_start:]`), or, when re-rendering the conversation (`messages`, its last message
    that result) does not extend that sequence, the whole re-rendered context."""
    if not rerender:
        return template.continuation_ids(role, content, tokenizer, close_assistant=close_assistant), False
    prompt = template.render(messages, tokenizer, add_generation_prompt=True).ids.tolist()
    current = tokens[segment_start:]
    if prompt[:len(current)] == current:
        return prompt[len(current):], False
    return prompt, True


def context_after_result(settings: context_lib.ContextSettings, template, messages, tokens: list[int],
                         segment_start: int, tokenizer: Tokenizer, *, close_assistant: bool, rerender: bool,
                         max_context: int, edits: int) -> tuple[list, list[int], bool, str]:
    """How an episode goes on after a tool result, for sampled and expert episodes alike:
    (the conversation, the ids to add, whether they start a new learner sequence, the edit).

    messages: the conversation so far, ending with that result. The edit is '' (the result is
    appended: `next_context`), 'summary_request' (summarize's trigger fired: the result carries the
    request and the next turn is the policy's summary), 'summary_due' (summarize with the `context`
    tool: the trigger would fire; the result is appended, and a scripted expert calls the tool next,
    while a sampled policy decides for itself) or 'edited' (keep_recent / discard_all: the edited
    conversation, re-rendered, as a new sequence). `max_context` <= 0 never edits.
    For summarize the trigger counts the request too, so that `(1 - trigger) × max_context` is the
    room left for the summary."""
    role, result = messages[-1]["role"], messages[-1]["content"]
    continuation, restart = next_context(template, messages, tokens, segment_start, tokenizer, role=role,
                                         content=result, close_assistant=close_assistant, rerender=rerender)
    next_tokens = (0 if restart else len(tokens) - segment_start) + len(continuation)
    if max_context <= 0 or settings.strategy == "none" or (settings.max_edits and edits >= settings.max_edits):
        return messages, continuation, restart, ""  # no edit can come: summarize's request is not rendered
    if settings.strategy == "summarize" and settings.tool:  # the policy asks itself (the `context` tool)
        due = context_lib.should_edit(settings, next_tokens, max_context, edits)
        return messages, continuation, restart, "summary_due" if due else ""
    if settings.strategy == "summarize":
        content = context_lib.with_summary_request(settings, result)
        requested = [*messages[:-1], {"role": role, "content": content}]
        request_ids, request_restart = next_context(template, requested, tokens, segment_start, tokenizer, role=role,
                                                    content=content, close_assistant=close_assistant,
                                                    rerender=rerender)
        request_tokens = (0 if request_restart else len(tokens) - segment_start) + len(request_ids)
        if not context_lib.should_edit(settings, request_tokens, max_context, edits):
            return messages, continuation, restart, ""
        return requested, request_ids, request_restart, "summary_request"
    if not context_lib.should_edit(settings, next_tokens, max_context, edits):
        return messages, continuation, restart, ""
    edited = context_lib.edited(settings, messages)
    if edited == messages:  # nothing to drop
        return messages, continuation, restart, ""
    return edited, template.render(edited, tokenizer, add_generation_prompt=True).ids.tolist(), True, "edited"


def _acted(turn: Mapping[str, Any]) -> bool:
    """Whether a turn record counts towards `max_turns`: every turn of the policy's choosing (a
    `context` tool call too), not summarize's requested summary."""
    return not turn.get("summary") or bool(turn.get("context_call"))


def _still_thinking(text: str) -> bool | None:
    """Whether a reply so far is inside its think block: True, False (it closed one or never
    opened one), or None (too short to tell)."""
    head = text.lstrip()
    if tool_formats.THINK_CLOSE in text:
        return False
    if head.startswith(tool_formats.THINK_OPEN):
        return True
    return None if tool_formats.THINK_OPEN.startswith(head) else False


def first_messages(first: env_api.Observation, template, fmt: tool_formats.ToolFormat, *,
                   include_system_prompt: bool):
    """(messages, template) of an episode's first turn in the policy's tool format: the system
    message when asked for, the task, and a template that renders the format's tool schemas
    (a model's own chat template; the built-in ones take no tools)."""
    messages = []
    system = fmt.system(first.system, first.instructions)
    if include_system_prompt and system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": first.role, "content": first.text})
    schemas = fmt.schemas(first.tools or ())
    if schemas is not None and hasattr(template, "with_tools"):
        template = template.with_tools(schemas)
    return messages, template


def observation_digest(text: str) -> str:
    """What a partial rollout keeps of each observation, to check a replayed environment."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass
class _Progress:
    """An episode so far (the coroutine's own, mutable): ids with their mask, log-probs and
    versions, where its learner sequences start, the conversation, the finished turns and their
    environment actions, and the current turn's counters. `suspended()` is its immutable record."""

    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    messages: list
    segment: int = 0  # where the current learner sequence begins
    starts: list[int] = dataclasses.field(default_factory=list)  # where the later ones began
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)
    digests: list[str] = dataclasses.field(default_factory=list)
    turn_start: int = 0
    turn_calls: int = 0
    turn_closed_think: int = 0
    suspensions: int = 0
    summarizing: bool = False  # the current turn is the policy's summary (context strategy 'summarize')

    def add(self, ids, *, logprobs=None, versions=None) -> None:
        """Appends ids: generated ones with their log-probs and versions, else context (mask 0)."""
        ids = list(ids)
        self.tokens += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)

    def suspended(self) -> PartialRollout:
        """Counts one more suspension and returns the episode's record at it."""
        self.suspensions += 1
        return PartialRollout(
            tokens=np.asarray(self.tokens, np.int32), loss_mask=np.asarray(self.mask, np.int32),
            sampler_logprobs=np.asarray(self.logprobs, np.float32), policy_version=np.asarray(self.versions, np.int32),
            turn_start=self.turn_start, segment_starts=tuple(self.starts), turns=tuple(dict(t) for t in self.turns),
            actions=tuple(self.actions), observation_digests=tuple(self.digests),
            messages=tuple(_json_message(m) for m in self.messages), turn_sampler_calls=self.turn_calls,
            turn_closed_think=self.turn_closed_think, suspensions=self.suspensions, summarizing=self.summarizing)

    @classmethod
    def resumed(cls, p: PartialRollout) -> "_Progress":
        return cls(tokens=p.tokens.tolist(), mask=p.loss_mask.tolist(), logprobs=p.sampler_logprobs.tolist(),
                   versions=p.policy_version.tolist(), messages=[dict(m) for m in p.messages],
                   segment=p.segment_starts[-1] if p.segment_starts else 0, starts=list(p.segment_starts),
                   turns=[dict(t) for t in p.turns], actions=list(p.actions), digests=list(p.observation_digests),
                   turn_start=p.turn_start, turn_calls=p.turn_sampler_calls, turn_closed_think=p.turn_closed_think,
                   suspensions=p.suspensions, summarizing=p.summarizing)


def _json_message(message: dict) -> dict:
    return {k: (list(v) if k == "token_ids" else v) for k, v in message.items()}


async def _replay_environment(env: EpisodeEnv, partial: PartialRollout) -> str | None:
    """Brings a freshly reset environment to a partial rollout's state by stepping it through the
    episode's actions; None if every observation matches the recorded one, else what differed."""
    for turn, (action, digest) in enumerate(zip(partial.actions, partial.observation_digests)):
        step = await env.step(action)
        if step.done or observation_digest(step.observation.text) != digest:
            return (f"turn {turn}: the environment {'ended the episode' if step.done else 'answered differently'} "
                    "on replay (not deterministic given its task and seed)")
    return None


async def run_episode(sampler, env: EpisodeEnv, task: env_api.Task, tokenizer: Tokenizer, template: TurnTemplate,
                      settings: EpisodeSettings, *, seed: int = 0, group_id: str = "", sample_index: int = 0,
                      budget=None, resume: PartialRollout | None = None,
                      subagents: delegation_lib.SubAgents | None = None, depth: int = 0,
                      ledger: delegation_lib.Ledger | None = None) -> Trajectory:
    """Runs one episode to its end and returns its trajectory.

    `budget` (an `EpisodeBudget`, optional) caps the tokens sampled per learner iteration (partial
    rollouts): each sampler call asks `await budget.grant(n, progress)` for at most n tokens —
    waiting, with the environment state kept, while this iteration's budget is spent; `progress()`
    is the episode's `PartialRollout` then, for the replay buffer — and a turn cut short by the
    budget is continued by the next call, so one turn may hold tokens of several versions.

    `resume` continues a suspended episode from its `PartialRollout` (after a restart): the
    environment is reset with the same task and seed and stepped through the recorded actions, then
    the episode goes on from its saved ids, log-probs and versions.

    `subagents` (a `delegation.SubAgents`; default `settings.subagents` for the orchestrator)
    gives the policy the `delegate` tool: a reply that calls it runs sub-agent episodes of a frozen
    policy, concurrently, and their answers are the calls' results (`rollout.delegation`); `depth`
    is this episode's level (0 = the orchestrator) and `ledger` the orchestrator episode's count of
    sub-agents and their tokens (a resumed episode's counts those its recorded turns ran).
    """
    if subagents is None and depth == 0:
        subagents = settings.subagents
    def ended_early(reason: str, error: str, progress: _Progress | None = None) -> Trajectory:
        p = progress or _Progress([], [], [], [], [])
        return Trajectory(tokens=np.asarray(p.tokens, np.int32), loss_mask=np.asarray(p.mask, np.int32),
                          sampler_logprobs=np.asarray(p.logprobs, np.float32),
                          policy_version=np.asarray(p.versions, np.int32), reward=0.0,
                          reward_components={"success": 0.0}, group_id=group_id, sample_index=sample_index,
                          env=task.env, task_id=task.id, finish_reason=reason, turns=[*p.turns, {"error": error}],
                          segment_starts=tuple(p.starts))

    try:
        first = await env.reset(task, seed)
    except Exception as err:  # noqa: BLE001 - a reset that fails is this episode's recorded end
        await env.close()
        return ended_early("env_reset_error", repr(err))
    fmt = tool_formats.get(settings.tool_format)
    ctx = settings.context
    if subagents is not None and ledger is None:
        ledger = delegation_lib.Ledger(subagents.limits, resume.turns if resume is not None else ())
    if subagents is not None and depth < subagents.limits.max_depth:
        first = env_api.with_runner_tool(first, delegation_lib.DELEGATE_TOOL)
    messages, template = first_messages(context_lib.advertised(ctx, first), template, fmt,
                                        include_system_prompt=settings.include_system_prompt)
    if resume is None:
        st = _Progress([], [], [], [], messages)
        st.add(template.render(messages, tokenizer, add_generation_prompt=True).ids)
    else:
        st = _Progress.resumed(resume)
        mismatch = await _replay_environment(env, resume)
        if mismatch is not None:
            await env.close()
            return ended_early("env_resume_mismatch", mismatch, st)
    rerender = _renders_history(template, settings)
    end_ids = template.end_ids(tokenizer)
    think_budget = settings.max_think_tokens
    close_think = tokenizer.encode(f"\n{tool_formats.THINK_CLOSE}\n\n") if think_budget > 0 else []

    async def sample_turn() -> tuple[list[int], bool, str]:
        """Samples the current turn to its end (possibly over several sampler calls): (its ids,
        whether the context's limit cut it, the last call's finish reason)."""
        ids = st.tokens[st.turn_start:]  # this turn's ids, possibly over several sampler calls
        cut, last_finish = False, "length"
        thinking: bool | None = None if think_budget > 0 else False
        while True:
            full_room = min(settings.sampling.max_tokens - len(ids), settings.max_context - (len(st.tokens) - st.segment))
            room = full_room
            if room <= 0:
                break
            if thinking is not False:
                thinking = _still_thinking(tokenizer.decode(ids)) if ids else None
                if thinking is not False and len(ids) >= think_budget:
                    if len(st.tokens) - st.segment + len(close_think) >= settings.max_context:
                        cut = True
                        break
                    # The budget is spent inside the block: close it for the policy, then let it answer.
                    ids += close_think
                    st.add(close_think)
                    st.turn_closed_think, thinking = 1, False
                    continue
                if thinking is not False:
                    room = min(room, think_budget - len(ids))
            wanted = room if budget is None else await budget.grant(room, st.suspended)
            if wanted <= 0:  # a budget with nothing left for this episode (a sub-agent's, spent)
                cut = True
                break
            try:
                completion = await sampler.generate(
                    st.tokens[st.segment:], dataclasses.replace(settings.sampling, max_tokens=wanted))
            except PromptTooLongError:
                cut = True
                break
            st.turn_calls += 1
            new = list(completion.token_ids)
            if budget is not None:
                budget.spend(len(new))
            ids += new
            st.add(new, logprobs=completion.logprobs, versions=completion.versions)
            last_finish = completion.finish_reason
            # Cut by this iteration's token budget or the think budget (not by the turn's or the
            # context's limit): resume the same turn with the next call.
            if not (completion.finish_reason == "length" and wanted < full_room):
                break
        return ids, cut, last_finish

    def go_on_after(ids, ended: bool, role: str, content: str) -> tuple[list[int], bool, int]:
        """After a reply (`ids`) and its result (a `role` message with `content`): the conversation
        grows by both, the context strategy may edit it, and (the ids to add, whether they start a
        new learner sequence, the next context's tokens) come back."""
        messages = [*st.messages, {"role": "assistant", "token_ids": ids}, {"role": role, "content": content}]
        st.messages, continuation, restart, edit = context_after_result(
            ctx, template, messages, st.tokens, st.segment, tokenizer, close_assistant=not ended,
            rerender=rerender, max_context=settings.max_context, edits=sum("context_edit" in t for t in st.turns))
        st.summarizing = edit == "summary_request"
        if edit == "edited":
            st.turns[-1]["context_edit"] = ctx.strategy
        return continuation, restart, (0 if restart else len(st.tokens) - st.segment) + len(continuation)

    reward, components, finish_reason, success = 0.0, {}, "max_turns", False
    continuing = resume is not None  # the first turn is the one the partial rollout was suspended in
    while sum(_acted(t) for t in st.turns) < settings.max_turns:
        if not continuing:
            st.turn_start, st.turn_calls, st.turn_closed_think = len(st.tokens), 0, 0
        continuing = False
        started = time.perf_counter()
        ids, cut, last_finish = await sample_turn()
        if not ids:
            finish_reason = "delegation_budget" if isinstance(budget, delegation_lib.Ledger) and budget.spent \
                else "context_limit"
            break
        ended = len(ids) >= len(end_ids) and ids[-len(end_ids):] == end_ids
        if cut and not ended:
            finish_reason = "context_limit"
            break
        text = tokenizer.decode(ids[:-len(end_ids)] if ended else ids)
        record = {"sampled_tokens": len(ids) - st.turn_closed_think * len(close_think),
                  "sample_seconds": time.perf_counter() - started, "sampler_calls": st.turn_calls,
                  "finish_reason": last_finish, **({"think_closed_by_budget": True} if st.turn_closed_think else {})}
        if st.summarizing:  # the policy's summary: the episode goes on from the head and it
            st.turns.append({**record, "summary": True, "token_span": [st.turn_start, len(st.tokens)],
                             "context_edit": ctx.strategy})
            st.summarizing = False
            st.messages = context_lib.after_summary(ctx, st.messages, tool_formats.strip_reasoning(text).strip())
            continuation = template.render(st.messages, tokenizer, add_generation_prompt=True).ids.tolist()
            restart, next_tokens = True, len(continuation)
        elif (call := context_lib.context_call(ctx, fmt.to_env(text))) is not None:
            edits = sum("context_edit" in t for t in st.turns)
            if isinstance(call, str) and not (ctx.max_edits and edits >= ctx.max_edits):
                # The policy's own edit (the `context` tool): its call is its summary, and the
                # episode goes on from the head and it; the environment never sees the call.
                st.turns.append({**record, "summary": True, "context_call": True,
                                 "token_span": [st.turn_start, len(st.tokens)], "context_edit": ctx.strategy})
                st.messages = context_lib.after_summary(ctx, st.messages, call)
                continuation = template.render(st.messages, tokenizer, add_generation_prompt=True).ids.tolist()
                restart, next_tokens = True, len(continuation)
            else:  # a malformed call, or no edits left: the tool's result says so, and the episode goes on
                error = call.message if not isinstance(call, str) else (
                    f"no context edits left (at most {ctx.max_edits} per episode)")
                st.turns.append({**record, "context_call_error": error})
                continuation, restart, next_tokens = go_on_after(
                    ids, ended, "tool", fmt.result(tool_protocol.format_tool_result(f"error: {error}")))
        elif subagents is not None and (calls := delegation_lib.delegate_calls(fmt.to_env(text))) is not None:
            results, delegations = await _delegate(subagents, ledger, calls, depth, parent=task, seed=seed,
                                                   turn=len(st.turns), group_id=group_id)
            st.turns.append({**record, "delegations": delegations})
            continuation, restart, next_tokens = go_on_after(ids, ended, "tool", fmt.result("".join(results)))
        else:
            action = fmt.to_env(text)
            step = await env.step(action)
            st.turns.append(record)
            if step.done:
                reward = float(step.reward)
                components = dict(step.info.get("reward_components", {}))
                finish_reason = step.info.get("finish_reason", "answer")
                success = bool(step.info.get("success", False))
                if step.info.get("answer") is not None:
                    st.turns[-1]["answer"] = str(step.info["answer"])
                break
            st.actions.append(action)
            st.digests.append(observation_digest(step.observation.text))
            continuation, restart, next_tokens = go_on_after(ids, ended, step.observation.role,
                                                             fmt.result(step.observation.text))
        if next_tokens >= settings.max_context:
            finish_reason = "context_limit"
            break
        if restart:
            st.segment = len(st.tokens)
            st.starts.append(st.segment)
        st.add(continuation)
    await env.close()
    components = {**components, "success": float(success)}
    return Trajectory(
        tokens=np.asarray(st.tokens, np.int32), loss_mask=np.asarray(st.mask, np.int32),
        sampler_logprobs=np.asarray(st.logprobs, np.float32), policy_version=np.asarray(st.versions, np.int32),
        reward=reward, reward_components=components, group_id=group_id, sample_index=sample_index,
        env=task.env, task_id=task.id, finish_reason=finish_reason, turns=st.turns, segment_starts=tuple(st.starts))


async def _delegate(subagents: delegation_lib.SubAgents, ledger: delegation_lib.Ledger, calls, depth: int, *,
                    parent: env_api.Task, seed: int, turn: int, group_id: str) -> tuple[list[str], list[dict]]:
    """Runs a reply's `delegate` calls: every call the limits allow as a sub-agent episode, all at
    once; returns (each call's tool result, in call order; the sub-agents' records)."""
    results: list[str | None] = [None] * len(calls)
    runs = {}
    for i, call in enumerate(calls):
        if not isinstance(call, str):
            results[i] = f"error: {call.message}"
            continue
        refusal = ledger.refusal(depth)
        if refusal is not None:
            results[i] = f"error: {refusal}"
            continue
        try:
            task, env = subagents.make_task(call, parent)
        except Exception as err:  # noqa: BLE001 - a sub-task the environment cannot make is the call's error
            results[i] = f"error: no sub-task of {call[:80]!r}: {err}"
            continue
        ledger.started += 1
        runs[i] = (call, run_episode(subagents.sampler, env, task, subagents.tokenizer, subagents.template,
                                     subagents.settings, seed=(seed * 7919 + turn * 131 + i) % 2**31,
                                     group_id=f"{group_id}/sub{turn}.{i}", budget=ledger, subagents=subagents,
                                     depth=depth + 1, ledger=ledger))
    done = await asyncio.gather(*(episode for _, episode in runs.values()))
    delegations = []
    for (i, (text, _)), trajectory in zip(runs.items(), done):
        record = delegation_lib.delegation_record(text, trajectory, depth + 1)
        results[i] = record["answer"] if record["answer"] is not None else (
            f"error: the sub-agent ended without an answer ({trajectory.finish_reason})")
        delegations.append(record)
    return [tool_protocol.format_tool_result(r) for r in results], delegations


def _scripted_result(delegate, task, call) -> str:
    if not isinstance(call, str):
        return f"error: {call.message}"
    try:
        return delegate(task, call)
    except Exception as err:  # noqa: BLE001 - a sub-task that cannot be made is the call's error, as in run_episode
        return f"error: no sub-task of {call[:80]!r}: {err}"


def expert_trajectory(env: env_api.Environment, task: env_api.Task, expert, tokenizer: Tokenizer,
                      template: TurnTemplate, *, include_system_prompt: bool = False, seed: int = 0,
                      tool_format: str = "env", history: str = "template",
                      context: context_lib.ContextSettings = context_lib.ContextSettings(),
                      max_context: int = 0, delegate: Callable[[env_api.Task, str], str] | None = None
                      ) -> Trajectory:
    """A scripted-expert episode rendered exactly as a sampled one would be (SFT data): the
    expert's protocol actions are written in the policy's tool format, and its learner sequences are
    split where the template rewrites history, and where the context strategy edits the
    conversation (with `max_context` > 0), as a sampled episode's are. With 'summarize' the
    summary is `expert.summarize(task, observations, actions)` where the expert has one, else the
    latest observation (`context.default_summary`).

    `delegate(parent task, sub-task text) -> answer` (a scripted sub-agent,
    `delegation.scripted_subagent`) advertises the `delegate` tool as a run with sub-agents does,
    and answers the expert's delegate-only replies: each call's answer is its tool result, as a
    sampled episode's sub-agents' are (a sub-task it cannot make is the call's error)."""
    fmt = tool_formats.get(tool_format)
    first = context_lib.advertised(context, env.reset(task, seed))
    if delegate is not None:
        first = env_api.with_runner_tool(first, delegation_lib.DELEGATE_TOOL)
    messages, template = first_messages(first, template, fmt, include_system_prompt=include_system_prompt)
    tokens = list(template.render(messages, tokenizer, add_generation_prompt=True).ids)
    mask = [0] * len(tokens)
    rerender = history == "template" and hasattr(template, "render_text")
    segment, starts, edits, turns = 0, [], 0, []
    observations, actions = [first.text], []
    while True:
        action = expert(task, observations, actions)
        actions.append(action)
        ids = tokenizer.encode(fmt.from_env(action)) + template.end_ids(tokenizer)
        tokens += ids
        mask += [1] * len(ids)
        turns.append({"sampled_tokens": len(ids)})
        calls = delegation_lib.delegate_calls(action) if delegate is not None else None
        if calls is not None:
            results = "".join(tool_protocol.format_tool_result(_scripted_result(delegate, task, c)) for c in calls)
            step = env_api.Step(env_api.Observation(results, role="tool"), 0.0, False, {})
            turns[-1]["delegations"] = [{"task": c if isinstance(c, str) else c.raw, "scripted": True} for c in calls]
        else:
            step = env.step(action)
        observations.append(step.observation.text)
        if step.done:
            break
        messages = [*messages, {"role": "assistant", "token_ids": ids},
                    {"role": step.observation.role, "content": fmt.result(step.observation.text)}]
        messages, continuation, restart, edit = context_after_result(
            context, template, messages, tokens, segment, tokenizer, close_assistant=False, rerender=rerender,
            max_context=max_context, edits=edits)
        if edit in ("summary_request", "summary_due"):
            # As run_episode: the request and the expert's summary, or the expert's call of the
            # `context` tool with it; then the head and the summary.
            if restart:
                segment = len(tokens)
                starts.append(segment)
            tokens += continuation
            mask += [0] * len(continuation)
            summarize = getattr(expert, "summarize", None)
            summary = summarize(task, observations, actions) if summarize else context_lib.default_summary(
                observations)
            text = fmt.from_env(context_lib.context_call_action(summary)) if edit == "summary_due" else summary
            ids = tokenizer.encode(text) + template.end_ids(tokenizer)
            turns.append({"sampled_tokens": len(ids), "summary": True, "token_span": [len(tokens), len(tokens) + len(ids)],
                          "context_edit": context.strategy, **({"context_call": True} if edit == "summary_due" else {})})
            tokens += ids
            mask += [1] * len(ids)
            messages = context_lib.after_summary(context, messages, summary)
            continuation, restart = template.render(messages, tokenizer, add_generation_prompt=True).ids.tolist(), True
            edits += 1
        elif edit == "edited":
            edits += 1
            turns[-1]["context_edit"] = context.strategy
        if restart:
            segment = len(tokens)
            starts.append(segment)
        tokens += continuation
        mask += [0] * len(continuation)
    n = len(tokens)
    return Trajectory(tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, np.int32),
                      sampler_logprobs=np.zeros(n, np.float32), policy_version=np.zeros(n, np.int32),
                      reward=float(step.reward), reward_components=dict(step.info.get("reward_components", {})),
                      env=task.env, task_id=task.id, finish_reason=step.info.get("finish_reason", ""),
                      turns=turns, segment_starts=tuple(starts))
