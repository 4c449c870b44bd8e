"""Native tool formats (jaxrl_agent.tool_formats): environments keep their protocol, the policy sees
its model's format. Round trips, a parser that never raises, and whole calculator episodes through
a Qwen3-style chat template on Qwen's real vocabulary — scripted expert (SFT data) and a sampled,
thinking rollout whose learner row equals, turn by turn, what the sampler conditioned on."""

import asyncio

import numpy as np
import pytest

from jaxrl_agent import chat_template, envs, rollout, tokenizer as tokenizer_lib, tool_formats
from jaxrl_agent.envs import tool_protocol as tp
from jaxrl_agent.sampling import Completion, SamplingParams

CALL = tp.format_tool_call(tp.ToolCall("calc", {"expr": "17*23+5"}))


@pytest.mark.parametrize("name", ["qwen3", "llama3.1"])
def test_an_experts_protocol_action_survives_the_models_form(name):
    fmt = tool_formats.get(name)
    native = fmt.from_env(CALL)
    assert native != CALL
    assert tp.parse_tool_calls(fmt.to_env(native)).calls == tp.parse_tool_calls(CALL).calls
    assert fmt.from_env("<answer>396</answer>") == "<answer>396</answer>"
    assert fmt.result("<tool_result>396</tool_result>") == "396"
    assert fmt.result("error: unknown tool") == "error: unknown tool"  # not a result: as it is
    assert fmt.schemas([{"name": "calc", "description": "d", "parameters": {}}]) == [
        {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {}}}]
    # Reasoning is never the action.
    assert fmt.to_env("<think>\n<tool_call>not this</tool_call>\n</think>\n\n<answer>7</answer>") == "<answer>7</answer>"
    assert fmt.to_env("<think>\nstill thinking") == ""


def test_qwen3_calls_are_the_protocols_tags_and_llama_calls_are_json():
    assert tool_formats.get("qwen3").from_env(CALL) == ('<tool_call>\n{"name": "calc", "arguments": {"expr": "17*23+5"}}'
                                                       '\n</tool_call>')
    llama = tool_formats.get("llama3.1")
    assert llama.from_env(CALL) == '{"name": "calc", "parameters": {"expr": "17*23+5"}}'
    assert llama.to_env('<|python_tag|>{"name": "calc", "parameters": {"expr": "1+1"}}') == \
        tp.format_tool_call(tp.ToolCall("calc", {"expr": "1+1"}))


@pytest.mark.parametrize("name", ["env", "qwen3", "llama3.1"])
@pytest.mark.parametrize("reply", ["", "{", '{"name": 3', "{\"parameters\": 1}", '{"name": "c", "parameters": [1]}',
                                   "[1, 2]", "<think>", "\x00\udcff", '{"name": "c"' + "[" * 5000, "<tool_call>{"])
def test_to_env_never_raises_and_the_environment_records_what_it_cannot_read(name, reply):
    action = tool_formats.get(name).to_env(reply)
    assert isinstance(action, str)
    env = envs.make("calculator")
    env.reset(env.sample_task(1, 2))
    step = env.step(action)  # a malformed turn, recorded by the environment, not an exception
    assert not step.info.get("success", False)


def _qwen3(folder, thinking):
    tok = tokenizer_lib.HFTokenizer.from_file(folder)
    return tok, chat_template.ChatTemplate.from_folder(folder, options=(("enable_thinking", thinking),))


def test_an_expert_episode_in_qwen3s_format(qwen3_tokenizer_dir):
    tok, template = _qwen3(qwen3_tokenizer_dir, False)
    env = envs.make("calculator")
    task = env.sample_task(5, 3)
    t = rollout.expert_trajectory(env, task, envs.expert_policy("calculator"), tok, template,
                                  include_system_prompt=True, tool_format="qwen3")
    assert t.reward_components["correctness"] == 1.0
    text = tok.decode(t.tokens)
    assert "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calc\"" in text
    assert "<|im_start|>user\n<tool_response>\n" in text and "<tool_result>" not in text
    assert "You can call tools" not in text  # the protocol's own tool description is not shown
    assert "Give the final answer as <answer>" in text
    # The assistant's tokens are exactly its two replies and their end markers.
    runs = np.split(t.tokens[t.loss_mask == 1], np.flatnonzero(np.diff(np.flatnonzero(t.loss_mask)) > 1) + 1)
    assert [tok.decode(r) for r in runs] == [tool_formats.get("qwen3").from_env(tp.format_tool_call(tp.ToolCall(
        "calc", {"expr": task.verifier["expr"]}))) + "<|im_end|>", f"<answer>{task.verifier['answer']}</answer><|im_end|>"]


