"""Data from files: task records for RL (`data.tasks`) and demonstrations for SFT (`data.demonstrations`).

Task records — JSONL (one JSON object per line), ArrayRecord (each record a JSON object's bytes) or
a TFDS builder (`tfds:<name>[/<builder config>]`: the built-in environments' task builders of
`envs.datasets`, or any TFDS dataset whose examples carry `task_json`) — are read through `grain`:
`DatasetTasks` shuffles (seeded), repeats and shards them by process (`jax.process_index()`), and
its iterator position is part of the checkpoint, so a resumed run continues the exact task stream.
A record is `Task.to_dict()`'s form; only `prompt` is required (`env` defaults to the run's
environment, `id` to `<file>:<record index>`, `verifier` to {}, `difficulty` to 1, `tools` to none).

Demonstrations — JSONL of OpenAI-style chat records, `{"messages": [{"role": "user", "content":
...}, {"role": "assistant", "content": ..., "tool_calls": [...]}, {"role": "tool", "content": ...},
...]}` (the form TRL and verl users already have) — become SFT trajectories rendered with the run's
turn template exactly as sampled episodes are: assistant turns trained on (loss mask 1), everything
else context. Tool calls are written in the tool protocol, tool results wrapped as results.

A malformed record is skipped and counted by reason (`skipped`), never a crash.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxrl_agent.envs import api as env_api
from jaxrl_agent.envs import tool_protocol as tp
from jaxrl_agent.replay.trajectory import Trajectory

TASK_FORMATS = (".jsonl", ".array_record")


def task_source_kind(spec: str) -> str:
    """'procedural', 'jsonl', 'array_record' or 'tfds' for a `data.tasks` value (ValueError otherwise)."""
    if spec == "procedural":
        return "procedural"
    if spec.startswith("tfds:"):
        return "tfds"
    for ext in TASK_FORMATS:
        if spec.endswith(ext):
            return ext[1:]
    raise ValueError(f"data.tasks={spec!r}: expected 'procedural', a .jsonl or .array_record file, or "
                     "'tfds:<name>[/<config>]'")


def _raw_records(spec: str, tfds_data_dir: str | None = None) -> list[Any]:
    kind = task_source_kind(spec)
    if kind == "jsonl":
        with open(spec, encoding="utf-8") as f:
            return [line for line in f if line.strip()]
    if kind == "array_record":
        import grain

        source = grain.sources.ArrayRecordDataSource([spec])
        return [source[i] for i in range(len(source))]
    from jaxrl_agent import quiet

    quiet.quiet_environment()
    with quiet.native_stderr_silenced():
        from jaxrl_agent.envs import datasets  # imports TensorFlow Datasets (and TensorFlow) only here

    name, _, builder_config = spec[len("tfds:"):].partition("/")
    builder = datasets.prepare(name, data_dir=tfds_data_dir or None, config=builder_config or "default")
    source = builder.as_data_source(split="train")
    return [source[i] for i in range(len(source))]


def parse_task(raw: Any, index: int, *, origin: str, default_env: str, known_envs: Sequence[str]
               ) -> tuple[env_api.Task | None, str | None]:
    """(task, None) or (None, reason) for one raw record (a JSON line, JSON bytes, or a TFDS example)."""
    try:
        if isinstance(raw, Mapping) and "task_json" in raw:  # our TFDS builders' examples
            raw = raw["task_json"]
        if isinstance(raw, (bytes, bytearray)):
            raw = raw.decode("utf-8")
        record = json.loads(raw) if isinstance(raw, str) else raw
    except (ValueError, UnicodeDecodeError):
        return None, "not_json"
    if not isinstance(record, Mapping):
        return None, "not_an_object"
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return None, "missing_prompt"
    env = record.get("env", default_env)
    if env not in known_envs:
        return None, "unknown_env"
    try:
        tools = tuple(tp.ToolSpec.from_dict(t) for t in record.get("tools", ()))
        verifier = dict(record.get("verifier", {}))
        difficulty = int(record.get("difficulty", 1))
        task_id = str(record.get("id", f"{origin}:{index}"))
    except (TypeError, ValueError, KeyError):
        return None, "bad_field"
    return env_api.Task(id=task_id, env=env, prompt=prompt, tools=tools, verifier=verifier,
                        difficulty=difficulty), None


class DatasetTasks:
    """Task records from a file or TFDS builder as a grain stream (see the module docstring).

    Args:
      spec: the `data.tasks` value.
      default_env: environment of records that name none.
      known_envs: the run's environments; a record naming another is skipped ('unknown_env').
      seed: shuffle seed (the same seed gives the same stream).
      shuffle: shuffle each epoch's order (False: file order).
      shard_index, shard_count: this process's disjoint share (jax.process_index(), process_count()).
      tfds_data_dir: where TFDS builders are generated and read ('' or None = TFDS's default).
    """

    def __init__(self, spec: str, *, default_env: str, known_envs: Sequence[str], seed: int = 0,
                 shuffle: bool = True, shard_index: int = 0, shard_count: int = 1, tfds_data_dir: str | None = None):
        import grain

        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
        self.spec = spec
        self.skipped: collections.Counter[str] = collections.Counter()
        tasks = []
        origin = os.path.basename(spec)
        for i, raw in enumerate(_raw_records(spec, tfds_data_dir)):
            task, reason = parse_task(raw, i, origin=origin, default_env=default_env, known_envs=known_envs)
            if task is None:
                self.skipped[reason] += 1
            else:
                tasks.append(task)
        shard = tasks[shard_index::shard_count]
        if not shard:
            raise ValueError(f"data.tasks={spec!r}: no usable task records for shard {shard_index} of "
                             f"{shard_count} (skipped: {dict(self.skipped)})")
        self.size = len(shard)
        dataset = grain.MapDataset.source(shard)
        if shuffle:
            dataset = dataset.shuffle(seed=seed)
        self._dataset = dataset.repeat(None).to_iter_dataset()
        self._iterator = iter(self._dataset)
        self.position = 0

    def take(self, n: int) -> list[env_api.Task]:
        tasks = [next(self._iterator) for _ in range(n)]
        self.position += n
        return tasks

    def state_dict(self) -> dict:
        return {"position": self.position, "iterator": self._iterator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._iterator = iter(self._dataset)
        self._iterator.set_state(state["iterator"])
        self.position = int(state["position"])


# ------------------------------------------------------------------------------ demonstrations
def _assistant_text(message: Mapping[str, Any]) -> str:
    text = message.get("content") or ""
    if not isinstance(text, str):
        raise TypeError("assistant content must be a string")
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        text += tp.format_tool_call(tp.ToolCall(function["name"], dict(arguments)))
    return text


def demonstration_trajectory(record: Mapping[str, Any], tokenizer, template, *, env: str = "",
                             task_id: str = "") -> Trajectory:
    """One chat record rendered as an SFT trajectory (raises ValueError/TypeError/KeyError if malformed)."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("no_messages")
    first_assistant = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first_assistant is None:
        raise ValueError("no_assistant_turn")
    context = [{"role": m["role"], "content": str(m.get("content") or "")} for m in messages[:first_assistant]]
    if not context or context[-1]["role"] not in ("user", "tool"):
        raise ValueError("no_prompt_before_assistant")
    tokens = list(template.render(context, tokenizer, add_generation_prompt=True).ids)
    mask = [0] * len(tokens)
    end_ids = list(template.end_ids(tokenizer))
    previous_assistant = False
    for message in messages[first_assistant:]:
        role = message.get("role")
        if role == "assistant":
            if previous_assistant:
                raise ValueError("consecutive_assistant_turns")
            ids = list(tokenizer.encode(_assistant_text(message))) + end_ids
            tokens += ids
            mask += [1] * len(ids)
            previous_assistant = True
        elif role in ("tool", "user"):
            text = str(message.get("content") or "")
            if role == "tool" and not text.startswith(tp.RESULT_OPEN):
                text = tp.format_tool_result(text)
            ids = list(template.continuation_ids(role, text, tokenizer, close_assistant=False))
            tokens += ids
            mask += [0] * len(ids)
            previous_assistant = False
        else:
            raise ValueError("bad_role")
    n = len(tokens)
    return Trajectory(tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, np.int32),
                      sampler_logprobs=np.zeros(n, np.float32), policy_version=np.zeros(n, np.int32), reward=0.0,
                      env=env, task_id=task_id, finish_reason="demonstration")


