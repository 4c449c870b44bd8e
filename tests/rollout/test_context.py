"""Context management: the strategies' edits, and episodes that go on past an edit as new learner
sequences whose prefixes are exactly what the sampler conditioned on."""

import asyncio

import numpy as np
import pytest

from jaxrl_agent import envs, rollout, tool_formats
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.rollout import context, episode
from jaxrl_agent.sampling import Completion, SamplingParams
from tests.rollout.test_rollout import END, TOKENIZER

HEAD = [{"role": "system", "content": "tools"}, {"role": "user", "content": "Q: 1+1=?"}]
TURNS = [m for k in range(3) for m in ({"role": "assistant", "token_ids": [k, k]},
                                       {"role": "tool", "content": f"result {k}"})]


def test_each_strategy_edits_the_conversation_as_it_says():
    messages = HEAD + TURNS
    keep = context.edited(context.ContextSettings("keep_recent", keep_turns=1), messages)
    assert keep == [*HEAD, {"role": "user", "content": context.DEFAULT_NOTE}, *TURNS[-2:]]
    assert context.edited(context.ContextSettings("keep_recent", keep_turns=3), messages) == messages  # nothing to drop
    assert context.edited(context.ContextSettings("keep_recent", keep_turns=0), messages) == \
        [*HEAD, {"role": "user", "content": context.DEFAULT_NOTE}]
    assert context.edited(context.ContextSettings("discard_all", note="gone"), messages) == \
        [*HEAD, {"role": "user", "content": "gone"}]
    assert messages == HEAD + TURNS  # not changed in place
    # Edited again, a conversation keeps one note (or summary): they never pile up.
    for settings in (context.ContextSettings("keep_recent", keep_turns=1), context.ContextSettings("discard_all")):
        again = context.edited(settings, [*context.edited(settings, messages), *TURNS[:2]])
        assert sum(m.get("content") == context.DEFAULT_NOTE for m in again) == 1 and again[:2] == HEAD
    once = context.after_summary(context.ContextSettings("summarize"), messages, "s1")
    twice = context.after_summary(context.ContextSettings("summarize"), [*once, *TURNS[:2]], "s2")
    assert twice == [*HEAD, {"role": "user", "content": context.DEFAULT_SUMMARY_PREFIX + "s2"}]
    kept = [*HEAD, {"role": "user", "content": context.DEFAULT_NOTE}, *TURNS[:2]]
    assert context.edited(context.ContextSettings("keep_recent", keep_turns=1), kept) == kept  # nothing to drop
    assert not context.should_edit(context.ContextSettings("none"), 10_000, 100)
    assert context.should_edit(context.ContextSettings("keep_recent", trigger=0.5), 51, 100)
    assert not context.should_edit(context.ContextSettings("keep_recent", trigger=0.5), 50, 100)
    with pytest.raises(ValueError, match="rollout.context='fold'"):
        context.ContextSettings("fold")
    with pytest.raises(ValueError, match="context_trigger=0"):
        context.ContextSettings("keep_recent", trigger=0)


class ToolLoopSampler:
    """Calls the calculator on the task's expression at every turn (never answers), recording every
    prompt it is given."""

    def __init__(self):
        self.prompts = []

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        expr = TOKENIZER.decode(prompt_ids).split("Q: ")[1].split("=?")[0]
        ids = TOKENIZER.encode(envs.format_tool_call(envs.ToolCall("calc", {"expr": expr}))) + [END]
        ids = ids[: sampling.max_tokens]
        return Completion(tuple(ids), tuple(-0.5 for _ in ids), tuple(7 for _ in ids), "stop")


NOTE = "(cut)"


def _episode(strategy, max_context=90, max_turns=8):
    """The calculator allows 4 tool turns; each adds 32 tokens to a 21-token task: 149 in all."""
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100),
                                       max_context=max_context, max_turns=max_turns,
                                       context=context.ContextSettings(strategy, keep_turns=1, trigger=0.8,
                                                                       note=NOTE))
    sampler = ToolLoopSampler()
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, TOKENIZER, tok.CHATML, settings))
    return t, sampler.prompts


