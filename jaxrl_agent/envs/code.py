"""`code`: write a small Python function `solve`, verified by hidden tests in the sandbox.

The prompt specifies `solve`; the policy may try code with the `run_python` tool (sandboxed, output
returned) and submits its solution as `<answer>` source `</answer>` (optionally in a ```python
fence). Verification runs the solution on hidden inputs in the sandbox and compares its outputs
with the reference outputs computed at task generation; the child only ever sees inputs.
Difficulty 1-3 picks from families of increasing complexity, with random constants.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from jaxrl_agent.envs import api, sandbox, tool_protocol as tp

RUN_PYTHON = tp.ToolSpec("run_python", "Runs a Python script in a sandbox and returns its output.",
                         {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})


# Each family: (prompt template, reference source template, input generator). The reference source
# is what the scripted expert submits; it is run in-process only to compute expected outputs.
def _int_lists(rng, n=6):
    return [[rng.randint(-20, 40) for _ in range(rng.randint(0, 8))] for _ in range(n)]


def _strings(rng, alphabet="abcde ", n=6):
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(n)]


FAMILIES: dict[int, list[tuple[str, str, Callable]]] = {
    1: [
        ("Write a Python function solve(xs) that returns the sum of the elements of the list xs "
         "that are divisible by {k}.",
         "def solve(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
         lambda rng: {"k": rng.randint(2, 7)}),
        ("Write a Python function solve(s) that returns how many times the character {c!r} occurs in "
         "the string s.",
         "def solve(s):\n    return s.count({c!r})\n",
         lambda rng: {"c": rng.choice("abcde")}),
    ],
    2: [
        ("Write a Python function solve(xs) that returns max(xs) - min(xs) for a list of integers xs, "
         "or {d} if xs is empty.",
         "def solve(xs):\n    return max(xs) - min(xs) if xs else {d}\n",
         lambda rng: {"d": rng.randint(-3, 3)}),
        ("Write a Python function solve(s) that returns the words of s (split on whitespace) in "
         "reverse order, joined by {sep!r}.",
         "def solve(s):\n    return {sep!r}.join(reversed(s.split()))\n",
         lambda rng: {"sep": rng.choice([" ", "-", ","])}),
    ],
    3: [
        ("Write a Python function solve(s) that run-length encodes s: each maximal run of a character c "
         "of length n becomes c followed by n, e.g. 'aab' -> 'a2b1'. Return '' for ''. Use {k} as an "
         "upper bound: runs longer than {k} are split into runs of at most {k}.",
         "def solve(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
         "        while j < len(s) and s[j] == s[i] and j - i < {k}:\n            j += 1\n"
         "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
         lambda rng: {"k": rng.randint(2, 4)}),
        ("Write a Python function solve(xs) that returns the length of the longest strictly increasing "
         "contiguous run in the list xs, counting only elements greater than {t} (other elements break "
         "runs). Return 0 if there is none.",
         "def solve(xs):\n    best = cur = 0\n    prev = None\n    for x in xs:\n        if x <= {t}:\n"
         "            cur, prev = 0, None\n            continue\n"
         "        cur = cur + 1 if prev is not None and x > prev else 1\n        prev = x\n"
         "        best = max(best, cur)\n    return best\n",
         lambda rng: {"t": rng.randint(-5, 10)}),
    ],
}

_HARNESS = """
import json
from solution import solve
inputs = json.loads(open("inputs.json").read())
outputs = []
for args in inputs:
    try:
        outputs.append({"ok": solve(*args)})
    except Exception as err:
        outputs.append({"error": type(err).__name__})
print("@@RESULTS@@" + json.dumps(outputs, default=repr))
"""


def _inputs_for(source: str, rng) -> list[list[Any]]:
    if "solve(xs)" in source:
        return [[xs] for xs in _int_lists(rng)] + [[[]], [[5, 5, 5]]]
    return [[s] for s in _strings(rng)] + [[""], ["aaaa bb"]]


def extract_code(answer: str) -> str:
    """The solution source from an answer, with or without a ```python fence."""
    fenced = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    return fenced.group(1) if fenced else answer


class CodeEnv(api.ToolEnvironment):
    name = "code"
    difficulties = (1, 2, 3)
    uses_sandbox = True  # the run checks the sandbox's isolation before it starts

    def __init__(self, *, max_turns: int = 4, reward_weights: Mapping[str, float] | None = None,
                 limits: sandbox.SandboxLimits = sandbox.SandboxLimits()):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)
        self.limits = limits

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if difficulty not in FAMILIES:
            raise ValueError(f"code difficulty {difficulty} not in {sorted(FAMILIES)}")
        rng = api.task_rng(self.name, seed, difficulty)
        prompt, source, params = rng.choice(FAMILIES[difficulty])
        values = params(rng)
        reference = source.format(**values)
        inputs = _inputs_for(reference, rng)
        namespace: dict[str, Any] = {}
        exec(reference, namespace)  # our own reference solution, never the policy's code
        expected = [namespace["solve"](*args) for args in inputs]
        return api.Task(id=f"code/{difficulty}/{seed}", env=self.name, prompt=prompt.format(**values),
                        tools=(RUN_PYTHON,),
                        verifier={"inputs": inputs, "expected": expected, "reference": reference},
                        difficulty=difficulty)

    def tools(self):
        return (RUN_PYTHON,)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        result = sandbox.run_python(arguments["code"], limits=self.limits)
        text = f"status={result.status}\n{result.stdout}"
        if result.stderr.strip():
            text += "\nstderr:\n" + result.stderr.strip().splitlines()[-1]
        return text[:2000]

    def verify(self, answer: str) -> bool:
        code = extract_code(answer)
        result = sandbox.run_python(
            _HARNESS, limits=self.limits,
            files={"solution.py": code, "inputs.json": json.dumps(self.task.verifier["inputs"])},
        )
        marker = result.stdout.rfind("@@RESULTS@@")
        if result.status != "ok" or marker < 0:
            return False
        try:
            outputs = json.loads(result.stdout[marker + len("@@RESULTS@@"):].strip().splitlines()[0])
        except (ValueError, IndexError):
            return False
        expected = json.loads(json.dumps(self.task.verifier["expected"]))
        return len(outputs) == len(expected) and all(o == {"ok": e} for o, e in zip(outputs, expected))


def expert(task: api.Task, observations, actions) -> str:
    """Submits the reference solution (the generator's privileged knowledge: SFT data)."""
    return tp.format_answer(task.verifier["reference"])


api.register(CodeEnv.name, CodeEnv, expert=expert)
