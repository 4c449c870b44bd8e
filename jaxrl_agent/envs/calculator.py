"""`calculator`: multi-step arithmetic problems solved through a `calc` tool.

The prompt is a problem such as `Q: 17*23+5=?`; the policy calls `calc(expr)` — a safe evaluator
of its own (integers, + - * // % and parentheses; never `eval`) — and answers with the integer.
Difficulty:
  1: 2 operations, numbers 1-99      2: 3 operations, 1-99      3: 2 operations, 100-999
  4: 3 operations, 100-999           5: 4 operations, 1-99
"""

from __future__ import annotations

import operator
import re
from typing import Any, Mapping

from jaxrl_agent.envs import api, tool_protocol as tp

LEVELS = {1: (2, 1, 99), 2: (3, 1, 99), 3: (2, 100, 999), 4: (3, 100, 999), 5: (4, 1, 99)}
OPS = ("+", "-", "*")

CALC = tp.ToolSpec(
    name="calc",
    description="Evaluates an integer arithmetic expression with + - * // % and parentheses.",
    parameters={"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
)

_BINARY = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
}
MAX_EXPR_CHARS = 200
MAX_MAGNITUDE = 10**18
# Tokens: an integer literal as Python writes one (decimal, 0x/0o/0b, single underscores), an operator
# or parenthesis, or any other word or character (refused by name; so are `**` and `/`).
_TOKEN_RE = re.compile(r"\s*(?:(0[xX](?:_?[0-9a-fA-F])+|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+|[0-9](?:_?[0-9])*)"
                       r"|(//|\*\*|[-+*%()/])|(\w+|\S))")


class CalcError(api.ToolError):
    pass


def safe_eval(expr: str) -> int:
    """Evaluates an integer expression — integer literals, + - * // % (Python's integer semantics),
    unary + and -, parentheses — and raises CalcError for anything else.

    A recursive-descent parser of its own rather than `ast.parse`: CPython 3.11's AST constructor
    keeps its recursion depth in state shared by all threads, so `ast.parse` running in two threads
    at once can fail with `SystemError: AST constructor recursion depth mismatch` (python/cpython
    gh-106905); steps and task sampling run on several threads in a trainer (and 3.11's traceback
    formatting calls `ast.parse` too). Grammar, with Python's precedence:
      expr   := term (('+' | '-') term)*
      term   := unary (('*' | '//' | '%') unary)*
      unary  := ('+' | '-') unary | atom
      atom   := INT | '(' expr ')'
    Every binary result must stay within ±MAX_MAGNITUDE; division or modulo by zero is an error.
    """
    if not isinstance(expr, str) or not expr.strip():
        raise CalcError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens = []  # ('int', value) or ('op', text)
    for match in _TOKEN_RE.finditer(expr.rstrip()):
        number, op, other = match.groups()
        if other is not None or op in ("**", "/"):
            raise CalcError(f"unsupported element {other or op!r} in {expr!r}; use integers, + - * // % ( )")
        if number is None:
            tokens.append(("op", op))
            continue
        try:
            tokens.append(("int", int(number, 0)))  # Python's literal rules: '007' is refused, '00' is 0
        except ValueError:
            raise CalcError(f"cannot parse {expr!r}: {number!r} is not an integer literal") from None
    position = 0

    def peek() -> str | None:
        return tokens[position][1] if position < len(tokens) and tokens[position][0] == "op" else None

    def take_op() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1][1]

    def binary(op: str, left: int, right: int) -> int:
        if op in ("//", "%") and right == 0:
            raise CalcError("division by zero")
        value = _BINARY[op](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise CalcError("result too large")
        return value

    def parse_expr() -> int:
        value = parse_term()
        while peek() in ("+", "-"):
            op = take_op()
            value = binary(op, value, parse_term())
        return value

    def parse_term() -> int:
        value = parse_unary()
        while peek() in ("*", "//", "%"):
            op = take_op()
            value = binary(op, value, parse_unary())
        return value

    def parse_unary() -> int:
        nonlocal position
        if peek() in ("+", "-"):
            op = take_op()
            value = parse_unary()
            return -value if op == "-" else value
        if position >= len(tokens):
            raise CalcError(f"cannot parse {expr!r}: it ends where a number was expected")
        kind, text = tokens[position]
        position += 1
        if kind == "int":
            return text
        if text == "(":
            value = parse_expr()
            if peek() != ")":
                raise CalcError(f"cannot parse {expr!r}: unbalanced parentheses")
            position += 1
            return value
        raise CalcError(f"cannot parse {expr!r}: {text!r} where a number was expected")

    value = parse_expr()
    if position != len(tokens):
        raise CalcError(f"cannot parse {expr!r}: unexpected {tokens[position][1]!r}")
    return value


def _parse_int(text: str) -> int | None:
    try:
        return int(text.strip().replace(",", ""))
    except (ValueError, AttributeError):
        return None


class CalculatorEnv(api.ToolEnvironment):
    name = "calculator"
    in_process_safe = True  # pure Python, no policy code run: env.service='auto' keeps it in process
    difficulties = tuple(sorted(LEVELS))

    def __init__(self, *, max_turns: int = 4, reward_weights: Mapping[str, float] | None = None):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if difficulty not in LEVELS:
            raise ValueError(f"calculator difficulty {difficulty} not in {sorted(LEVELS)}")
        n_ops, low, high = LEVELS[difficulty]
        rng = api.task_rng(self.name, seed, difficulty)
        expr = str(rng.randint(low, high))
        for _ in range(n_ops):
            expr += rng.choice(OPS) + str(rng.randint(low, high))
        return api.Task(id=f"calculator/{difficulty}/{seed}", env=self.name, prompt=f"Q: {expr}=?",
                        tools=(CALC,), verifier={"expr": expr, "answer": safe_eval(expr)}, difficulty=difficulty)

    def subtask(self, parent: api.Task, text: str) -> api.Task:
        """A delegated expression (`17*23`, or `Q: 17*23=?`) as a calculator task of its own."""
        expr = str(text).strip().removeprefix("Q:").strip().removesuffix("=?").strip()
        answer = safe_eval(expr)  # CalcError (a ToolError) names what is wrong with it
        return api.Task(id=f"{parent.id}/sub/{expr}", env=self.name, prompt=f"Q: {expr}=?", tools=(CALC,),
                        verifier={"expr": expr, "answer": answer}, difficulty=parent.difficulty)

    def tools(self):
        return (CALC,)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        return str(safe_eval(arguments["expr"]))

    def verify(self, answer: str) -> bool:
        return _parse_int(answer) == self.task.verifier["answer"]


def expert(task: api.Task, observations, actions) -> str:
    """Calls calc on the problem's expression, then answers with the tool's result."""
    expr = task.prompt.removeprefix("Q: ").removesuffix("=?")
    if not actions:
        return tp.format_tool_call(tp.ToolCall("calc", {"expr": expr}))
    last = observations[-1]
    result = last.removeprefix(tp.RESULT_OPEN).removesuffix(tp.RESULT_CLOSE)
    return tp.format_answer(result)


api.register(CalculatorEnv.name, CalculatorEnv, expert=expert)