@pytest.mark.parametrize("strategy", ["keep_recent", "discard_all"])
def test_an_edited_episode_trains_each_sequence_on_exactly_what_the_sampler_saw(strategy):
    t, prompts = _episode(strategy)
    assert t.finish_reason == "max_turns" and len(t.turns) == 4  # it outlived its context
    assert len(t.segment_starts) >= 1 and sum("context_edit" in turn for turn in t.turns) == len(t.segment_starts)
    assert t.longest_segment <= 90
    calls = iter(prompts)
    for a, b in t.segments:
        sequence = t.tokens[a:b].tolist()
        # Each sampler call in this sequence saw exactly the sequence up to its reply.
        for start in np.flatnonzero(np.diff(np.r_[0, t.loss_mask[a:b]]) == 1):
            assert next(calls) == sequence[:start]
        # Every sequence starts with the task; after an edit, the note stands for what was removed.
        text = TOKENIZER.decode(sequence)
        assert "Q: " in text
        if a > 0:
            assert NOTE in text and t.loss_mask[a] == 0
    assert next(calls, None) is None  # and no call is unaccounted for
    # After an edit a sequence starts with the kept turns' results: one for keep_recent, none for discard_all.
    for a, _ in t.segments[1:]:
        context_part = t.tokens[a:a + int(np.argmax(t.loss_mask[a:] == 1))].tolist()
        assert TOKENIZER.decode(context_part).count("<tool_result>") == (1 if strategy == "keep_recent" else 0)


def test_without_a_strategy_the_same_episode_ends_at_the_context_limit():
    t, _ = _episode("none")
    assert t.finish_reason == "context_limit" and t.segment_starts == () and len(t.turns) < 4


def test_the_config_reaches_the_episodes_and_a_bad_strategy_is_refused(tmp_path):
    from jaxrl_agent import build
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    config.rollout.context, config.rollout.context_keep_turns = "keep_recent", 3
    assert build.episode_settings(config, 1.0).context == context.ContextSettings("keep_recent", keep_turns=3)
    config.rollout.context_tool = True
    with pytest.raises(build.ConfigError, match="context_tool=True with rollout.context='keep_recent'"):
        build.validate_config(config)
    config.rollout.context = "summarize"
    assert build.episode_settings(config, 1.0).context == context.ContextSettings("summarize", keep_turns=3, tool=True)
    config.rollout.context = "fold"
    with pytest.raises(build.ConfigError, match="rollout.context='fold': expected one of"):
        build.validate_config(config)


def test_demonstrations_are_edited_as_sampled_episodes_are():
    """SFT data under a context strategy: the expert's episode goes on after the edit as a new
    sequence that starts with the edited conversation's rendering, as a sampled one does."""
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    expert = envs.expert_policy("calculator")
    plain = rollout.expert_trajectory(env, task, expert, TOKENIZER, tok.CHATML)
    settings = context.ContextSettings("discard_all", trigger=0.8, note=NOTE)
    edited = rollout.expert_trajectory(env, task, expert, TOKENIZER, tok.CHATML, context=settings, max_context=60)
    assert plain.segment_starts == () and len(edited.segment_starts) == 1
    (start,) = edited.segment_starts
    first, _ = episode.first_messages(env.reset(task, 0), tok.CHATML, tool_formats.get("env"),
                                      include_system_prompt=False)
    head = tok.CHATML.render([*first, {"role": "user", "content": NOTE}], TOKENIZER, add_generation_prompt=True)
    np.testing.assert_array_equal(edited.tokens[start:start + len(head.ids)], head.ids)
    # The answer turn is the same demonstration in both: trained the same way after the edit.
    np.testing.assert_array_equal(edited.tokens[edited.loss_mask == 1][-20:], plain.tokens[plain.loss_mask == 1][-20:])
    assert edited.reward == plain.reward == 1.0
    # Unedited with the defaults: the demonstrations of the default run are unchanged.
    default = rollout.expert_trajectory(env, task, expert, TOKENIZER, tok.CHATML, max_context=60)
    np.testing.assert_array_equal(default.tokens, plain.tokens)


class SummarizingSampler(ToolLoopSampler):
    """ToolLoopSampler that, asked for a summary, writes 'expr <the task's expression>'."""

    async def generate(self, prompt_ids, sampling):
        text = TOKENIZER.decode(prompt_ids)
        if text.rfind(context.DEFAULT_SUMMARY_REQUEST) > text.rfind("<|im_start|>assistant") - 40 > 0:
            self.prompts.append(list(prompt_ids))
            expr = text.split("Q: ")[1].split("=?")[0]
            ids = (TOKENIZER.encode(f"expr {expr}") + [END])[: sampling.max_tokens]
            return Completion(tuple(ids), tuple(-0.25 for _ in ids), tuple(7 for _ in ids), "stop")
        return await super().generate(prompt_ids, sampling)


def _summarized_episode(max_edits=0, max_context=120, trigger=0.6):
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100),
                                       max_context=max_context, max_turns=8,
                                       context=context.ContextSettings("summarize", trigger=trigger, max_edits=max_edits))
    sampler = SummarizingSampler()
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, TOKENIZER, tok.CHATML, settings))
    return t, sampler.prompts, task


