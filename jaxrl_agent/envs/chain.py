"""`chain`: follow a chain of records through a log, one `read` at a time — a long-horizon task
whose whole transcript outgrows any affordable context.

Each task generates a log of records keyed by two-letter names. The prompt names the first key;
each record says where the chain goes next (decoy records, off the chain, point back into it); the
last one holds a value, which is the answer:

  Q: Follow the chain from KQ; answer its value.
  read(KQ) -> "KQ: ok; next TB"
  read(TB) -> "TB: ok; next MW"
  read(MW) -> "MW: ok; value 615"      answer: 615

Difficulty = number of reads (hops). Every turn adds a call and its result to the transcript, so
with `rollout.max_context` fixed, the difficulty sets how far the whole episode exceeds the
context: without context management (`rollout.context='none'`) an episode that reaches the limit
ends unanswered. Only the latest record matters to go on, so `keep_recent` with one kept turn, or
a summary that keeps the next key (`summarize`), can follow chains of any length; `discard_all`
forgets where it was.

The scripted expert reads the chain to its end; its summary (`expert.summarize`) is the key it
would read next.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from jaxrl_agent.envs import api, tool_protocol as tp

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
READ = tp.ToolSpec("read", "Returns the log record with this key.",
                   {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]})
PROMPT = "Q: Follow the chain from {start}; answer its value."
_NEXT_RE = re.compile(r"next ([A-Z]{2})\b")
_VALUE_RE = re.compile(r"value (\d+)\b")
_START_RE = re.compile(r"from ([A-Z]{2});")


def build_log(seed: int, hops: int) -> tuple[list[str], dict[str, str]]:
    """(the chain's keys in order, {key: record}) with `hops` records on the chain and as many
    decoys off it; deterministic in (seed, hops)."""
    rng = api.task_rng("chain/log", seed, hops)
    keys = rng.sample([a + b for a in LETTERS for b in LETTERS], 2 * hops)
    chain, decoys = keys[:hops], keys[hops:]
    log = {}
    for i, key in enumerate(chain):
        tail = f"next {chain[i + 1]}" if i + 1 < hops else f"value {rng.randint(100, 999)}"
        log[key] = f"{key}: ok; {tail}"
    for key in decoys:
        log[key] = f"{key}: ok; next {rng.choice(chain)}"
    return chain, log


class ChainEnv(api.ToolEnvironment):
    name = "chain"
    in_process_safe = True  # pure Python, no policy code run: env.service='auto' keeps it in process
    difficulties = (1, 2, 3, 4, 5, 6, 8)

    def __init__(self, *, max_turns: int = 12, reward_weights: Mapping[str, float] | None = None):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)
        self._log: dict[str, str] = {}

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if not 1 <= difficulty <= 20:
            raise ValueError(f"chain difficulty {difficulty}: expected 1..20 (the number of reads)")
        if difficulty + 1 > self.max_turns:
            raise ValueError(f"chain difficulty {difficulty} needs {difficulty + 1} turns; max_turns={self.max_turns}")
        chain, log = build_log(seed, difficulty)
        answer = _VALUE_RE.search(log[chain[-1]]).group(1)
        return api.Task(id=f"chain/{difficulty}/{seed}", env=self.name, prompt=PROMPT.format(start=chain[0]),
                        tools=(READ,), verifier={"log_seed": seed, "answer": answer}, difficulty=difficulty)

    def start_episode(self, task: api.Task, seed: int) -> None:
        self._log = build_log(int(task.verifier["log_seed"]), task.difficulty)[1]

    def tools(self):
        return (READ,)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        key = str(arguments.get("k", "")).strip().upper()
        if key not in self._log:
            raise api.ToolError(f"no record {key!r}")
        return self._log[key]

    def verify(self, answer: str) -> bool:
        return answer.strip() == self.task.verifier["answer"]


def _read(key: str) -> str:
    return tp.format_tool_call(tp.ToolCall("read", {"k": key}))


def _where(task: api.Task, observations) -> tuple[str, str | None]:
    """(what the latest record says: 'next' or 'value', its key or value); the start before any."""
    for text in reversed(observations[1:]):
        if (value := _VALUE_RE.search(text)) is not None:
            return "value", value.group(1)
        if (key := _NEXT_RE.search(text)) is not None:
            return "next", key.group(1)
    return "next", _START_RE.search(task.prompt).group(1)


def expert(task: api.Task, observations, actions) -> str:
    """Reads the key the latest record points to; answers the value at the end."""
    kind, what = _where(task, observations)
    return tp.format_answer(what) if kind == "value" else _read(what)


def _summarize(task: api.Task, observations, actions) -> str:
    """The expert's summary: all it needs to go on, the key it reads next."""
    kind, what = _where(task, observations)
    return f"{kind} {what}"


expert.summarize = _summarize
api.register(ChainEnv.name, ChainEnv, expert=expert)
