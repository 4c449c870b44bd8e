"""The tool-call protocol: never raises on arbitrary text; valid calls round-trip."""

import json

from hypothesis import given, settings, strategies as st

from jaxrl_agent import envs
from jaxrl_agent.envs import tool_protocol as tp

CALC = tp.ToolSpec("calc", "", {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]})

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=8,
)
fragments = st.sampled_from([tp.CALL_OPEN, tp.CALL_CLOSE, tp.ANSWER_OPEN, tp.ANSWER_CLOSE, "{", "}", '"name"', ":",
                             '"arguments"', ",", "[", "]", '"', "\\", "null", "1e999"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text() | fragments, max_size=12).map("".join))
def test_arbitrary_text_never_raises(text):
    for tools in (None, [CALC]):
        parsed = tp.parse_tool_calls(text, tools)
        assert isinstance(parsed, tp.ParsedAction)
        assert all(isinstance(e.message, str) and e.message for e in parsed.errors)


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.integers(), st.none(), st.binary(), st.lists(st.integers())))
def test_non_text_actions_never_raise(value):
    parsed = tp.parse_tool_calls(value)
    assert parsed.calls == () and len(parsed.errors) == 1


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1), st.dictionaries(st.text(), json_values, max_size=4), st.text(), st.text())
def test_valid_calls_round_trip(name, arguments, before, after):
    call = tp.ToolCall(name, arguments)
    text = tp.format_tool_call(call)
    parsed = tp.parse_tool_calls(text)
    assert parsed.errors == () and len(parsed.calls) == 1
    assert parsed.calls[0].name == name and parsed.calls[0].arguments == arguments
    # Surrounding text without tags leaves the call intact.
    if tp.CALL_OPEN not in before + after and "<" not in before + after:
        assert tp.parse_tool_calls(before + text + after).calls == (call,)


def test_malformed_calls_become_errors_that_say_why():
    cases = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'needs a string "name"',
        '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}': "unclosed",
        '<tool_call>{"name": "calcc", "arguments": {"expr": "1"}}</tool_call>': "unknown tool 'calcc'",
        '<tool_call>{"name": "calc", "arguments": {}}</tool_call>': "missing required argument 'expr'",
        '<tool_call>{"name": "calc", "arguments": {"expr": 5}}</tool_call>': "'expr' must be string",
        '<tool_call>{"name": "calc", "arguments": {"expr": "1", "x": 2}}</tool_call>': "unknown argument",
        '<tool_call>{"name": "calc", "args": {}}</tool_call>': "unexpected keys",
    }
    for text, message in cases.items():
        parsed = tp.parse_tool_calls(text, [CALC])
        assert parsed.calls == () and message in parsed.errors[0].message, (text, parsed)


def test_answer_and_several_calls():
    text = (tp.format_tool_call(tp.ToolCall("calc", {"expr": "1+1"})) + " then "
            + tp.format_tool_call(tp.ToolCall("calc", {"expr": "2*3"})) + "<answer> 6 </answer>")
    parsed = tp.parse_tool_calls(text, [CALC])
    assert [c.arguments["expr"] for c in parsed.calls] == ["1+1", "2*3"] and parsed.answer == "6"
    assert json.loads(tp.format_tool_call(tp.ToolCall("x", {"a": "</tool_call>"}))[len(tp.CALL_OPEN):-len(tp.CALL_CLOSE)])


def test_malformed_call_gives_an_error_observation_not_a_crash():
    env = envs.make("calculator")
    env.reset(env.sample_task(0, 1))
    step = env.step("<tool_call>{oops</tool_call>")
    assert not step.done and "error: tool call is not valid JSON" in step.observation.text