def test_summarize_trains_the_summary_and_goes_on_from_the_task_and_the_summary():
    t, prompts, task = _summarized_episode()
    summaries = [turn for turn in t.turns if turn.get("summary")]
    assert t.finish_reason == "max_turns" and len(t.turns) - len(summaries) == 4  # summaries are not env turns
    assert summaries and len(t.segment_starts) == len(summaries) == sum("context_edit" in turn for turn in t.turns)
    assert t.longest_segment <= 120
    expr = TOKENIZER.decode(t.tokens[:21].tolist()).split("Q: ")[1].split("=?")[0]
    calls = iter(prompts)
    for (a, b), (start, end) in zip(t.segments, t.summary_spans + [(None, None)]):
        sequence = t.tokens[a:b].tolist()
        for s in np.flatnonzero(np.diff(np.r_[0, t.loss_mask[a:b]]) == 1):
            assert next(calls) == sequence[:s]  # every call saw exactly its sequence so far
        if start is not None:
            # The summary is the last turn of its sequence: the policy's own tokens, trained, conditioned
            # on the whole context including the request.
            assert a < start < end == b and t.loss_mask[start:end].all()
            assert TOKENIZER.decode(t.tokens[start:end - 1].tolist()) == f"expr {expr}"
            assert context.DEFAULT_SUMMARY_REQUEST in TOKENIZER.decode(t.tokens[a:start].tolist())
        if a > 0:  # a later sequence: the task, then the summary as context
            text = TOKENIZER.decode(sequence)
            assert f"{context.DEFAULT_SUMMARY_PREFIX}expr {expr}" in text and "Q: " in text
            assert text.count("<tool_result>") <= 1 and t.loss_mask[a] == 0
    assert next(calls, None) is None


def test_max_edits_caps_the_edits_and_the_episode_then_grows_past_the_trigger():
    capped, _, _ = _summarized_episode(max_edits=1, max_context=110, trigger=0.4)
    free, _, _ = _summarized_episode(max_edits=0, max_context=110, trigger=0.4)
    assert sum("context_edit" in turn for turn in free.turns) >= 2
    assert sum("context_edit" in turn for turn in capped.turns) == 1 and len(capped.segment_starts) == 1
    a, b = capped.segments[-1]
    assert b - a > 0.4 * 110 + 32  # passed the trigger again, and was not edited
    assert not context.should_edit(context.ContextSettings("keep_recent", max_edits=2), 10_000, 100, edits=2)
    assert context.should_edit(context.ContextSettings("keep_recent", max_edits=2), 10_000, 100, edits=1)


def test_the_summary_weight_scales_only_the_summary_tokens_advantages():
    import dataclasses

    from jaxrl_agent import replay

    t, _, _ = _summarized_episode()
    t = dataclasses.replace(t, advantage=0.5)
    plain, _ = replay.pack([t], 128)
    weighted, _ = replay.pack([t], 128, summary_weight=3.0)
    in_summary = np.zeros(t.length, bool)
    for a, b in t.summary_spans:
        in_summary[a:b] = True
    # Rebuild each packed token's place in the trajectory from the packing's segments.
    ratio = np.asarray(weighted.advantages) / np.where(np.asarray(plain.advantages) == 0, 1, plain.advantages)
    trained = np.asarray(plain.loss_mask) == 1
    assert sorted(set(np.round(ratio[trained], 6))) == [1.0, 3.0]
    assert int((np.round(ratio[trained], 6) == 3.0).sum()) == int(in_summary.sum())
    assert np.isclose(np.asarray(plain.advantages)[trained], 0.5).all()


def test_a_partial_rollout_suspended_in_a_summary_keeps_that_it_was():
    from jaxrl_agent.replay import PartialRollout

    p = PartialRollout(tokens=np.arange(4, dtype=np.int32), loss_mask=np.array([0, 0, 1, 1], np.int32),
                       sampler_logprobs=np.zeros(4, np.float32), policy_version=np.array([-1, -1, 3, 3], np.int32),
                       turn_start=2, summarizing=True)
    assert PartialRollout.from_dict(p.to_dict()).summarizing
    assert not PartialRollout.from_dict({**p.to_dict(), "summarizing": False}).summarizing


