"""The one text protocol between the policy and its tools.

The model calls a tool by emitting

    <tool_call>{"name": "calc", "arguments": {"expr": "17*23+5"}}</tool_call>

and receives the result as

    <tool_result>396</tool_result>

and ends the episode with `<answer>...</answer>`. `parse_tool_calls(text)` never raises: a malformed
call (bad JSON, missing name, arguments that violate the tool's schema, an unclosed tag) becomes a
`ToolCallError` whose message is shown to the policy as an error observation, so it can learn the
format instead of crashing the run.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.S)
_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool: its name, a description for the prompt, and a JSON-schema for its arguments.

    The schema subset understood: {"type": "object", "properties": {arg: {"type": t}},
    "required": [...], "additionalProperties": bool} with t in string / integer / number / boolean /
    array / object.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ToolSpec":
        return cls(name=d["name"], description=d["description"], parameters=d["parameters"])


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed or validated; `message` is shown to the policy."""

    raw: str
    message: str


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    """Everything found in one model turn."""

    calls: tuple[ToolCall, ...]
    errors: tuple[ToolCallError, ...]
    answer: str | None


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def validate_arguments(arguments: Any, schema: Mapping[str, Any]) -> str | None:
    """Returns None if `arguments` satisfy the (subset) JSON schema, else a message saying why."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in arguments:
            return f"missing required argument {name!r}"
    if not schema.get("additionalProperties", False):
        extra = sorted(set(arguments) - set(properties))
        if extra:
            return f"unknown argument(s) {extra}; expected {sorted(properties)}"
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        if expected is None:
            continue
        types = _JSON_TYPES.get(expected)
        ok = types is not None and isinstance(value, types)
        if expected in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            return f"argument {name!r} must be {expected}, got {type(value).__name__}"
    return None


def _parse_one(body: str, closed: bool, tools: Mapping[str, ToolSpec] | None) -> ToolCall | ToolCallError:
    raw = CALL_OPEN + body + (CALL_CLOSE if closed else "")
    if not closed:
        return ToolCallError(raw, f"unclosed {CALL_OPEN}: end the call with {CALL_CLOSE}")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as err:
        return ToolCallError(raw, f"tool call is not valid JSON ({err.__class__.__name__}: {str(err)[:80]})")
    if not isinstance(payload, dict):
        return ToolCallError(raw, 'tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, 'tool call needs a string "name"')
    arguments = payload.get("arguments", {})
    extra = sorted(set(payload) - {"name", "arguments"})
    if extra:
        return ToolCallError(raw, f'tool call has unexpected keys {extra}; expected "name" and "arguments"')
    if tools is not None:
        if name not in tools:
            return ToolCallError(raw, f"unknown tool {name!r}; available: {sorted(tools)}")
        problem = validate_arguments(arguments, tools[name].parameters)
        if problem:
            return ToolCallError(raw, f"bad arguments for {name}: {problem}")
    elif not isinstance(arguments, dict):
        return ToolCallError(raw, "arguments must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: Any, tools: Sequence[ToolSpec] | Mapping[str, ToolSpec] | None = None) -> ParsedAction:
    """Finds every tool call and the answer in one model turn. Never raises.

    Args:
      text: the model's turn (anything that is not a str yields an error, not an exception).
      tools: if given, calls are checked against these tools' names and argument schemas.

    Returns:
      ParsedAction(calls, errors, answer): answer is the content of the first <answer>...</answer>.
    """
    try:
        if not isinstance(text, str):
            return ParsedAction((), (ToolCallError(repr(text)[:200], "action must be text"),), None)
        if tools is not None and not isinstance(tools, Mapping):
            tools = {t.name: t for t in tools}
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for match in _CALL_RE.finditer(text):
            parsed = _parse_one(match.group(1), bool(match.group(2)), tools)
            (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        answer_match = _ANSWER_RE.search(text)
        answer = answer_match.group(1).strip() if answer_match else None
        return ParsedAction(tuple(calls), tuple(errors), answer)
    except Exception as err:  # noqa: BLE001 - the contract is: never raise on model output
        return ParsedAction((), (ToolCallError(str(text)[:200], f"could not parse action: {err!r}"),), None)


def format_tool_call(call: ToolCall) -> str:
    """The canonical text of a call (compact JSON); parse_tool_calls(format_tool_call(c)) == c.

    '<' is written as the JSON escape \\u003c so that a string argument containing '</tool_call>'
    cannot end the call early; JSON decodes it back to '<'.
    """
    body = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, separators=(",", ":"),
                      ensure_ascii=False)
    return CALL_OPEN + body.replace("<", "\\u003c") + CALL_CLOSE


def format_tool_result(content: str) -> str:
    return RESULT_OPEN + content + RESULT_CLOSE


def format_answer(answer: str) -> str:
    return ANSWER_OPEN + answer + ANSWER_CLOSE
