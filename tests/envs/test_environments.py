"""Built-in environments: experts solve them, random text does not, tasks are deterministic."""

import ast
import json
import operator
import random
import string
import sys
import threading
import time

import pytest

from jaxrl_agent import envs
from jaxrl_agent.envs import calculator

EPISODES = {"calculator": 100, "kb_search": 100, "terminal": 100, "code": 12, "chain": 100, "chain_sum": 50}


@pytest.mark.parametrize("name", envs.BUILTIN_ENVS)
def test_scripted_expert_solves_every_difficulty(name):
    env = envs.make(name)
    expert = envs.expert_policy(name)
    for difficulty in env.difficulties:
        n = EPISODES[name]
        solved = 0
        for seed in range(n):
            step, _, _ = envs.run_episode(env, env.sample_task(seed, difficulty), expert)
            solved += step.info["success"]
            assert step.info["finish_reason"] == "answer"
            assert step.info["reward_components"]["correctness"] == float(step.info["success"])
        assert solved / n >= 0.99, (name, difficulty, solved, n)


def _random_text_policy(seed):
    rng = random.Random(seed)

    def policy(task, observations, actions):
        text = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 60)))
        # Sometimes wrap random text in the answer tag, so the verifier is actually exercised.
        return f"<answer>{text}</answer>" if rng.random() < 0.5 else text

    return policy


@pytest.mark.parametrize("name", envs.BUILTIN_ENVS)
def test_random_text_solves_about_nothing(name):
    env = envs.make(name)
    n = EPISODES[name]
    solved = 0
    for difficulty in env.difficulties:
        for seed in range(n):
            step, _, _ = envs.run_episode(env, env.sample_task(seed, difficulty), _random_text_policy(seed))
            solved += step.info["success"]
            assert step.info["finish_reason"] in ("answer", "max_turns")
    assert solved / (n * len(env.difficulties)) <= 0.01


@pytest.mark.parametrize("name", envs.BUILTIN_ENVS)
def test_tasks_are_deterministic_per_seed_and_vary_across_seeds(name):
    env = envs.make(name)
    d = env.difficulties[-1]
    assert env.sample_task(3, d) == env.sample_task(3, d)
    assert envs.make(name).sample_task(3, d).to_json() == env.sample_task(3, d).to_json()
    assert len({json.dumps(env.sample_task(s, d).verifier, sort_keys=True) for s in range(20)}) == 20
    task = env.sample_task(5, d)
    assert envs.Task.from_json(task.to_json()) == task


def test_answer_is_never_in_the_kb_prompt():
    env = envs.make("kb_search")
    for d in env.difficulties:
        for seed in range(50):
            task = env.sample_task(seed, d)
            assert task.verifier["answer"].lower() not in task.prompt.lower()


def test_reward_components_and_weights():
    env = envs.make("calculator", reward_weights={"format": 0.5, "efficiency": 0.1})
    task = env.sample_task(0, 1)
    env.reset(task)
    env.step("no call here")  # malformed turn
    step = env.step(f"<answer>{task.verifier['answer']}</answer>")
    components = step.info["reward_components"]
    assert components == {"correctness": 1.0, "format": -0.5, "efficiency": -2 / 4}
    assert step.reward == pytest.approx(1.0 - 0.25 - 0.05)
    with pytest.raises(ValueError, match="unknown reward component 'speed'"):
        envs.make("calculator", reward_weights={"speed": 1.0})


def test_max_turns_ends_the_episode():
    env = envs.make("kb_search", max_turns=2)
    env.reset(env.sample_task(0, 3))
    assert not env.step("hello").done
    step = env.step("hello again")
    assert step.done and step.info["finish_reason"] == "max_turns" and step.reward <= 0


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "2**10", "(1).real", "[1]*9", "a+1",
                                  "9" * 300, "1/0", "10**10**10", "lambda: 1"])
def test_calculator_refuses_anything_but_integer_arithmetic(expr):
    with pytest.raises(calculator.CalcError):
        calculator.safe_eval(expr)


def test_calculator_evaluates_integer_arithmetic():
    assert calculator.safe_eval("17*23+5") == 396
    assert calculator.safe_eval("-(4 - 10) // 4 % 5") == 1


def _reference_eval(expr: str) -> int:
    """The calculator's semantics through Python's own parser (single-threaded here): integers,
    + - * // %, unary + -, parentheses; each binary result within ±MAX_MAGNITUDE."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise calculator.CalcError("syntax") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise calculator.CalcError("division by zero")
            value = ops[type(node.op)](left, right)
            if abs(value) > calculator.MAX_MAGNITUDE:
                raise calculator.CalcError("too large")
            return value
        raise calculator.CalcError("unsupported")

    return ev(tree)


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    """A well-formed expression (unary chains, nesting, spacing, zero divisors, large operands)."""
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        number = rng.choice([str(rng.randint(0, 99)), str(rng.randint(0, 10**10)), "0", "1_000", "00"])
        return rng.choice(["", "-", "+", "- -", "-+"]) + number
    if roll < 0.5:
        return rng.choice(["(", "-(", " ( "]) + _random_expression(rng, depth + 1) + rng.choice([")", " ) "])
    op = rng.choice(["+", "-", "*", "//", "%", " * ", " // "])
    return _random_expression(rng, depth + 1) + op + _random_expression(rng, depth + 1)


def test_calculator_matches_pythons_integer_arithmetic():
    """Golden reference: Python's parser and operators. Well-formed expressions give the same value
    (or both refuse: division by zero, a result too large); token soups are refused where Python
    refuses them and agree where Python accepts them."""
    rng = random.Random(0)
    alphabet = ["1", "7", "0", "12", "0x1f", "0b", "0o7", "9_9", "+", "-", "*", "//", "%", "(", ")", " ", "/", "**", "x", "05", "1_0", "."]
    well_formed = [_random_expression(rng) for _ in range(3000)]
    soups = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    for cases, least_accepted in ((well_formed, 2000), (soups, 200)):
        accepted = 0
        for expr in cases:
            if not expr.strip() or len(expr) > calculator.MAX_EXPR_CHARS:
                continue
            try:
                expected = _reference_eval(expr)
            except calculator.CalcError:
                with pytest.raises(calculator.CalcError):
                    calculator.safe_eval(expr)
                continue
            assert calculator.safe_eval(expr) == expected, expr
            accepted += 1
        # Both kinds exercise evaluation, not just refusal (the rest divide by zero, overflow, or
        # are not Python).
        assert accepted >= least_accepted


def test_calculator_evaluates_on_many_threads_at_once():
    """CPython 3.11's `ast.parse` fails with `SystemError: AST constructor recursion depth mismatch`
    when two threads parse at once (gh-106905); the evaluator must not. Garbage with finalizers makes
    the interpreter switch threads inside a parse (with `ast.parse`, ~200 failures a second)."""

    class Finalized:
        def __del__(self):
            sum(range(50))

    errors, stop = [], threading.Event()

    def evaluate():
        while not stop.is_set():
            a, b = Finalized(), Finalized()
            a.other, b.other = b, a
            del a, b
            try:
                assert calculator.safe_eval("-(4 - 10) // 4 % 5 + 17*23*(3+4)") == 2738
            except Exception as err:  # noqa: BLE001 - collected, asserted below
                errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=evaluate) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_unknown_environment_and_difficulty():
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        envs.make("chess")
    with pytest.raises(ValueError, match="difficulty 9"):
        envs.make("calculator").sample_task(0, 9)
