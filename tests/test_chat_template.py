"""The model's own chat template (jaxrl_agent.chat_template) against transformers'
`apply_chat_template`, on Qwen's real vocabulary: Qwen3-style and Llama-3.1-style templates,
multi-turn with tool calls, tool results and thinking on and off, and the exact assistant mask."""

import json

import numpy as np
import pytest

from jaxrl_agent import chat_template, tokenizer as tokenizer_lib

TOOLS = ({"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


def _qwen3_messages(thinking: bool):
    first = ("<think>\nThe product needs the calculator.\n</think>\n\n" if thinking else "") + CALL
    last = ("<think>\nThe tool says 391; that is the answer.\n</think>\n\n" if thinking else "") + "ANSWER: 391"
    return [{"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "What is 17*23? Ünïcode too."},
            {"role": "assistant", "content": first},
            {"role": "tool", "content": "391"},
            {"role": "assistant", "content": last}]


LLAMA_MESSAGES = [{"role": "system", "content": "You are a careful agent."},
                  {"role": "user", "content": "What is 17*23?"},
                  {"role": "assistant", "content": '{"name": "calculator", "parameters": {"expression": "17*23"}}'},
                  {"role": "tool", "content": "391"},
                  {"role": "assistant", "content": "ANSWER: 391  "}]


def _hf_ids(folder, messages, **kwargs):
    import transformers

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids], hf


def _runs(mask):
    """[(start, stop)] of the runs of 1s in mask."""
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_qwen3_style_ids_equal_transformers_and_the_mask_covers_exactly_the_assistants_tokens(
        qwen3_tokenizer_dir, thinking, add_generation_prompt):
    messages = _qwen3_messages(thinking)
    if add_generation_prompt:
        messages = messages[:4]
    expected, hf = _hf_ids(qwen3_tokenizer_dir, messages, tools=list(TOOLS), enable_thinking=thinking,
                           add_generation_prompt=add_generation_prompt)
    tok = tokenizer_lib.HFTokenizer.from_file(qwen3_tokenizer_dir)
    template = chat_template.ChatTemplate.from_folder(qwen3_tokenizer_dir, tools=TOOLS,
                                                      options=(("enable_thinking", thinking),))
    rendered = template.render(messages, tok, add_generation_prompt=add_generation_prompt)
    assert rendered.ids.tolist() == expected
    assert template.end == "<|im_end|>" and template.end_ids(tok) == [151645]
    # One run of assistant tokens per assistant message: the content as the template renders it
    # (what the model writes after its generation prompt) and the end marker.
    runs = [hf.decode(rendered.ids[a:b]) for a, b in _runs(rendered.assistant_mask)]
    if thinking:
        wanted = [messages[2]["content"] + "<|im_end|>"] + ([messages[4]["content"] + "<|im_end|>"]
                                                           if not add_generation_prompt else [])
    else:  # the empty think block after the last query is the template's, not the model's
        wanted = [CALL + "<|im_end|>"] + (["ANSWER: 391<|im_end|>"] if not add_generation_prompt else [])
    assert runs == wanted
    assert "<tools>" in hf.decode(rendered.ids) and json.dumps(TOOLS[0]) in hf.decode(rendered.ids)


def test_sampled_ids_stay_ids_and_an_episode_built_turn_by_turn_equals_the_templates_rendering(qwen3_tokenizer_dir):
    """The rollout's way: prompt, sampled ids, then continuation ids per tool result. With thinking
    on the template keeps every turn's think block after the query, so the episode's tokens equal
    transformers' rendering of the whole conversation."""
    messages = _qwen3_messages(True)
    tok = tokenizer_lib.HFTokenizer.from_file(qwen3_tokenizer_dir)
    template = chat_template.ChatTemplate.from_folder(qwen3_tokenizer_dir, tools=TOOLS,
                                                      options=(("enable_thinking", True),))
    prompt = template.render(messages[:2], tok, add_generation_prompt=True)
    tokens, mask = prompt.ids.tolist(), prompt.assistant_mask.tolist()
    assert template.generation_prompt_ids(tok) == tok.encode("<|im_start|>assistant\n")
    for message in messages[2:]:
        if message["role"] == "assistant":
            sampled = tok.encode(message["content"]) + template.end_ids(tok)
            tokens, mask = tokens + sampled, mask + [1] * len(sampled)
        else:
            continuation = template.continuation_ids("tool", message["content"], tok, close_assistant=False)
            tokens, mask = tokens + continuation, mask + [0] * len(continuation)
    expected, _ = _hf_ids(qwen3_tokenizer_dir, messages, tools=list(TOOLS), enable_thinking=True)
    # transformers' rendering ends each turn with '\n' after the end marker; the episode stops at it.
    assert tokens == expected[:len(tokens)] and expected[len(tokens):] == tok.encode("\n")
    # Sampled ids given as ids are kept exactly, even where re-encoding the text would differ.
    odd = tok.encode("A") + tok.encode("NSWER: 391")  # a split the BPE of the whole text would not choose
    assert odd != tok.encode("ANSWER: 391")
    sampled = tok.encode(messages[4]["content"].split("ANSWER")[0]) + odd
    again = template.render([*messages[:4], {"role": "assistant", "token_ids": sampled + template.end_ids(tok)}], tok)
    assert again.ids[again.assistant_mask == 1].tolist()[-len(sampled) - 1:] == sampled + template.end_ids(tok)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_llama31_style_ids_equal_transformers(llama31_tokenizer_dir, add_generation_prompt):
    messages = LLAMA_MESSAGES[:4] if add_generation_prompt else LLAMA_MESSAGES
    expected, hf = _hf_ids(llama31_tokenizer_dir, messages, tools=list(TOOLS),
                           add_generation_prompt=add_generation_prompt)
    tok = tokenizer_lib.HFTokenizer.from_file(llama31_tokenizer_dir)
    template = chat_template.ChatTemplate.from_folder(llama31_tokenizer_dir, tools=TOOLS)
    rendered = template.render(messages, tok, add_generation_prompt=add_generation_prompt)
    assert rendered.ids.tolist() == expected
    assert template.end == "<|eot_id|>"
    runs = [hf.decode(rendered.ids[a:b]) for a, b in _runs(rendered.assistant_mask)]
    # The template trims message text: the trailing spaces the model wrote are not in the history.
    assert runs == [LLAMA_MESSAGES[2]["content"] + "<|eot_id|>"] + (
        [] if add_generation_prompt else ["ANSWER: 391<|eot_id|>"])
    continuation = template.continuation_ids("tool", "391", tok, close_assistant=True)
    assert hf.decode(continuation) == ("<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n391<|eot_id|>"
                                       "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_templates_that_cannot_be_segmented_are_named_in_the_error(qwen3_tokenizer_dir):
    tok = tokenizer_lib.HFTokenizer.from_file(qwen3_tokenizer_dir)
    no_content = chat_template.ChatTemplate("{% for m in messages %}{{ m.role }}<|im_end|>{% endfor %}", name="roles")
    with pytest.raises(chat_template.ChatTemplateError, match="chat template roles: an assistant message's content"):
        no_content.render([{"role": "user", "content": "hi"}], tok)
    no_end = chat_template.ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                                        name="plain")
    with pytest.raises(chat_template.ChatTemplateError, match="chat template plain: no end-of-turn marker"):
        no_end.end_ids(tok)
    broken = chat_template.ChatTemplate("{{ raise_exception('only user turns') }}", name="strict")
    with pytest.raises(chat_template.ChatTemplateError, match="chat template strict: rendering failed: only user"):
        broken.render_text([{"role": "user", "content": "hi"}])
    with pytest.raises(chat_template.ChatTemplateError, match="no chat_template in"):
        chat_template.ChatTemplate.from_folder(str(qwen3_tokenizer_dir) + "/missing")


def test_stop_ids_come_from_the_template_the_tokenizer_and_generation_config(qwen3_tokenizer_dir):
    import pathlib

    from jaxrl_agent import build, config_lib

    configs = pathlib.Path(__file__).resolve().parent.parent / "configs"
    config = config_lib.load_config(str(configs / "qwen3_0_6b_agentic.py"))
    config.checkpoint.hf_path = str(qwen3_tokenizer_dir)
    tok = build.build_tokenizer(config)
    assert build.stop_token_ids(config, tok) == (151645, 151643)  # <|im_end|>, then <|endoftext|>
    # The tiny default: the character tokenizer's eos, which is also ChatML's end marker here.
    tiny = config_lib.load_config(str(configs / "calculator_tiny.py"))
    char = build.build_tokenizer(tiny)
    assert build.stop_token_ids(tiny, char) == (char.eos_id,)


def test_templates_that_rewrite_earlier_turns_are_detected(qwen3_tokenizer_dir, llama31_tokenizer_dir):
    # Thinking off: the generation prompt's empty think block is gone from the re-rendered history.
    off = chat_template.ChatTemplate.from_folder(qwen3_tokenizer_dir, tools=TOOLS,
                                                 options=(("enable_thinking", False),))
    assert "<think>" in off.rewritten_history()
    on = chat_template.ChatTemplate.from_folder(qwen3_tokenizer_dir, options=(("enable_thinking", True),))
    assert on.rewritten_history() is None  # think blocks after the query are kept
    assert chat_template.ChatTemplate.from_folder(llama31_tokenizer_dir).rewritten_history() is None
