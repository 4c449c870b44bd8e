"""Tokenizers and the turn template.

One `Tokenizer` protocol, two implementations:
  * `CharTokenizer` — built in, no files: one id per character of a fixed alphabet, plus special
    tokens (chat markers, tool-call tags) that are each a single id. The tiny default.
  * `HFTokenizer` — an adapter over a Hugging Face `tokenizers` `tokenizer.json`.

`TurnTemplate.render(messages, tokenizer)` turns a conversation (system / user / assistant / tool
messages) into token ids by concatenating the encodings of each segment — template markers and
contents are encoded separately, never as one string — and returns the mask of the ids the
assistant produced (its content and its end-of-turn marker). An assistant message may carry the
`token_ids` the sampler produced; they are used as they are. Sampled ids are never decoded and
encoded again: re-tokenization can change ids and would make the learner train on tokens the
sampler never emitted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the system needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with special-token strings mapped to their single ids; adds no BOS/EOS."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens rendered as their strings."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """Id of a single token (e.g. a special marker), or None if it is not one token."""
        ...


# The built-in vocabulary. Tags the agent emits often are single tokens: fewer decode steps and
# an unambiguous protocol.
DEFAULT_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_result>",
    "</tool_result>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
)
DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
# Multi-character words that are single ids, as a BPE vocabulary would merge them: the role names
# and the boilerplate of the JSON tool-call format. They cut a calculator episode from ~120 ids to
# ~60-80, which halves the learner's and the sampler's work per episode on a CPU.
DEFAULT_WORDS = (
    "system",
    "user",
    "assistant",
    "tool",
    '{"name":"',
    '","arguments":{"',
    '":"',
    '"}}',
    "calc",
    "expr",
)


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer: id = index in special_tokens + alphabet + words.

    Special tokens and words are single ids, matched longest first; everything else is one id per
    character. Characters outside the alphabet encode to `<unk>`, so only in-alphabet text
    round-trips. As with any subword vocabulary, encode(a) + encode(b) may differ from
    encode(a + b); sampled ids are therefore never re-encoded (see the module docstring).
    """

    alphabet: str = DEFAULT_ALPHABET
    special_tokens: tuple[str, ...] = DEFAULT_SPECIAL_TOKENS
    eos_token: str = "<|im_end|>"
    words: tuple[str, ...] = DEFAULT_WORDS

    def __post_init__(self):
        for required in ("<pad>", "<unk>", self.eos_token):
            if required not in self.special_tokens:
                raise ValueError(f"special_tokens must contain {required!r}, got {self.special_tokens}")
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("alphabet has repeated characters")
        overlap = set(self.alphabet) & set(self.special_tokens)
        if overlap:
            raise ValueError(f"single-character special tokens {sorted(overlap)} collide with the alphabet")
        for word in self.words:
            if len(word) < 2 or word in self.special_tokens or any(c not in self.alphabet for c in word):
                raise ValueError(f"word {word!r} must be 2+ characters of the alphabet and not a special token")
        if len(set(self.words)) != len(self.words):
            raise ValueError(f"words has repeated entries: {self.words}")
        vocab = list(self.special_tokens) + list(self.alphabet) + list(self.words)
        object.__setattr__(self, "_ids", {tok: i for i, tok in enumerate(vocab)})
        object.__setattr__(self, "_vocab", vocab)
        # Longest first so that e.g. '</tool_call>' is not read as '<' ... .
        specials = sorted(tuple(self.special_tokens) + tuple(self.words), key=len, reverse=True)
        object.__setattr__(self, "_special_re", re.compile("|".join(re.escape(s) for s in specials)))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eos_id(self) -> int:
        return self._ids[self.eos_token]

    @property
    def pad_id(self) -> int:
        return self._ids["<pad>"]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        unk = self._ids["<unk>"]
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(self._ids.get(c, unk) for c in text[pos:match.start()])
            ids.append(self._ids[match.group()])
            pos = match.end()
        ids.extend(self._ids.get(c, unk) for c in text[pos:])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._vocab):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self._vocab)})")
            out.append(self._vocab[i])
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)