def test_summarized_demonstrations_train_the_experts_summary():
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    expert = envs.expert_policy("calculator")
    settings = context.ContextSettings("summarize", trigger=0.6)
    t = rollout.expert_trajectory(env, task, expert, TOKENIZER, tok.CHATML, context=settings, max_context=80)
    assert len(t.segment_starts) >= 1
    (a, _), (b, _) = t.segments[0], t.segments[1]
    first = TOKENIZER.decode(t.tokens[a:b].tolist())
    assert context.DEFAULT_SUMMARY_REQUEST in first
    # The expert's summary (the latest observation, by default) is trained, then stands in the next sequence.
    trained = TOKENIZER.decode(t.tokens[a:b][t.loss_mask[a:b] == 1].tolist())
    second = TOKENIZER.decode(t.tokens[b:].tolist())
    assert context.DEFAULT_SUMMARY_PREFIX in second and "<tool_result>" in trained
    assert t.reward == 1.0


def test_summarize_counts_its_request_in_the_trigger():
    """The summary's room is what the trigger leaves: the context with the request is what is
    measured, so a result that fits under the trigger but not with the request is summarized."""
    settings = context.ContextSettings("summarize", trigger=0.5)
    messages = [*HEAD, {"role": "assistant", "token_ids": [5, 6]}, {"role": "tool", "content": "result 0"}]
    tokens = [0] * 40  # only its length counts for an appending template
    plain = 40 + len(tok.CHATML.continuation_ids("tool", "result 0", TOKENIZER, close_assistant=False))
    requested = 40 + len(tok.CHATML.continuation_ids("tool", context.with_summary_request(settings, "result 0"),
                                                     TOKENIZER, close_assistant=False))
    assert requested > plain

    def after(max_context):
        return episode.context_after_result(settings, tok.CHATML, messages, tokens, 0, TOKENIZER, close_assistant=False,
                                            rerender=False, max_context=max_context, edits=0)

    edited, ids, restart, edit = after(2 * plain)  # plain == trigger x max_context: only the request passes it
    assert edit == "summary_request" and not restart and len(ids) == requested - 40
    assert edited[-1]["content"].endswith(context.DEFAULT_SUMMARY_REQUEST) and messages[-1]["content"] == "result 0"
    assert after(2 * requested)[3] == ""  # room for the request too: no summary yet
    keep = context.ContextSettings("keep_recent", trigger=0.5, keep_turns=0)
    assert episode.context_after_result(keep, tok.CHATML, messages, tokens, 0, TOKENIZER, close_assistant=False,
                                        rerender=False, max_context=2 * plain, edits=0)[3] == ""


class ContextToolSampler(ToolLoopSampler):
    """ToolLoopSampler that calls the `context` tool itself once its context passes `at` tokens:
    with `summary` (a str), with bad arguments (None), or again and again (`always`)."""

    def __init__(self, at, summary="expr", always=False):
        super().__init__()
        self.at, self.summary, self.always = at, summary, always

    async def generate(self, prompt_ids, sampling):
        if len(prompt_ids) > self.at or self.always:
            self.prompts.append(list(prompt_ids))
            arguments = {"summary": self.summary} if self.summary is not None else {"note": 1}
            ids = TOKENIZER.encode(envs.format_tool_call(envs.ToolCall("context", arguments))) + [END]
            return Completion(tuple(ids), tuple(-0.25 for _ in ids), tuple(7 for _ in ids), "stop")
        return await super().generate(prompt_ids, sampling)


class CountingEnv(rollout.InProcessEnv):
    def __init__(self, env):
        super().__init__(env)
        self.actions = []

    async def step(self, action):
        self.actions.append(action)
        return await super().step(action)


def _tool_episode(sampler, max_edits=0, max_turns=8):
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100), max_context=1000,
                                       max_turns=max_turns, include_system_prompt=True,
                                       context=context.ContextSettings("summarize", trigger=0.5, max_edits=max_edits,
                                                                       tool=True))
    counting = CountingEnv(env)
    t = asyncio.run(rollout.run_episode(sampler, counting, task, TOKENIZER, tok.CHATML, settings))
    return t, counting.actions


