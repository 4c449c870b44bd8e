"""`calculator`: multi-step arithmetic problems solved through a `calc` tool.

The prompt is a problem such as `Q: 17*23+5=?`; the policy calls
`calc(expr)` — a safe evaluator over an `ast` whitelist (integers, + - * // % and parentheses;
never `eval`) — and answers with the integer. Difficulty:
  1: 2 operations, numbers 1-99      2: 3 operations, 1-99      3: 2 operations, 100-999
  4: 3 operations, 100-999           5: 4 operations, 1-99
"""

from __future__ import annotations

import ast
import operator
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
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_EXPR_CHARS = 200
MAX_MAGNITUDE = 10**18


class CalcError(api.ToolError):
    pass


def safe_eval(expr: str) -> int:
    """Evaluates an integer expression over a whitelist of AST nodes; raises CalcError otherwise."""
    if not isinstance(expr, str) or not expr.strip():
        raise CalcError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expr!r}") from None

    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalcError("division by zero")
            value = _BINARY[type(node.op)](left, right)
            if abs(value) > MAX_MAGNITUDE:
                raise CalcError("result too large")
            return value
        raise CalcError(f"unsupported element {type(node).__name__} in {expr!r}; use integers, + - * // % ( )")

    return ev(tree)


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