def read_demonstrations(path: str, tokenizer, template, *, env: str = "") -> tuple[list[Trajectory], dict[str, int]]:
    """(trajectories, {skip reason: count}) from a JSONL of chat records."""
    trajectories, skipped = [], collections.Counter()
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                skipped["not_json"] += 1
                continue
            if not isinstance(record, Mapping) or "messages" not in record:
                skipped["no_messages"] += 1
                continue
            try:
                trajectories.append(demonstration_trajectory(record, tokenizer, template, env=env,
                                                             task_id=f"{os.path.basename(path)}:{i}"))
            except ValueError as err:
                skipped[str(err) if str(err).isidentifier() else "bad_message"] += 1
            except (TypeError, KeyError, AttributeError):
                skipped["bad_message"] += 1
    return trajectories, dict(skipped)


def write_jsonl(path: str, records: Iterable[Mapping[str, Any]]) -> str:
    """Writes records as JSONL (a helper for examples and tests)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


class Demonstrations:
    """SFT examples: a finite pool revisited over epochs (a demonstrations file, or a fixed set of
    expert episodes), or — with an empty pool — fresh episodes from `fresh(n)` at every step.
    `info` is what the run records about a file's records (None for expert episodes)."""

    def __init__(self, pool: Sequence[Trajectory], fresh=None, info: Mapping[str, Any] | None = None):
        if not pool and fresh is None:
            raise ValueError("Demonstrations need a pool or a source of fresh episodes")
        self.pool, self.fresh, self.info = list(pool), fresh, info

    def sample(self, rng: np.random.RandomState, n: int) -> list[Trajectory]:
        if self.pool:
            return [self.pool[i] for i in rng.randint(len(self.pool), size=n)]
        return self.fresh(n)