class HFTokenizer:
    """Adapter over a Hugging Face `tokenizers.Tokenizer` (a `tokenizer.json`)."""

    def __init__(self, tokenizer, *, eos_token: str, pad_token: str | None = None):
        self._tok = tokenizer
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"eos token {eos_token!r} is not in the tokenizer's vocabulary")
        self._eos_id = eos
        pad = tokenizer.token_to_id(pad_token) if pad_token else None
        self._pad_id = eos if pad is None else pad

    @classmethod
    def from_file(cls, path: str, *, eos_token: str | None = None, pad_token: str | None = None) -> "HFTokenizer":
        """Loads `tokenizer.json` (a file, or a folder holding it and optionally
        `tokenizer_config.json`, whose `eos_token` / `pad_token` are used when not given)."""
        from tokenizers import Tokenizer as _HF

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {file}")
        extra: dict[str, Any] = {}
        cfg_file = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file) as f:
                extra = json.load(f)

        def token_str(value):
            return value.get("content") if isinstance(value, Mapping) else value

        eos_token = eos_token or token_str(extra.get("eos_token"))
        pad_token = pad_token or token_str(extra.get("pad_token"))
        if not eos_token:
            raise ValueError(f"no eos_token given and none in {cfg_file}")
        return cls(_HF.from_file(file), eos_token=eos_token, pad_token=pad_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


# --------------------------------------------------------------------------------------------
# Turn template
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Message:
    """One turn. Exactly one of `content` (text) and `token_ids` (ids as sampled) is set."""

    role: str
    content: str | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES}")
        if (self.content is None) == (self.token_ids is None):
            raise ValueError(f"a {self.role} message needs exactly one of content and token_ids")
        if self.token_ids is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry sampled token_ids, not {self.role!r}")

    @classmethod
    def coerce(cls, message: "Message | Mapping[str, Any]") -> "Message":
        if isinstance(message, Message):
            return message
        ids = message.get("token_ids")
        return cls(role=message["role"], content=message.get("content"),
                   token_ids=None if ids is None else tuple(int(i) for i in ids))


@dataclasses.dataclass(frozen=True)
class RenderedTurns:
    """ids [T] int32 and assistant_mask [T] int32 (1 where the assistant produced the id)."""

    ids: np.ndarray
    assistant_mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class TurnTemplate:
    """A chat template as segments: `{start}{role}{role_suffix}` content `{end}` `{separator}`.

    The assistant's content and its `end` marker are the assistant's own tokens (mask 1); the
    header and the separator belong to the template (mask 0). `end` is the stop token the sampler
    watches for.
    """

    start: str = "<|im_start|>"
    role_suffix: str = "\n"
    end: str = "<|im_end|>"
    separator: str = "\n"
    role_names: tuple[tuple[str, str], ...] = ()  # e.g. (("tool", "ipython"),) for Llama 3

    def _role(self, role: str) -> str:
        return dict(self.role_names).get(role, role)

    def header_ids(self, role: str, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(self.start) + tokenizer.encode(self._role(role) + self.role_suffix)

    def end_ids(self, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(self.end)

    def generation_prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The assistant header to append before sampling a reply."""
        return self.header_ids("assistant", tokenizer)

    def continuation_ids(self, role: str, content: str, tokenizer: Tokenizer, *, close_assistant: bool) -> list[int]:
        """Template ids that follow a sampled assistant turn: its end marker (when the sampler did
        not emit it, `close_assistant`), the separator, a `role` message with `content`, and the
        next assistant header. None of these ids are the assistant's."""
        ids = self.end_ids(tokenizer) if close_assistant else []
        ids += tokenizer.encode(self.separator)
        ids += self.header_ids(role, tokenizer) + tokenizer.encode(content) + self.end_ids(tokenizer)
        ids += tokenizer.encode(self.separator) + self.generation_prompt_ids(tokenizer)
        return ids

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        tokenizer: Tokenizer,
        *,
        add_generation_prompt: bool = False,
    ) -> RenderedTurns:
        ids: list[int] = []
        mask: list[int] = []

        def add(segment: Sequence[int], produced_by_assistant: bool):
            ids.extend(int(i) for i in segment)
            mask.extend([int(produced_by_assistant)] * len(segment))

        for raw in messages:
            message = Message.coerce(raw)
            is_assistant = message.role == "assistant"
            add(self.header_ids(message.role, tokenizer), False)
            if message.token_ids is not None:
                # Sampled ids as they are; they already end with the stop marker when the sampler
                # stopped on it, so the end marker is not added again.
                add(message.token_ids, True)
                end = self.end_ids(tokenizer)
                if list(message.token_ids[-len(end):]) != end:
                    add(end, False)
            else:
                add(tokenizer.encode(message.content), is_assistant)
                add(self.end_ids(tokenizer), is_assistant)
            add(tokenizer.encode(self.separator), False)
        if add_generation_prompt:
            add(self.generation_prompt_ids(tokenizer), False)
        return RenderedTurns(np.asarray(ids, np.int32), np.asarray(mask, np.int32))


CHATML = TurnTemplate()
LLAMA3 = TurnTemplate(
    start="<|start_header_id|>",
    role_suffix="<|end_header_id|>\n\n",
    end="<|eot_id|>",
    separator="",
    role_names=(("tool", "ipython"),),
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}


def make_tokenizer(kind: str, path: str | None = None, eos_token: str | None = None) -> Tokenizer:
    """'char' -> the built-in CharTokenizer; 'hf' -> HFTokenizer.from_file(path)."""
    if kind == "char":
        return CharTokenizer() if not eos_token else CharTokenizer(eos_token=eos_token)
    if kind == "hf":
        if not path:
            raise ValueError("tokenizer kind 'hf' needs a path to tokenizer.json or its folder")
        return HFTokenizer.from_file(path, eos_token=eos_token or None)
    raise ValueError(f"tokenizer kind {kind!r} is not one of ['char', 'hf']")


def make_template(name: str) -> TurnTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"turn template {name!r} is not one of {sorted(TEMPLATES)}") from None