def test_the_policy_edits_its_context_by_calling_the_context_tool():
    sampler = ContextToolSampler(at=650)  # the system prompt makes the task ~600 tokens: two tool turns, then the call
    t, actions = _tool_episode(sampler)
    calls = [turn for turn in t.turns if turn.get("context_call")]
    assert calls and all(turn["summary"] and turn["context_edit"] == "summarize" for turn in calls)
    assert len(t.segment_starts) == len(calls) and t.finish_reason == "max_turns"
    assert not any("context" in a for a in actions)  # the environment never sees the call
    assert len(actions) + len(calls) == len(t.turns) and len(actions) == 4  # the calculator allows 4 tool turns
    first = TOKENIZER.decode(sampler.prompts[0])
    assert '"name":"context"' in first  # advertised in the system prompt
    prompts = iter(sampler.prompts)
    for (a, b), (start, end) in zip(t.segments, t.summary_spans + [(None, None)]):
        sequence = t.tokens[a:b].tolist()
        for s in np.flatnonzero(np.diff(np.r_[0, t.loss_mask[a:b]]) == 1):
            assert next(prompts) == sequence[:s]
        if start is not None:  # the call is the sequence's last turn, trained, and marked as the summary
            assert end == b and t.loss_mask[start:end].all()
            assert TOKENIZER.decode(t.tokens[start:end].tolist()).startswith('<tool_call>{"name":"context"')
        if a > 0:
            text = TOKENIZER.decode(sequence)
            assert f"{context.DEFAULT_SUMMARY_PREFIX}expr" in text
            assert text.count("<tool_result>") - first.count("<tool_result>") <= 1  # the system prompt names it
    assert next(prompts, None) is None
    # No summary request is ever appended: the policy decides.
    assert context.DEFAULT_SUMMARY_REQUEST not in TOKENIZER.decode(t.tokens.tolist())


def test_a_bad_or_spent_context_call_gets_an_error_result_and_an_endless_one_is_bounded():
    t, actions = _tool_episode(ContextToolSampler(at=0, summary=None), max_turns=3)
    assert [turn.get("context_call_error", "") for turn in t.turns] == ["bad arguments for context: missing "
                                                                        "required argument 'summary'"] * 3
    assert actions == [] and t.segment_starts == () and t.finish_reason == "max_turns"
    assert TOKENIZER.decode(t.tokens.tolist()).count("<tool_result>error: bad arguments for context") == 3
    t, actions = _tool_episode(ContextToolSampler(at=0, always=True), max_edits=2, max_turns=5)
    assert sum(bool(turn.get("context_call")) for turn in t.turns) == 2 and len(t.segment_starts) == 2
    assert [turn.get("context_call_error") for turn in t.turns[2:]] == [
        "no context edits left (at most 2 per episode)"] * 3 and actions == []
    t, _ = _tool_episode(ContextToolSampler(at=0, always=True), max_turns=4)  # no cap: max_turns still ends it
    assert t.finish_reason == "max_turns" and len(t.turns) == 4


def test_without_the_tool_a_context_call_goes_to_the_environment():
    settings = context.ContextSettings("summarize")
    assert context.context_call(settings, context.context_call_action("x")) is None
    tool = context.ContextSettings("summarize", tool=True)
    assert context.context_call(tool, context.context_call_action("a <b> c")) == "a <b> c"
    mixed = context.context_call_action("x") + envs.format_tool_call(envs.ToolCall("calc", {"expr": "1"}))
    assert context.context_call(tool, mixed) is None  # the environment answers each call
    assert context.context_call(tool, context.context_call_action("x") + "<answer>2</answer>") is None
    with pytest.raises(ValueError, match="context_tool=True with rollout.context='keep_recent'"):
        context.ContextSettings("keep_recent", tool=True)
    first = envs.make("calculator").reset(envs.make("calculator").sample_task(0, 1))
    shown = context.advertised(tool, first)
    assert shown.tools[-1]["name"] == "context" and len(shown.tools) == len(first.tools) + 1
    assert first.system in shown.system and '"name":"context"' in shown.system
    assert context.advertised(settings, first) == first
    # A model's own tool format renders it among the tools, and reads its own form of the call.
    qwen = tool_formats.get("qwen3")
    assert qwen.schemas(shown.tools)[-1]["function"]["name"] == "context"
    assert context.context_call(tool, qwen.to_env(qwen.from_env(context.context_call_action("s")))) == "s"


def test_demonstrations_call_the_context_tool_where_the_trigger_would_fire():
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    expert = envs.expert_policy("calculator")
    settings = context.ContextSettings("summarize", trigger=0.6, tool=True)
    t = rollout.expert_trajectory(env, task, expert, TOKENIZER, tok.CHATML, context=settings, max_context=80)
    calls = [turn for turn in t.turns if turn.get("context_call")]
    assert calls and len(t.segment_starts) == len(calls) and t.reward == 1.0
    (start, end), b = t.summary_spans[0], t.segments[1][0]
    assert end == b and t.loss_mask[start:end].all()
    call = TOKENIZER.decode(t.tokens[start:end].tolist())
    assert context.context_call(settings, call.replace("<|im_end|>", "")) is not None
    assert context.DEFAULT_SUMMARY_REQUEST not in TOKENIZER.decode(t.tokens.tolist())
    assert context.DEFAULT_SUMMARY_PREFIX in TOKENIZER.decode(t.tokens[b:].tolist())
