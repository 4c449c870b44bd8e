"""`chain_sum`: add the values at the ends of several independent chains — a composite task where
delegation pays (`rollout.delegate`).

A task's log holds k chains (the `chain` environment's, with disjoint keys); the prompt names
their first keys, and the answer is the sum of their values:

  Q: Add the values of the chains from KQ, TB and MW.
  read(KQ) -> "KQ: ok; next PD" ... read(..) -> "..: ok; value 615"     (each chain in turn)
  calc(615+322+471) -> "1408"                                            answer: 1408

Done inline, the transcript holds every read of every chain (k x hops calls and results), which
outgrows a small `rollout.max_context`. A sub-agent can follow one chain in a fresh context:
`delegate` with a key of the log (`{"task": "KQ"}`) runs the frozen policy on that chain as a
`chain` task (`subtask`), and only its answer comes back. The reward is correctness only, the
same for both styles: delegation is never rewarded for its own sake.

Difficulty -> (chains, reads per chain): 1: (2, 1)  2: (2, 2)  3: (3, 2)  4: (2, 3)  5: (3, 3)
6: (4, 3). Two scripted experts: `expert` (inline: reads every chain, then calc, then answers) and
`expert.delegate` (one reply delegating every chain at once, then calc, then the answer).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from jaxrl_agent.envs import api, chain, tool_protocol as tp
from jaxrl_agent.envs.calculator import CALC, safe_eval

LEVELS = {1: (2, 1), 2: (2, 2), 3: (3, 2), 4: (2, 3), 5: (3, 3), 6: (4, 3)}
_KEY_RE = re.compile(r"\b([A-Z]{2})\b")
_RESULT_RE = re.compile(re.escape(tp.RESULT_OPEN) + r"(.*?)" + re.escape(tp.RESULT_CLOSE), re.S)


def chain_seeds(seed: int, difficulty: int) -> list[int]:
    """The `chain` log seeds of a task's chains: deterministic in (seed, difficulty), their keys
    pairwise disjoint (one log holds them all)."""
    chains, hops = LEVELS[difficulty]
    rng = api.task_rng("chain_sum", seed, difficulty)
    seeds, used = [], set()
    while len(seeds) < chains:
        candidate = rng.randrange(2**31)
        keys = set(chain.build_log(candidate, hops)[1])
        if not keys & used:
            seeds.append(candidate)
            used |= keys
    return seeds


def _prompt(starts) -> str:
    return f"Q: Add the values of the chains from {', '.join(starts[:-1])} and {starts[-1]}."


class ChainSumEnv(api.ToolEnvironment):
    name = "chain_sum"
    in_process_safe = True  # pure Python, no policy code run: env.service='auto' keeps it in process
    difficulties = tuple(sorted(LEVELS))

    def __init__(self, *, max_turns: int = 16, reward_weights: Mapping[str, float] | None = None):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)
        self._log: dict[str, str] = {}

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if difficulty not in LEVELS:
            raise ValueError(f"chain_sum difficulty {difficulty} not in {sorted(LEVELS)}")
        chains, hops = LEVELS[difficulty]
        if chains * hops + 2 > self.max_turns:
            raise ValueError(f"chain_sum difficulty {difficulty} needs {chains * hops + 2} turns inline; "
                             f"max_turns={self.max_turns}")
        seeds = chain_seeds(seed, difficulty)
        starts, values = [], []
        for s in seeds:
            keys, log = chain.build_log(s, hops)
            starts.append(keys[0])
            values.append(int(chain._VALUE_RE.search(log[keys[-1]]).group(1)))
        return api.Task(id=f"chain_sum/{difficulty}/{seed}", env=self.name, prompt=_prompt(starts),
                        tools=(chain.READ, CALC), difficulty=difficulty,
                        verifier={"log_seeds": seeds, "hops": hops, "starts": starts, "values": values,
                                  "answer": sum(values)})

    def start_episode(self, task: api.Task, seed: int) -> None:
        self._log = {}
        for s in task.verifier["log_seeds"]:
            self._log.update(chain.build_log(int(s), int(task.verifier["hops"]))[1])

    def tools(self):
        return (chain.READ, CALC)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name == CALC.name:
            return str(safe_eval(arguments["expr"]))
        key = str(arguments.get("k", "")).strip().upper()
        if key not in self._log:
            raise api.ToolError(f"no record {key!r}")
        return self._log[key]

    def verify(self, answer: str) -> bool:
        try:
            return int(answer.strip().replace(",", "")) == int(self.task.verifier["answer"])
        except ValueError:
            return False

    def subtask(self, parent: api.Task, text: str) -> api.Task:
        """A delegated key of the parent's log (`KQ`, or any text naming exactly one of its keys)
        as a `chain` task on the chain that holds it; its answer is that chain's value."""
        if parent.env != self.name:
            raise api.ToolError(f"task {parent.id!r} is not a {self.name} task")
        hops = int(parent.verifier["hops"])
        logs = [chain.build_log(int(s), hops)[1] for s in parent.verifier["log_seeds"]]
        named = sorted({k for k in _KEY_RE.findall(str(text)) if any(k in log for log in logs)})
        if len(named) != 1:
            raise api.ToolError(f"a sub-task names one key of this task's log (as {{\"task\": \"KQ\"}}); "
                                f"{str(text)[:80]!r} names {len(named)}")
        key = named[0]
        j = next(i for i, log in enumerate(logs) if key in log)
        return api.Task(id=f"{parent.id}/sub/{key}", env=chain.ChainEnv.name, prompt=chain.PROMPT.format(start=key),
                        tools=(chain.READ,), difficulty=hops,
                        verifier={"log_seed": int(parent.verifier["log_seeds"][j]),
                                  "answer": str(parent.verifier["values"][j])})


def _results(text: str) -> list[str]:
    return [r.strip() for r in _RESULT_RE.findall(text)]


def _calc(values) -> str:
    return tp.format_tool_call(tp.ToolCall(CALC.name, {"expr": "+".join(str(v) for v in values)}))


def expert(task: api.Task, observations, actions) -> str:
    """Inline: follows each chain to its value in turn, then adds the values with calc, then
    answers with calc's result."""
    if actions and f'"{CALC.name}"' in actions[-1]:
        return tp.format_answer(_results(observations[-1])[0])
    values = [m.group(1) for text in observations[1:] if (m := chain._VALUE_RE.search(text))]
    starts = task.verifier["starts"]
    if len(values) == len(starts):
        return _calc(values)
    latest = observations[-1] if len(observations) > 1 else ""
    step = chain._NEXT_RE.search(latest)
    return chain._read(step.group(1) if step else starts[len(values)])


def delegating_expert(task: api.Task, observations, actions) -> str:
    """Delegating: one reply with a `delegate` call per chain (they run at once), then calc over
    the sub-agents' answers, then calc's result as the answer."""
    if not actions:
        return "".join(tp.format_tool_call(tp.ToolCall("delegate", {"task": k})) for k in task.verifier["starts"])
    if f'"{CALC.name}"' in actions[-1]:
        return tp.format_answer(_results(observations[-1])[0])
    return _calc(_results(observations[-1]))


expert.delegate = delegating_expert
api.register(ChainSumEnv.name, ChainSumEnv, expert=expert)
