"""Data from files: task records through grain (sharded, checkpointable, malformed records counted)
and chat-format demonstrations rendered exactly as the scripted expert's episodes are."""

import json

import numpy as np
import pytest

from jaxrl_agent import data, envs, replay, rollout, tokenizer as tok
from jaxrl_agent.envs import tool_protocol as tp
from jaxrl_agent.replay import Trajectory

TOKENIZER = tok.CharTokenizer()
CALC = envs.make("calculator")


def _task_file(path, n=20, extra_lines=()):
    data.write_jsonl(str(path), [CALC.sample_task(i, 1 + i % 3).to_dict() for i in range(n)])
    with open(path, "a") as f:
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def test_task_records_are_parsed_sharded_and_malformed_ones_counted(tmp_path):
    path = _task_file(tmp_path / "tasks.jsonl", extra_lines=[
        "{not json", "[1, 2]", json.dumps({"env": "calculator"}), json.dumps({"prompt": "Q: 1+1=?", "env": "nowhere"}),
        json.dumps({"prompt": "Q: 1+1=?", "difficulty": "hard"}), json.dumps({"prompt": "Q: 2+2=?"})])
    stream = data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], shuffle=False)
    assert stream.skipped == {"not_json": 1, "not_an_object": 1, "missing_prompt": 1, "unknown_env": 1,
                              "bad_field": 1}
    assert stream.size == 21
    tasks = stream.take(21)
    assert [t.id for t in tasks[:20]] == [CALC.sample_task(i, 1 + i % 3).id for i in range(20)]
    # Only 'prompt' is required: env, id, difficulty and verifier take their defaults.
    assert (tasks[20].env, tasks[20].id, tasks[20].difficulty, tasks[20].prompt) == \
        ("calculator", "tasks.jsonl:25", 1, "Q: 2+2=?")
    assert stream.take(1)[0].id == tasks[0].id  # repeats
    # Shards are disjoint and together cover the records.
    shards = [data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], shuffle=False,
                                shard_index=i, shard_count=3) for i in range(3)]
    ids = [set(t.id for t in s.take(s.size)) for s in shards]
    assert sum(len(x) for x in ids) == 21 and len(set.union(*ids)) == 21


def test_the_task_stream_resumes_exactly_from_its_state(tmp_path):
    path = _task_file(tmp_path / "tasks.jsonl")
    stream = data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], seed=3)
    stream.take(7)
    state = json.loads(json.dumps(stream.state_dict()))  # as the checkpoint stores it
    expected = [t.id for t in stream.take(30)]  # across the epoch boundary
    resumed = data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], seed=3)
    resumed.load_state_dict(state)
    assert [t.id for t in resumed.take(30)] == expected and resumed.position == 37
    # Shuffled: not file order, and another seed gives another order.
    other = data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], seed=4)
    assert [t.id for t in other.take(20)] != [t.id for t in data.DatasetTasks(
        path, default_env="calculator", known_envs=["calculator"], seed=3).take(20)]


def test_array_record_task_files(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "tasks.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(5):
        writer.write(CALC.sample_task(i, 2).to_json().encode())
    writer.write(b"\xff\xfe")
    writer.close()
    stream = data.DatasetTasks(path, default_env="calculator", known_envs=["calculator"], shuffle=False)
    assert stream.size == 5 and stream.skipped == {"not_json": 1}
    assert [t.id for t in stream.take(5)] == [f"calculator/2/{i}" for i in range(5)]


def _chat_record(task):
    """The expert's calculator episode as an OpenAI-style chat record (a call, its result, the answer)."""
    call = envs.expert_policy("calculator")(task, [task.prompt], [])
    expr = json.loads(call[len(tp.CALL_OPEN):-len(tp.CALL_CLOSE)])["arguments"]["expr"]
    result = str(task.verifier["answer"])
    return {"messages": [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": json.dumps({"expr": expr})}}]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": tp.format_answer(result)}]}


def test_chat_demonstrations_render_exactly_as_expert_episodes(tmp_path):
    tasks = [CALC.sample_task(i, 1 + i % 3) for i in range(6)]
    path = data.write_jsonl(str(tmp_path / "demos.jsonl"), [_chat_record(t) for t in tasks])
    with open(path, "a") as f:
        f.write("{oops\n" + json.dumps({"text": "no messages"}) + "\n"
                + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                + json.dumps({"messages": [{"role": "assistant", "content": "first"}]}) + "\n"
                + json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"},
                                           {"role": "assistant", "content": "a"}]}) + "\n"
                + json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                           {"role": "robot", "content": "x"}]}) + "\n")
    demos, skipped = data.read_demonstrations(path, TOKENIZER, tok.CHATML, env="calculator")
    assert skipped == {"not_json": 1, "no_messages": 1, "no_assistant_turn": 1, "no_prompt_before_assistant": 2,
                       "bad_role": 1}
    assert len(demos) == 6
    for task, demo in zip(tasks, demos):
        expert = rollout.expert_trajectory(CALC, task, envs.expert_policy("calculator"), TOKENIZER, tok.CHATML)
        np.testing.assert_array_equal(demo.tokens, expert.tokens)
        np.testing.assert_array_equal(demo.loss_mask, expert.loss_mask)


