"""Tool formats: the policy sees its model's own tool format; environments keep one protocol.

Environments speak `envs.tool_protocol`: calls `<tool_call>{"name", "arguments"}</tool_call>`,
results `<tool_result>...</tool_result>`, the end `<answer>...</answer>`, tools described in their
system prompt. A `ToolFormat` maps between that protocol and what a model was post-trained on:

  env       the protocol itself (the built-in character templates; tools in the system prompt)
  qwen3     Hermes-style, as Qwen3's chat template: tool schemas in the template's `<tools>`
            block (`{"type": "function", "function": {...}}`), calls as
            `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, results as `tool`
            messages (the template wraps them in `<tool_response>` inside a user turn)
  llama3.1  Llama 3.1's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`
            (optionally after `<|python_tag|>`), results as `tool` messages (the template's
            `ipython` turn)

Every format: `schemas(tools)` for the template's `tools` (None: the format has none),
`system(observation)` the system message, `to_env(text)` the model's reply as a protocol action,
`from_env(action)` a protocol action (a scripted expert's) in the model's form, `result(text)` a
tool observation's content for the template. In the model formats a reasoning block
(`<think>...</think>`) is never part of the action. `to_env` never raises: a reply it cannot read passes through unchanged, and
the environment records it as malformed, as it would any bad call.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from jaxrl_agent.envs import tool_protocol as tp

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_RESULT_RE = re.compile(re.escape(tp.RESULT_OPEN) + r"(.*)" + re.escape(tp.RESULT_CLOSE) + r"\s*\Z", re.S)


def strip_reasoning(text: str) -> str:
    """The reply after its reasoning block: the text after the last `</think>` (an unclosed
    `<think>` leaves nothing: the model never got past thinking)."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1].lstrip("\n")
    if text.lstrip().startswith(THINK_OPEN):
        return ""
    return text


def _unwrap_result(text: str) -> str:
    match = _RESULT_RE.match(text.strip())
    return match.group(1) if match else text


def _protocol_calls(action: str) -> list[tuple[str, Any]]:
    """[(name, arguments)] of the well-formed calls in a protocol action (an expert's)."""
    parsed = tp.parse_tool_calls(action)
    return [(c.name, dict(c.arguments)) for c in parsed.calls]


class ToolFormat:
    """The environment protocol itself (format 'env')."""

    name = "env"

    def schemas(self, tools: Sequence[Mapping[str, Any]]) -> list[dict] | None:
        return None

    def system(self, system: str | None, instructions: str | None) -> str | None:
        return system

    def to_env(self, text: str) -> str:
        return text

    def from_env(self, action: str) -> str:
        return action

    def result(self, text: str) -> str:
        return text


class _ModelFormat(ToolFormat):
    """What the model formats share: OpenAI-style schemas for the template's tools block, the
    environment's instructions (not its protocol's tool description) as the system message, and
    results unwrapped for the template's tool role."""

    def schemas(self, tools):
        return [{"type": "function", "function": dict(t)} for t in tools]

    def system(self, system, instructions):
        return instructions

    def result(self, text):
        return _unwrap_result(text)


class Qwen3Format(_ModelFormat):
    name = "qwen3"

    def to_env(self, text):
        # Qwen3's calls are the protocol's tags around JSON (with newlines, which JSON ignores).
        return strip_reasoning(text)

    def from_env(self, action):
        calls = _protocol_calls(action)
        if not calls:
            return action
        return "\n".join(tp.CALL_OPEN + "\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n"
                         + tp.CALL_CLOSE for n, a in calls)


class Llama31Format(_ModelFormat):
    name = "llama3.1"
    PYTHON_TAG = "<|python_tag|>"

    def to_env(self, text):
        reply = strip_reasoning(text)
        try:
            body = reply.strip()
            if body.startswith(self.PYTHON_TAG):
                body = body[len(self.PYTHON_TAG):].strip()
            if not body.startswith("{"):
                return reply
            payload = json.loads(body)
            if not isinstance(payload, dict) or "name" not in payload:
                return reply
            arguments = payload.get("parameters", payload.get("arguments", {}))
            return tp.format_tool_call(tp.ToolCall(name=str(payload["name"]), arguments=arguments)) \
                if isinstance(arguments, dict) else reply
        except (ValueError, RecursionError, TypeError):
            return reply  # the environment sees the reply as it is and records a malformed turn

    def from_env(self, action):
        calls = _protocol_calls(action)
        if len(calls) != 1:
            return action
        name, arguments = calls[0]
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


FORMATS = {f.name: f for f in (ToolFormat(), Qwen3Format(), Llama31Format())}


def get(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"tool format {name!r} is not one of {sorted(FORMATS)}") from None
