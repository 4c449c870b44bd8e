"""`kb_search`: multi-hop questions over a generated knowledge base, with `search` and `lookup`.

Each task generates its own small knowledge base of people, companies, cities and countries. The
question names one person; the answer is a fact one to three hops away and is never in the prompt,
so the policy must look entities up (partial observability). Difficulty = number of hops:
  1: Where was P born?                              person -> city
  2: In which city is P's employer headquartered?   person -> company -> city
  3: In which country is P's employer headquartered?  person -> company -> city -> country
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from jaxrl_agent.envs import api, tool_protocol as tp

SYLLABLES = ("ka", "lo", "mi", "ra", "ve", "to", "su", "ne", "pa", "di", "zo", "ri", "fa", "gu", "be", "xi")
QUESTIONS = {
    1: "Where was {person} born?",
    2: "In which city is the company that {person} works at headquartered?",
    3: "In which country is the company that {person} works at headquartered?",
}

SEARCH = tp.ToolSpec("search", "Finds entities whose name contains the query; returns up to 5 names.",
                     {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})
LOOKUP = tp.ToolSpec("lookup", "Returns the facts about one entity, by exact name.",
                     {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def _names(rng, count: int, syllables: int, used: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()
        if name not in used:
            used.add(name)
            out.append(name)
    return out


def build_kb(seed: int, difficulty: int) -> dict[str, dict[str, str]]:
    """{entity name: {fact: value}}; deterministic in (seed, difficulty)."""
    rng = api.task_rng("kb_search/kb", seed, difficulty)
    used: set[str] = set()
    countries = _names(rng, 3, 3, used)
    cities = _names(rng, 5, 2, used)
    companies = [n + " Corp" for n in _names(rng, 4, 3, used)]
    people = [f"{a} {b}" for a, b in zip(_names(rng, 8, 2, used), _names(rng, 8, 3, used))]
    kb: dict[str, dict[str, str]] = {}
    for c in countries:
        kb[c] = {"type": "country"}
    for c in cities:
        kb[c] = {"type": "city", "country": rng.choice(countries)}
    for c in companies:
        kb[c] = {"type": "company", "headquarters": rng.choice(cities), "founded": str(rng.randint(1900, 2020))}
    for p in people:
        kb[p] = {"type": "person", "born_in": rng.choice(cities), "works_at": rng.choice(companies),
                 "age": str(rng.randint(20, 70))}
    return kb


def _answer(kb, person: str, difficulty: int) -> str:
    if difficulty == 1:
        return kb[person]["born_in"]
    city = kb[kb[person]["works_at"]]["headquarters"]
    return city if difficulty == 2 else kb[city]["country"]


def _format_facts(name: str, facts: Mapping[str, str]) -> str:
    return f"{name}: " + "; ".join(f"{k}={v}" for k, v in facts.items())


def _norm(s: str) -> str:
    return " ".join(s.strip().lower().split()).rstrip(".")


class KBSearchEnv(api.ToolEnvironment):
    name = "kb_search"
    in_process_safe = True  # pure Python, no policy code run: env.service='auto' keeps it in process
    difficulties = (1, 2, 3)

    def __init__(self, *, max_turns: int = 6, reward_weights: Mapping[str, float] | None = None):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)
        self._kb: dict[str, dict[str, str]] = {}

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if difficulty not in QUESTIONS:
            raise ValueError(f"kb_search difficulty {difficulty} not in {sorted(QUESTIONS)}")
        kb = build_kb(seed, difficulty)
        rng = api.task_rng(self.name, seed, difficulty)
        person = rng.choice(sorted(n for n, f in kb.items() if f["type"] == "person"))
        return api.Task(id=f"kb_search/{difficulty}/{seed}", env=self.name,
                        prompt=QUESTIONS[difficulty].format(person=person), tools=(SEARCH, LOOKUP),
                        verifier={"kb_seed": seed, "answer": _answer(kb, person, difficulty)}, difficulty=difficulty)

    def start_episode(self, task: api.Task, seed: int) -> None:
        self._kb = build_kb(int(task.verifier["kb_seed"]), task.difficulty)

    def tools(self):
        return (SEARCH, LOOKUP)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name == "search":
            query = _norm(arguments["query"])
            if not query:
                raise api.ToolError("empty query")
            hits = [n for n in sorted(self._kb) if query in n.lower()][:5]
            return ", ".join(hits) if hits else "no results"
        key = next((n for n in self._kb if _norm(n) == _norm(arguments["name"])), None)
        if key is None:
            raise api.ToolError(f"no entity named {arguments['name']!r}; try search")
        return _format_facts(key, self._kb[key])

    def verify(self, answer: str) -> bool:
        return _norm(answer) == _norm(self.task.verifier["answer"])


_FACT_RE = re.compile(r"(\w+)=([^;<]+)")


def _facts(observation: str) -> dict[str, str]:
    return {k: v.strip() for k, v in _FACT_RE.findall(observation)}


def expert(task: api.Task, observations, actions) -> str:
    """Follows the chain person -> employer -> headquarters -> country with `lookup`."""
    person = re.search(r"(?:was|that) ([A-Z]\w+ [A-Z]\w+)", task.prompt).group(1)
    lookup = lambda name: tp.format_tool_call(tp.ToolCall("lookup", {"name": name}))
    if not actions:
        return lookup(person)
    facts = _facts(observations[-1])
    if "born_in" in facts:  # the person's facts
        if task.difficulty == 1:
            return tp.format_answer(facts["born_in"])
        return lookup(facts["works_at"])
    if "headquarters" in facts:
        if task.difficulty == 2:
            return tp.format_answer(facts["headquarters"])
        return lookup(facts["headquarters"])
    if "country" in facts:
        return tp.format_answer(facts["country"])
    return tp.format_answer("unknown")


api.register(KBSearchEnv.name, KBSearchEnv, expert=expert)
