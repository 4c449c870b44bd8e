"""Tokenizers and the turn template."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_agent import tokenizer as tok
from tests import hf_reference

CONVERSATION = [
    {"role": "system", "content": "You can call calc."},
    {"role": "user", "content": "Q: 17*23+5=?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"expr": "17*23+5"}}</tool_call>'},
    {"role": "tool", "content": "<tool_result>396</tool_result>"},
    {"role": "assistant", "content": "<answer>396</answer>"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    hf_reference.train_tiny_hf_tokenizer(folder)
    return tok.HFTokenizer.from_file(str(folder))


def test_char_tokenizer_round_trips_and_specials_are_single_ids():
    t = tok.CharTokenizer()
    text = 'Q: 17*23+5=?\n<tool_call>{"name": "calc"}</tool_call><|im_end|>'
    ids = t.encode(text)
    assert t.decode(ids) == text
    assert ids.count(t.token_to_id("<tool_call>")) == 1
    assert t.encode("</tool_call>") == [t.token_to_id("</tool_call>")]
    assert t.eos_id == t.token_to_id("<|im_end|>")
    assert isinstance(t, tok.Tokenizer)
    assert all(0 <= i < t.vocab_size for i in ids)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=tok.DEFAULT_ALPHABET))
def test_char_tokenizer_round_trips_any_in_alphabet_text(text):
    t = tok.CharTokenizer()
    assert t.decode(t.encode(text)) == text


def test_char_tokenizer_words_are_single_ids_longest_first():
    t = tok.CharTokenizer()
    call = '{"name":"calc","arguments":{"expr":"1+2"}}'
    ids = t.encode(call)
    assert [t.decode([i]) for i in ids] == ['{"name":"', "calc", '","arguments":{"', "expr", '":"', "1", "+", "2",
                                            '"}}']
    assert t.encode("users") == [t.token_to_id("user"), t.token_to_id("s")]
    assert t.vocab_size == len(tok.DEFAULT_SPECIAL_TOKENS) + len(tok.DEFAULT_ALPHABET) + len(tok.DEFAULT_WORDS)
    # Without words the tokenizer is purely character level.
    assert len(tok.CharTokenizer(words=()).encode(call)) == len(call)
    with pytest.raises(ValueError, match="word 'x'"):
        tok.CharTokenizer(words=("x",))


def test_char_tokenizer_unknown_characters_and_bad_ids():
    t = tok.CharTokenizer()
    assert t.encode("é") == [t.token_to_id("<unk>")]
    with pytest.raises(ValueError, match="token id 9999 is outside"):
        t.decode([9999])


def test_hf_adapter_round_trips(hf_tokenizer):
    assert isinstance(hf_tokenizer, tok.Tokenizer)
    for text in ["the quick brown fox", "Q: 17*23+5=? answer 396", "unseen wörds ✓"]:
        assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text
    assert hf_tokenizer.encode("<|im_end|>") == [hf_tokenizer.eos_id]
    assert hf_tokenizer.pad_id == hf_tokenizer.token_to_id("<|endoftext|>")


def _expected_mask_by_reference(messages, t, template):
    """Reference: build the mask from the rendered segments' known lengths, piece by piece."""
    mask = []
    for m in messages:
        mask += [0] * len(template.header_ids(m["role"], t))
        flag = 1 if m["role"] == "assistant" else 0
        mask += [flag] * (len(t.encode(m["content"])) + len(template.end_ids(t)))
        mask += [0] * len(t.encode(template.separator))
    return mask


@pytest.mark.parametrize("which", ["char", "hf"])
def test_turn_template_assistant_mask_is_exact(which, hf_tokenizer):
    t = tok.CharTokenizer() if which == "char" else hf_tokenizer
    template = tok.CHATML
    rendered = template.render(CONVERSATION, t)
    assert rendered.ids.dtype == np.int32 and rendered.ids.shape == rendered.assistant_mask.shape
    np.testing.assert_array_equal(rendered.assistant_mask, _expected_mask_by_reference(CONVERSATION, t, template))
    # The masked ids decode to exactly the assistant turns, each with its end marker.
    assistant_text = t.decode(rendered.ids[rendered.assistant_mask == 1])
    assert assistant_text == "".join(m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant")
    # And the whole rendering decodes to the ChatML text.
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert t.decode(rendered.ids) == chatml


def test_sampled_token_ids_are_kept_verbatim():
    t = tok.CharTokenizer()
    # The assistant's ids enter the rendering as they are, never via decode -> encode.
    sampled = tuple(t.encode("abc")) + (t.token_to_id("<tool_call>"), t.eos_id)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "token_ids": sampled}]
    rendered = tok.CHATML.render(messages, t)
    np.testing.assert_array_equal(rendered.ids[rendered.assistant_mask == 1], sampled)
    # A reply cut off before its end marker gets the marker from the template (not trained).
    cut = sampled[:-1]
    rendered = tok.CHATML.render([{"role": "assistant", "token_ids": cut}], t)
    np.testing.assert_array_equal(rendered.ids[rendered.assistant_mask == 1], cut)
    assert t.eos_id in rendered.ids[rendered.assistant_mask == 0].tolist()


def test_generation_prompt_and_llama3_template():
    t = tok.CharTokenizer()
    rendered = tok.CHATML.render(CONVERSATION[:2], t, add_generation_prompt=True)
    assert t.decode(rendered.ids).endswith("<|im_start|>assistant\n")
    prompt_len = len(tok.CHATML.generation_prompt_ids(t))
    assert prompt_len == 3  # '<|im_start|>', 'assistant' and '\n' are one id each
    assert rendered.assistant_mask[-prompt_len:].sum() == 0
    llama = tok.make_template("llama3")
    assert llama.header_ids("tool", t) == t.encode("<|start_header_id|>ipython<|end_header_id|>\n\n")


def test_bad_messages_and_names_fail_clearly():
    with pytest.raises(ValueError, match="role 'robot'"):
        tok.CHATML.render([{"role": "robot", "content": "x"}], tok.CharTokenizer())
    with pytest.raises(ValueError, match="exactly one of content and token_ids"):
        tok.Message(role="assistant")
    with pytest.raises(ValueError, match="only assistant"):
        tok.Message(role="user", token_ids=(1, 2))
    with pytest.raises(ValueError, match="'sentencepiece' is not one of"):
        tok.make_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="template 'alpaca'"):
        tok.make_template("alpaca")
