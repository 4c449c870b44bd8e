"""Environment API: tasks, observations, steps, the tool-using environment base, the registry.

An `Environment` is plain Python (no JAX): `reset(task, seed) -> Observation`, then
`step(action_text) -> Step(observation, reward, done, info)` until `done`. `ToolEnvironment`
implements that loop for tool-using tasks: it parses the model's turn with the one tool protocol
(`tool_protocol.parse_tool_calls`), runs the calls, returns their results as the next observation,
and on `<answer>` (or when turns run out) verifies the answer and returns the composite reward with
its named components in `info["reward_components"]`.

Register your own environment with `register(name, factory, expert=...)`; `make(name, **kwargs)`
builds any registered one. Everything here is JSON-serialisable (`to_dict` / `from_dict`) so it can
cross process and host boundaries.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import random
from typing import Any, Callable, Mapping, Sequence

from jaxrl_agent.envs import tool_protocol as tp
from jaxrl_agent.envs.tool_protocol import ToolSpec

# Seeds from here on are held out: evaluation and the `test` split use them, training never does.
HELD_OUT_SEED_OFFSET = 1_000_000

# Why an episode ended. The environment sets the first three; the env service (or the in-process
# watchdog) the next two; 'env_reset_error' is an episode whose reset failed (nothing sampled);
# 'env_resume_mismatch' a suspended episode whose environment, rebuilt on resume by replaying its
# actions, answered differently from the first time.
FINISH_REASONS = ("answer", "max_turns", "env_error", "env_timeout", "env_crash", "env_reset_error",
                  "env_resume_mismatch")


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem instance. `verifier` holds what the verifier (and the scripted expert) need and
    the policy never sees."""

    id: str
    env: str
    prompt: str
    tools: tuple[ToolSpec, ...]
    verifier: Mapping[str, Any]
    difficulty: int

    def to_dict(self) -> dict:
        return {"id": self.id, "env": self.env, "prompt": self.prompt, "tools": [t.to_dict() for t in self.tools],
                "verifier": dict(self.verifier), "difficulty": self.difficulty}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Task":
        return cls(id=d["id"], env=d["env"], prompt=d["prompt"], tools=tuple(ToolSpec.from_dict(t) for t in d["tools"]),
                   verifier=d["verifier"], difficulty=int(d["difficulty"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Task":
        return cls.from_dict(json.loads(s))


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the policy sees next. `role` is the turn-template role it is rendered with ('user' for
    the task prompt, 'tool' for tool results); `system` (reset only) describes the tools."""

    text: str
    role: str = "tool"
    system: str | None = None
    # Reset only, for policies that see tools in their model's own format (`tool_formats`): the
    # tools as {"name", "description", "parameters"} dicts, and the system prompt's instructions
    # without the protocol's tool description (how to answer).
    tools: tuple | None = None
    instructions: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Observation":
        d = dict(d)
        if d.get("tools") is not None:
            d["tools"] = tuple(dict(t) for t in d["tools"])
        return cls(**d)


def with_runner_tool(first: "Observation", spec: ToolSpec) -> "Observation":
    """An episode's first observation with a tool the episode runner handles itself (the `context`
    tool, `delegate`), never the environment: in the tool list a model format renders, and in the
    environment's system prompt."""
    d = spec.to_dict()
    system = first.system
    if system:
        system = f"{system}\nAlso: {json.dumps(d, separators=(',', ':'))} (handled by the runner)."
    return dataclasses.replace(first, system=system, tools=(*(first.tools or ()), d))


@dataclasses.dataclass(frozen=True)
class Step:
    observation: Observation
    reward: float
    done: bool
    info: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"observation": self.observation.to_dict(), "reward": self.reward, "done": self.done,
                "info": dict(self.info)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Step":
        return cls(Observation.from_dict(d["observation"]), float(d["reward"]), bool(d["done"]), d["info"])


class Environment(abc.ABC):
    """A multi-turn environment. Subclasses are final; state lives in the instance."""

    name: str = ""
    difficulties: tuple[int, ...] = (1,)

    @abc.abstractmethod
    def sample_task(self, seed: int, difficulty: int) -> Task:
        """A task, deterministic in (seed, difficulty)."""

    @abc.abstractmethod
    def reset(self, task: Task, seed: int = 0) -> Observation:
        """Starts an episode on `task`."""

    @abc.abstractmethod
    def step(self, action: str) -> Step:
        """Applies the policy's turn (text)."""

    def close(self) -> None:
        """Releases resources held by the episode (default: none)."""

    def subtask(self, parent: Task, text: str) -> Task:
        """The task a `delegate` call's `text` names within `parent` (one of this environment's
        tasks): a sub-agent runs it in an episode of the returned task's `env`
        (`rollout.delegation`). Raises ToolError where `text` names none; by default an environment
        makes no sub-tasks."""
        raise ToolError(f"the {self.name or type(self).__name__} environment makes no sub-tasks")


class ToolError(Exception):
    """A tool rejected its input; the message goes back to the policy as the tool's result."""


DEFAULT_REWARD_WEIGHTS = {"correctness": 1.0, "format": 0.1, "efficiency": 0.0}


class ToolEnvironment(Environment):
    """A tool-using episode: calls -> results, until `<answer>` or `max_turns`.

    Reward (final step only; 0 before): sum_k weights[k] * component[k] with
      correctness = 1 if `verify(answer)` else 0
      format      = -(turns with a malformed call, or with neither a call nor an answer) / turns
      efficiency  = -turns used / max_turns
    """

    def __init__(self, *, max_turns: int = 6, reward_weights: Mapping[str, float] | None = None,
                 max_calls_per_turn: int = 4):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        weights = dict(DEFAULT_REWARD_WEIGHTS)
        for key, value in (reward_weights or {}).items():
            if key not in weights:
                raise ValueError(f"unknown reward component {key!r}; expected one of {sorted(weights)}")
            weights[key] = float(value)
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.reward_weights = weights
        self._task: Task | None = None

    # ------------------------------------------------------------------ what a subclass provides
    @abc.abstractmethod
    def tools(self) -> tuple[ToolSpec, ...]:
        """The tools of this environment."""

    @abc.abstractmethod
    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Runs a validated call against the episode's state; raises ToolError on bad input."""

    @abc.abstractmethod
    def verify(self, answer: str) -> bool:
        """Whether the final answer is correct for the current task."""

    def start_episode(self, task: Task, seed: int) -> None:
        """Builds the episode's state from the task (deterministic in task and seed)."""

    # ------------------------------------------------------------------ the loop
    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        return self._task

    def system_prompt(self) -> str:
        specs = "\n".join(json.dumps(t.to_dict(), separators=(",", ":")) for t in self.tools())
        return (
            f"You can call tools. Tools:\n{specs}\nCall one with {tp.CALL_OPEN}"
            f'{{"name":...,"arguments":{{...}}}}{tp.CALL_CLOSE}; results come back in '
            f"{tp.RESULT_OPEN}...{tp.RESULT_CLOSE}. {self.instructions()}"
        )

    def instructions(self) -> str:
        """What the system prompt says beyond the tools: how to give the answer."""
        return f"Give the final answer as {tp.ANSWER_OPEN}...{tp.ANSWER_CLOSE}."

    def reset(self, task: Task, seed: int = 0) -> Observation:
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} is for environment {task.env!r}, not {self.name!r}")
        self._task = task
        self._turns = 0
        self._malformed = 0
        self._chars = 0
        self._calls: list[str] = []
        self._done = False
        self.start_episode(task, seed)
        return Observation(text=task.prompt, role="user", system=self.system_prompt(),
                           tools=tuple(t.to_dict() for t in self.tools()), instructions=self.instructions())

    def _finish(self, answer: str | None, finish_reason: str, observation_text: str) -> Step:
        correct = answer is not None and self._safe_verify(answer)
        components = {
            "correctness": 1.0 if correct else 0.0,
            "format": -self._malformed / max(self._turns, 1),
            "efficiency": -self._turns / self.max_turns,
        }
        reward = sum(self.reward_weights[k] * v for k, v in components.items())
        self._done = True
        info = {
            "finish_reason": finish_reason,
            "success": correct,
            "reward_components": components,
            "turns": self._turns,
            "chars": self._chars,
            "tool_calls": list(self._calls),
            "answer": answer,
        }
        return Step(Observation(observation_text), float(reward), True, info)

    def _safe_verify(self, answer: str) -> bool:
        try:
            return bool(self.verify(answer))
        except Exception:  # noqa: BLE001 - a verifier crash on odd output is a wrong answer, not a crash
            return False

    def step(self, action: str) -> Step:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.task  # raises before reset()
        if not isinstance(action, str):
            action = str(action)
        self._turns += 1
        self._chars += len(action)
        parsed = tp.parse_tool_calls(action, self.tools())
        if parsed.errors or (not parsed.calls and parsed.answer is None):
            self._malformed += 1
        if parsed.answer is not None:
            return self._finish(parsed.answer, "answer", "")
        results = []
        for error in parsed.errors:
            results.append(tp.format_tool_result(f"error: {error.message}"))
        for call in parsed.calls[: self.max_calls_per_turn]:
            self._calls.append(call.name)
            try:
                result = self.call_tool(call.name, call.arguments)
            except ToolError as err:
                result = f"error: {err}"
            results.append(tp.format_tool_result(result))
        if len(parsed.calls) > self.max_calls_per_turn:
            results.append(tp.format_tool_result(f"error: at most {self.max_calls_per_turn} calls per turn"))
        if not results:
            results.append(tp.format_tool_result(
                f"error: no tool call or answer found; call a tool with {tp.CALL_OPEN}...{tp.CALL_CLOSE} "
                f"or answer with {tp.ANSWER_OPEN}...{tp.ANSWER_CLOSE}"))
        text = "".join(results)
        if self._turns >= self.max_turns:
            return self._finish(None, "max_turns", text)
        return Step(Observation(text), 0.0, False, {"turns": self._turns})


# ------------------------------------------------------------------------------------- registry
Expert = Callable[[Task, Sequence[str], Sequence[str]], str]
"""expert(task, observations so far, actions so far) -> next action text."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    factory: Callable[..., Environment]
    expert: Expert | None


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, factory: Callable[..., Environment], *, expert: Expert | None = None,
             overwrite: bool = False) -> None:
    """Makes `make(name, **kwargs)` call `factory(**kwargs)`; `expert` is the scripted policy."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"environment {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = _Entry(factory, expert)


def registered() -> list[str]:
    return sorted(_REGISTRY)


def make(name: str, **kwargs) -> Environment:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; registered: {registered()}") from None
    env = entry.factory(**kwargs)
    if env.name != name:
        raise ValueError(f"factory for {name!r} built an environment named {env.name!r}")
    return env


def factory_module(name: str) -> str | None:
    """The module that registered `name` (worker processes import it before `make`); None if `name`
    is not registered in this process (it may be in the workers, through their imports)."""
    entry = _REGISTRY.get(name)
    return None if entry is None else getattr(entry.factory, "__module__", None)


def in_process_safe(name: str) -> bool:
    """Whether `name`'s environment may run in the trainer's own process when `env.service='auto'`:
    its factory is a class that itself declares `in_process_safe = True` (the library's pure
    environments: bounded Python that runs no policy code and calls no blocking tool). Not
    inherited: a subclass may change what a step does, and a module that registers the name again
    with a factory of its own sends it back to worker processes."""
    entry = _REGISTRY.get(name)
    return entry is not None and isinstance(entry.factory, type) and vars(entry.factory).get("in_process_safe") is True


def uses_sandbox(name: str) -> bool:
    """Whether `name`'s environment runs policy code in the sandbox (its factory's `uses_sandbox`)."""
    entry = _REGISTRY.get(name)
    return bool(entry is not None and getattr(entry.factory, "uses_sandbox", False))


def expert_policy(name: str) -> Expert:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown environment {name!r}; registered: {registered()}")
    if entry.expert is None:
        raise ValueError(f"environment {name!r} has no scripted expert")
    return entry.expert


def task_rng(env: str, seed: int, difficulty: int) -> random.Random:
    """The RNG a task is generated from: a pure function of (env, difficulty, seed)."""
    return random.Random(f"{env}/{difficulty}/{seed}")


def run_episode(env: Environment, task: Task, policy: Callable[[Task, Sequence[str], Sequence[str]], str],
                seed: int = 0, max_steps: int = 64) -> tuple[Step, list[str], list[str]]:
    """Plays one episode in-process: returns (final step, observations, actions)."""
    observations = [env.reset(task, seed).text]
    actions: list[str] = []
    for _ in range(max_steps):
        action = policy(task, observations, actions)
        actions.append(action)
        step = env.step(action)
        observations.append(step.observation.text)
        if step.done:
            return step, observations, actions
    raise RuntimeError(f"episode did not end within {max_steps} steps")
