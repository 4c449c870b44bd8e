"""A model's own chat template: the Jinja `chat_template` of its `tokenizer_config.json`, rendered
as Hugging Face `transformers` renders it (`apply_chat_template`), and cut into segments so that
sampled ids stay ids and the assistant mask is exact.

Rendering. The template runs in a sandboxed Jinja environment configured as transformers'
(`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII characters,
`raise_exception`, `strftime_now`), with `messages`, `tools` (OpenAI-style function schemas:
`{"type": "function", "function": {"name", "description", "parameters"}}`), `bos_token`,
`eos_token`, `add_generation_prompt` and the template's own switches (`enable_thinking`, ...).

Segments. A rendered conversation is template text between the assistant's spans. The span of
assistant message i is found by rendering once more with its content replaced by a sentinel:
the two texts agree up to where the content starts and again from where it ends (the template may
rewrite the content — Qwen3 splits `<think>` blocks out of it — but not what surrounds it), and
when the conversation's rendering begins with the generation prompt the sampler saw for that
turn, the span starts right after that prompt (a thinking model's `<think>` is its own). Each
piece is encoded on its own; an assistant message given as sampled ids keeps its ids when they
decode to its span. The assistant's end marker (the token it stops on, found by probing the
template) belongs to the assistant (mask 1), like the span.

A template that cannot be segmented — one whose rendering does not contain a message's content,
or that renders the assistant's turn without an end marker — raises `ChatTemplateError` naming it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl_agent.tokenizer import Message, RenderedTurns, Tokenizer

# Private-use code points: never in a message a tokenizer would produce from real text.
_SENTINEL = "\ue000"
_PROBE_USER, _PROBE_ASSISTANT, _PROBE_RESULT = "\ue010", "\ue011", "\ue012"


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered or cut into segments; the message names it."""


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in a sandbox configured as transformers' `apply_chat_template`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def _token_str(value) -> str:
    return value.get("content", "") if isinstance(value, Mapping) else (value or "")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the conversation's settings.

    source: the template text. name: where it came from (named in errors). tools: function
    schemas rendered into the prompt (None = no tools block). options: the template's switches,
    e.g. (("enable_thinking", False),).
    """

    source: str
    name: str = "chat_template"
    bos_token: str = ""
    eos_token: str = ""
    tools: tuple | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_folder(cls, path: str, **kwargs) -> "ChatTemplate":
        """Reads `chat_template` (and the bos / eos tokens) from `tokenizer_config.json` in `path`,
        or from a `chat_template.jinja` file there (the newer layout)."""
        config_file = os.path.join(path, "tokenizer_config.json")
        config: dict = {}
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
        source = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if not source and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                source = f.read()
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default") or next(iter(named.values()), None)
        if not source:
            raise ChatTemplateError(f"no chat_template in {config_file} or {jinja_file}")
        kwargs.setdefault("name", config_file if config.get("chat_template") else jinja_file)
        kwargs.setdefault("bos_token", _token_str(config.get("bos_token")))
        kwargs.setdefault("eos_token", _token_str(config.get("eos_token")))
        return cls(source=source, **kwargs)

    def with_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> "ChatTemplate":
        """This template rendering `tools` (function schemas); one instance per tool set, kept,
        so its probes run once."""
        key = json.dumps(list(tools) if tools is not None else None, sort_keys=True)
        if key not in self._with_tools:
            self._with_tools[key] = dataclasses.replace(self, tools=tuple(tools) if tools is not None else None)
        return self._with_tools[key]

    @functools.cached_property
    def _with_tools(self) -> dict:
        return {}

    # ---------------------------------------------------------------- text
    def render_text(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The template's text for `messages` (dicts with 'role' and 'content'), as transformers renders it."""
        import jinja2

        try:
            return compile_template(self.source).render(
                messages=[dict(m) for m in messages], tools=list(self.tools) if self.tools is not None else None,
                bos_token=self.bos_token, eos_token=self.eos_token, add_generation_prompt=add_generation_prompt,
                **dict(self.options))
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"chat template {self.name}: rendering failed: {err}") from err

    @functools.cached_property
    def _probe(self) -> tuple[str, str, str]:
        """(generation prompt after a user turn, the assistant's end marker, the text from the end
        marker through the next generation prompt with the result as `_PROBE_RESULT`)."""
        user = [{"role": "user", "content": _PROBE_USER}]
        prompt = self.render_text(user, add_generation_prompt=True)
        base = self.render_text(user)
        if not prompt.startswith(base):
            raise ChatTemplateError(f"chat template {self.name}: the generation prompt does not extend the "
                                    "conversation's rendering, so turns cannot be cut into segments")
        turn = self.render_text(user + [{"role": "assistant", "content": _PROBE_ASSISTANT}])
        at = turn.find(_PROBE_ASSISTANT)
        if at < 0:
            raise ChatTemplateError(f"chat template {self.name}: an assistant message's content is not in its "
                                    "rendering")
        after = turn[at + len(_PROBE_ASSISTANT):]
        end = self._end_marker(after)
        return prompt[len(base):], end, after

    def _end_marker(self, after: str) -> str:
        """The special token that closes the assistant's turn: the first of the usual markers
        (or eos) that the rendering puts right after the assistant's content."""
        for marker in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
                       self.eos_token):
            if marker and after.startswith(marker):
                return marker
        raise ChatTemplateError(f"chat template {self.name}: no end-of-turn marker follows the assistant's content "
                                f"(it is followed by {after[:40]!r}); expected one of <|im_end|>, <|eot_id|>, "
                                f"the eos token {self.eos_token!r}")

    @property
    def end(self) -> str:
        return self._probe[1]

    def rewritten_history(self) -> str | None:
        """Whether the template re-renders earlier turns differently from how they were sampled:
        None when an episode's append-only tokens (prompt, reply, continuation, ...) equal the
        template's rendering of the whole history; else a short description of the difference
        (Qwen3 with thinking off drops the empty think block of earlier replies). Episodes are
        built append-only, so the learner always trains on what the sampler conditioned on; where
        the template rewrites history, a deployment that re-renders each turn shows the model a
        different context than training did."""
        thinking = dict(self.options).get("enable_thinking") is True
        reply = ("<think>\n" + _PROBE_ASSISTANT + "\n</think>\n\n" if thinking else "") + _PROBE_ASSISTANT
        user = {"role": "user", "content": _PROBE_USER}
        sampled = self.render_text([user], add_generation_prompt=True) + reply + self.end
        rendered = self.render_text([user, {"role": "assistant", "content": reply},
                                     {"role": "tool", "content": _PROBE_RESULT}], add_generation_prompt=True)
        if rendered.startswith(sampled):
            return None
        at = _common_prefix(rendered, sampled)
        return (f"after a reply, the template renders {rendered[at:at + 40]!r} where the sampler saw "
                f"{sampled[at:at + 40]!r}")

    # ---------------------------------------------------------------- the TurnTemplate interface
    def end_ids(self, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(self.end)

    def generation_prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The text the template adds before a reply (Qwen3 with thinking off: with an empty think block)."""
        return tokenizer.encode(self._probe[0])

    def continuation_ids(self, role: str, content: str, tokenizer: Tokenizer, *, close_assistant: bool) -> list[int]:
        """Template ids after a sampled assistant turn: its end marker when the sampler did not emit
        it, then a `role` message with `content` (a 'tool' result in the model's own form: Qwen3
        wraps it in `<tool_response>` in a user turn, Llama 3.1 in an `ipython` turn) and the next
        generation prompt."""
        if role not in self._continuations:  # probed once per role
            user = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
            text = self.render_text(user + [{"role": role, "content": _PROBE_RESULT}], add_generation_prompt=True)
            piece = text[text.find(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) + len(self.end):]
            if piece.count(_PROBE_RESULT) != 1:
                raise ChatTemplateError(f"chat template {self.name}: a {role!r} message's content appears "
                                        f"{piece.count(_PROBE_RESULT)} times in its rendering; expected once")
            self._continuations[role] = tuple(piece.split(_PROBE_RESULT))
        before, after = self._continuations[role]
        ids = self.end_ids(tokenizer) if close_assistant else []
        return ids + tokenizer.encode(before) + tokenizer.encode(content) + tokenizer.encode(after)

    @functools.cached_property
    def _continuations(self) -> dict:
        return {}

    def render(self, messages: Sequence[Message | Mapping[str, Any]], tokenizer: Tokenizer, *,
               add_generation_prompt: bool = False) -> RenderedTurns:
        """Ids of the conversation as `apply_chat_template` renders it, and the assistant mask (1 on
        each assistant message's span and its end marker). Assistant messages given as sampled
        `token_ids` keep those ids where they decode to the span the template renders."""
        parsed = [Message.coerce(m) for m in messages]
        end = self.end
        end_ids = self.end_ids(tokenizer)
        plain = []  # the messages as the template sees them (sampled ids decoded)
        for m in parsed:
            if m.token_ids is not None:
                ids = list(m.token_ids)
                if ids[-len(end_ids):] == end_ids:
                    ids = ids[:-len(end_ids)]
                plain.append({"role": m.role, "content": tokenizer.decode(ids)})
            else:
                plain.append({"role": m.role, "content": m.content})
        text = self.render_text(plain, add_generation_prompt=add_generation_prompt)
        spans = []  # (start, end) of each assistant span in `text`, in order
        for i, m in enumerate(parsed):
            if m.role != "assistant":
                continue
            marked = [*plain[:i], {"role": "assistant", "content": _SENTINEL}, *plain[i + 1:]]
            other = self.render_text(marked, add_generation_prompt=add_generation_prompt)
            at = other.find(_SENTINEL)
            if at < 0:
                raise ChatTemplateError(f"chat template {self.name}: assistant message {i}'s content is not in its "
                                        "rendering")
            start = _common_prefix(text, other[:at])  # where the two renderings part, at or before the content
            prompt = self.render_text(plain[:i], add_generation_prompt=True)
            if text.startswith(prompt) and len(prompt) <= start:
                start = len(prompt)  # all the model wrote after its prompt (a thinking model's <think> too)
            stop = len(text) - _common_suffix(text, other, len(other) - at - len(_SENTINEL))
            if not text.startswith(end, stop):
                raise ChatTemplateError(f"chat template {self.name}: assistant message {i} is not followed by the "
                                        f"end marker {end!r} in its rendering")
            spans.append((start, stop))
        ids: list[int] = []
        mask: list[int] = []

        def add(segment: Sequence[int], assistant: bool):
            ids.extend(int(t) for t in segment)
            mask.extend([int(assistant)] * len(segment))

        position = 0
        assistants = [m for m in parsed if m.role == "assistant"]
        for (start, stop), m in zip(spans, assistants):
            add(tokenizer.encode(text[position:start]), False)
            span = text[start:stop]
            sampled = list(m.token_ids) if m.token_ids is not None else None
            if sampled is not None and sampled[-len(end_ids):] == end_ids:
                sampled = sampled[:-len(end_ids)]
            if sampled is not None and tokenizer.decode(sampled) == span:
                add(sampled, True)
            else:
                add(tokenizer.encode(span), True)
            add(end_ids, True)
            position = stop + len(end)
        add(tokenizer.encode(text[position:]), False)
        return RenderedTurns(np.asarray(ids, np.int32), np.asarray(mask, np.int32))