class ScriptedQwen3:
    """Replies like Qwen3: the expert's action in Qwen3's form, after a think block when `think`
    (thinking on), or alone (thinking off: the generation prompt holds the empty think block)."""

    def __init__(self, tok, think=True):
        self.tok, self.think, self.prompts, self.replies = tok, think, [], []

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        text = self.tok.decode(prompt_ids)
        if "<tool_response>" not in text:
            expr = text.split("Q: ")[1].split("=?")[0]
            action = tool_formats.get("qwen3").from_env(tp.format_tool_call(tp.ToolCall("calc", {"expr": expr})))
        else:
            action = "<answer>" + text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0] + "</answer>"
        thought = f"<think>\nturn {len(self.prompts)}: use the tool.\n</think>\n\n" if self.think else ""
        ids = self.tok.encode(f"{thought}{action}<|im_end|>")
        self.replies.append(ids)
        return Completion(tuple(ids), tuple(-0.25 for _ in ids), tuple(7 for _ in ids), "stop")


def test_a_thinking_rollouts_learner_row_is_what_the_sampler_conditioned_on_turn_by_turn(qwen3_tokenizer_dir):
    import transformers

    tok, template = _qwen3(qwen3_tokenizer_dir, True)
    env = envs.make("calculator")
    task = env.sample_task(11, 2)
    sampler = ScriptedQwen3(tok)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=200), max_context=4000,
                                       max_turns=4, include_system_prompt=True, tool_format="qwen3")
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, tok, template, settings))
    assert t.reward_components["correctness"] == 1.0 and len(sampler.prompts) == 2
    tokens = t.tokens.tolist()
    for prompt, reply in zip(sampler.prompts, sampler.replies):
        # Each turn's context is a prefix of the row, and the reply follows it there, as sampled.
        assert tokens[:len(prompt)] == prompt and tokens[len(prompt):len(prompt) + len(reply)] == reply
        assert t.loss_mask[len(prompt):len(prompt) + len(reply)].all()
    assert int(t.loss_mask.sum()) == sum(len(r) for r in sampler.replies)  # think tokens are trained
    # And the row is the model's own rendering of the conversation (its template keeps the think
    # blocks of the turns after the query), as transformers renders it.
    messages = [{"role": "system", "content": env.instructions()}, {"role": "user", "content": task.prompt}]
    for k, reply in enumerate(sampler.replies):
        messages.append({"role": "assistant", "content": tok.decode(reply[:-1])})
        if k == 0:
            messages.append({"role": "tool", "content": str(task.verifier["answer"])})
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir)
    out = hf.apply_chat_template(messages, tools=tool_formats.get("qwen3").schemas([s.to_dict() for s in env.tools()]),
                                 enable_thinking=True, tokenize=True)
    expected = list(out["input_ids"] if hasattr(out, "keys") else out)
    assert tokens == expected[:len(tokens)] and hf.decode(expected[len(tokens):]) == "\n"


class EndlessThinker:
    """Thinks until stopped; once its think block is closed, answers."""

    def __init__(self, tok, answer):
        self.tok, self.answer, self.calls = tok, answer, []

    async def generate(self, prompt_ids, sampling):
        self.calls.append((list(prompt_ids), sampling.max_tokens))
        reply = self.tok.decode(prompt_ids).rsplit("<|im_start|>assistant\n", 1)[1]
        if "</think>" in reply:
            ids = self.tok.encode(f"<answer>{self.answer}</answer><|im_end|>")
            return Completion(tuple(ids), tuple(-0.1 for _ in ids), tuple(1 for _ in ids), "stop")
        ids = (self.tok.encode("<think>\n") if not reply else []) + self.tok.encode(" hmm") * sampling.max_tokens
        ids = ids[:sampling.max_tokens]
        return Completion(tuple(ids), tuple(-0.1 for _ in ids), tuple(1 for _ in ids), "length")


def test_the_think_budget_closes_the_block_with_template_tokens_and_the_policy_answers(qwen3_tokenizer_dir):
    tok, template = _qwen3(qwen3_tokenizer_dir, True)
    env = envs.make("calculator")
    task = env.sample_task(3, 1)
    sampler = EndlessThinker(tok, task.verifier["answer"])
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100), max_context=4000,
                                       max_turns=2, tool_format="qwen3", max_think_tokens=24)
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, tok, template, settings))
    assert t.reward_components["correctness"] == 1.0, t.finish_reason
    # The thinking call asked for at most the budget; the answer call for the turn's remaining room.
    assert sampler.calls[0][1] == 24 and sampler.calls[1][1] == 100 - 24 - len(tok.encode("\n</think>\n\n"))
    assert t.turns[0]["think_closed_by_budget"] and t.turns[0]["sampled_tokens"] == 24 + len(
        tok.encode("<answer>" + str(task.verifier["answer"]) + "</answer><|im_end|>"))
    close = tok.encode("\n</think>\n\n")
    start = len(sampler.calls[0][0])
    row = t.tokens.tolist()
    # The close sits right after the 24 thought tokens, untrained; the answer call conditioned on it.
    assert row[start + 24:start + 24 + len(close)] == close
    assert t.loss_mask[start:start + 24].all() and not t.loss_mask[start + 24:start + 24 + len(close)].any()
    assert sampler.calls[1][0] == row[:start + 24 + len(close)]