def test_bad_data_config_values_are_rejected(tmp_path):
    from jaxrl_agent import build
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    for key, value, message in [("tasks", "tasks.csv", "expected 'procedural', a .jsonl"),
                                ("tasks", str(tmp_path / "missing.jsonl"), "no such file"),
                                ("demonstrations", str(tmp_path / "missing.jsonl"), "no such file")]:
        config.data.tasks, config.data.demonstrations = "procedural", ""
        config.data[key] = value
        with pytest.raises(build.ConfigError, match=f"data.{key}=.*{message}"):
            build.validate_config(config)


def test_a_tfds_builder_as_the_task_source(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    stream = data.DatasetTasks("tfds:calculator/tiny", default_env="calculator", known_envs=["calculator"],
                               shuffle=False, tfds_data_dir=str(tmp_path))
    assert stream.size == 32 * len(CALC.difficulties) and not stream.skipped
    task = stream.take(1)[0]
    seed = int(task.id.rsplit("/", 1)[1])
    assert CALC.sample_task(seed, task.difficulty) == task


def _demo(n, seed):
    mask = np.zeros(n, np.int32)
    mask[n - 2:] = 1
    return Trajectory(tokens=np.full(n, 5, np.int32), loss_mask=mask, sampler_logprobs=np.zeros(n, np.float32),
                      policy_version=np.where(mask == 1, 0, -1).astype(np.int32), reward=0.0, advantage=1.0,
                      task_id=f"demo{seed}")


def test_sft_batches_of_fixed_rows_train_every_demonstration_once_in_the_order_drawn():
    """rows=R: every update first-fits into R rows (one shape); the demonstrations come out in the
    order drawn, none lost or repeated, the one that did not fit first in the next update; too-long
    ones are skipped and counted. rows=None: exactly `draw` per update."""
    rng = np.random.RandomState(0)
    lengths = rng.randint(20, 90, size=400)
    lengths[[7, 50]] = 200  # longer than a row
    stream = iter([_demo(int(n), i) for i, n in enumerate(lengths)])
    source = data.Demonstrations([], fresh=lambda n: [next(stream) for _ in range(n)])
    batches = data.DemonstrationBatches(source, np.random.RandomState(1), draw=16, row_length=128, rows=8)
    seen = []
    for _ in range(20):
        chosen = batches.next()
        assert chosen and replay.first_fit(chosen, 128, max_rows=8)[0] == len(chosen)
        batch, rows = replay.pack(chosen, 128, min_rows=8, decreasing=False)
        assert batch.tokens.shape == (8, 128) and len(rows) <= 8
        # Full: the next waiting demonstration would not have fitted as well.
        assert replay.first_fit(chosen + batches.pending[:1], 128, max_rows=8)[0] == len(chosen)
        seen += [t.task_id for t in chosen]
    drawn = [f"demo{i}" for i in range(len(seen) + len(batches.pending) + batches.skipped)]
    assert seen + [t.task_id for t in batches.pending] == [d for d in drawn if d not in ("demo7", "demo50")]
    assert batches.skipped == 2
    exact = data.DemonstrationBatches(data.Demonstrations([_demo(40, 0), _demo(300, 1)]), np.random.RandomState(0),
                                      draw=64, row_length=128)
    chosen = exact.next()
    assert len(chosen) + exact.skipped == 64 and all(t.task_id == "demo0" for t in chosen)


def test_rows_per_update_is_what_a_batch_packs_into_on_average():
    """Demonstrations of 70 tokens: one per row of 128 (two do not fit), so 64 a batch fill 64 rows;
    of 60 tokens two share a row: 32. Rounded to the nearest multiple, at least one multiple."""
    assert data.rows_for([_demo(70, i) for i in range(256)], 64, 128, 4) == 64
    assert data.rows_for([_demo(60, i) for i in range(256)], 64, 128, 8) == 32
    assert data.rows_for([_demo(60, i) for i in range(10)], 64, 128, 4) == 32  # one short group, scaled
    assert data.rows_for([_demo(60, 0), _demo(60, 1)], 2, 128, 4) == 4
    # 70, 60, 70, 60, ...: a 70 shares a row with nothing (70 + 60 > 128), the 60s pair up: 32 + 16.
    mixed = [_demo(60 if i % 2 else 70, i) for i in range(128)]
    assert data.rows_for(mixed, 64, 128, 4) == 48
    with pytest.raises(ValueError, match="no demonstration fits"):
        data.rows_for([_demo(300, 0)], 64, 128, 4)