class DemonstrationBatches:
    """SFT's updates from `Demonstrations`, `draw` (this process's `sft.batch_size`) at a time.

    rows=None: each update is exactly `draw` demonstrations (their packed rows vary: a train-step
    shape per row count). rows=R (`sft.rows_per_update`): each update fills R learner rows of
    `row_length`, the demonstrations placed in the order drawn, first fit; one that does not fit
    waits, first in line, for the next update — none is dropped. Every update then has one shape
    (one compiled train step), about `draw` demonstrations when R is what `draw` of them pack into
    on average (`rows_for`). Either way a demonstration with a sequence longer than a row cannot be
    trained on: it is skipped and counted (`skipped`)."""

    def __init__(self, demonstrations: Demonstrations, rng: np.random.RandomState, *, draw: int, row_length: int,
                 rows: int | None = None, pending: Sequence[Trajectory] = ()):
        if draw < 1 or (rows is not None and rows < 1):
            raise ValueError(f"DemonstrationBatches: draw={draw} and rows={rows} must be >= 1")
        self.demonstrations, self.rng = demonstrations, rng
        self.draw, self.rows, self.row_length = draw, rows, row_length
        self.pending: list[Trajectory] = []
        self.skipped = 0
        self._add(pending)

    def _add(self, trajectories: Sequence[Trajectory]) -> None:
        fitting = [t for t in trajectories if t.longest_segment <= self.row_length]
        self.skipped += len(trajectories) - len(fitting)
        self.pending.extend(fitting)

    def next(self) -> list[Trajectory]:
        """The next update's demonstrations (rows=R: the longest prefix of the waiting ones, drawing
        more as needed, that first-fits into R rows; `replay.pack(..., decreasing=False)` lays them
        out in those rows)."""
        from jaxrl_agent.replay.packing import first_fit

        if self.rows is None:
            self._add(self.demonstrations.sample(self.rng, self.draw))
            chosen, self.pending = self.pending, []
            return chosen
        for _ in range(1000):
            placed, _ = first_fit(self.pending, self.row_length, self.rows)
            if placed < len(self.pending):
                break
            self._add(self.demonstrations.sample(self.rng, self.draw))
        else:  # the draws were all skipped as too long
            raise ValueError(f"no demonstration fits a row of {self.row_length} tokens ({self.skipped} skipped)")
        if placed == 0:
            raise ValueError(f"a demonstration's sequences need more than {self.rows} rows of {self.row_length} "
                             f"tokens (sft.rows_per_update={self.rows})")
        chosen, self.pending = self.pending[:placed], self.pending[placed:]
        return chosen


def rows_for(trajectories: Sequence[Trajectory], per_update: int, row_length: int, multiple: int) -> int:
    """The rows `per_update` demonstrations fill on average, first fit in order, over consecutive
    groups of `trajectories` (at least one group), rounded to the nearest multiple of `multiple`
    (at least one multiple): `sft.rows_per_update=-1`."""
    from jaxrl_agent.replay.packing import first_fit

    fitting = [t for t in trajectories if t.longest_segment <= row_length]
    if not fitting:
        raise ValueError(f"no demonstration fits a row of {row_length} tokens")
    groups = [fitting[i:i + per_update] for i in range(0, len(fitting), per_update)]
    groups = [g for g in groups if len(g) == per_update] or groups  # a short group only when it is all
    mean = float(np.mean([first_fit(g, row_length)[1] * per_update / len(g) for g in groups]))
    return max(multiple, int(round(mean / multiple)) * multiple)