def _hf_prompt(folder, messages, tools, thinking):
    import transformers

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    out = hf.apply_chat_template(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=True,
                                 tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_thinking_off_each_turns_context_is_the_templates_and_a_rewrite_starts_a_new_sequence(qwen3_tokenizer_dir):
    """Qwen3 with thinking off drops each earlier reply's empty think block: the second turn's
    context is not an extension of the first sequence. The episode starts a second learner sequence
    from the re-rendered context; every sampler call saw exactly `apply_chat_template` of the
    conversation so far, and each sequence is that context followed by its reply (trained), the
    earlier reply being context (untrained) in the second one."""
    tok, template = _qwen3(qwen3_tokenizer_dir, False)
    assert template.rewritten_history() is not None
    env = envs.make("calculator")
    task = env.sample_task(11, 2)
    sampler = ScriptedQwen3(tok, think=False)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=200), max_context=4000,
                                       max_turns=4, include_system_prompt=True, tool_format="qwen3")
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, tok, template, settings))
    assert t.reward_components["correctness"] == 1.0 and len(sampler.prompts) == 2
    assert len(t.segments) == 2, t.segment_starts
    tools = tool_formats.get("qwen3").schemas([s.to_dict() for s in env.tools()])
    messages = [{"role": "system", "content": env.instructions()}, {"role": "user", "content": task.prompt}]
    tokens = t.tokens.tolist()
    for k, ((a, b), prompt, reply) in enumerate(zip(t.segments, sampler.prompts, sampler.replies)):
        assert prompt == _hf_prompt(qwen3_tokenizer_dir, messages, tools, False)  # what deployment shows
        assert tokens[a:b] == prompt + reply  # the sequence: that context, then the reply
        assert not t.loss_mask[a:a + len(prompt)].any() and t.loss_mask[a + len(prompt):b].all()
        messages.append({"role": "assistant", "content": tok.decode(reply[:-1])})
        if k == 0:
            messages.append({"role": "tool", "content": str(task.verifier["answer"])})
    assert "<think>\n\n</think>" in tok.decode(sampler.prompts[0]) and tok.decode(sampler.prompts[1]).count(
        "<think>\n\n</think>") == 1  # the first reply's empty block is gone from the second context
    # Packed for the learner: two sequences, positions restarting, exactly the replies trained.
    from jaxrl_agent import replay

    batch, rows = replay.pack([t], 4000)
    assert sorted(np.unique(batch.segment_ids[batch.segment_ids > 0]).tolist()) == [1, 2] and rows == [[0, 0]]
    assert int(batch.loss_mask.sum()) == sum(len(r) for r in sampler.replies)
    assert replay.validate(t, vocab_size=tok.vocab_size, max_length=max(b - a for a, b in t.segments)) is None
    # 'append' keeps one append-only sequence (what the sampler then sees in turn 2 is not the template's).
    appended = ScriptedQwen3(tok, think=False)
    one = asyncio.run(rollout.run_episode(appended, rollout.InProcessEnv(envs.make("calculator")), task, tok, template,
                                          rollout.EpisodeSettings(**{**settings.__dict__, "history": "append"})))
    assert one.segment_starts == () and appended.prompts[1] != sampler.prompts[1]


def test_an_expert_episode_with_thinking_off_is_split_as_a_sampled_one_is(qwen3_tokenizer_dir):
    tok, template = _qwen3(qwen3_tokenizer_dir, False)
    env = envs.make("calculator")
    task = env.sample_task(5, 3)
    t = rollout.expert_trajectory(env, task, envs.expert_policy("calculator"), tok, template,
                                  include_system_prompt=True, tool_format="qwen3")
    sampled = asyncio.run(rollout.run_episode(
        ScriptedQwen3(tok, think=False), rollout.InProcessEnv(envs.make("calculator")), task, tok, template,
        rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=200), max_context=4000,
                                max_turns=4, include_system_prompt=True, tool_format="qwen3")))
    assert t.segment_starts == sampled.segment_starts and t.tokens.tolist() == sampled.tokens.tolist()
    assert t.loss_mask.tolist() == sampled.loss_mask.tolist()


def test_history_mode_is_checked():
    with pytest.raises(ValueError, match="history='sometimes'"):
        rollout.EpisodeSettings(sampling=SamplingParams(), max_context=10, history="sometimes")
