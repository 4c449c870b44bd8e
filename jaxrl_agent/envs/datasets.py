"""Task data: TensorFlow Datasets builders for the built-in environments, read through `grain`.

Each environment's tasks are a TFDS dataset (`calculator_tasks`, `kb_search_tasks`,
`terminal_tasks`, `code_tasks`, `chain_tasks`, `chain_sum_tasks`) generated locally from seeds — nothing is downloaded. Splits:
`train` (seeds 0..n-1 per difficulty) and `test` (held-out seeds from 1_000_000). They are written
as ArrayRecord so `grain` can read them by index; `task_dataset(...)` returns a grain pipeline
(shuffle, repeat, shard by process index) of `Task`s whose iterator state is checkpointable. A real
TFDS dataset can be used instead by name, with a `to_task` function mapping its examples to Tasks.

This module imports TensorFlow Datasets (and TensorFlow); the rest of `jaxrl_agent.envs` does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import grain
import numpy as np
import tensorflow_datasets as tfds

from jaxrl_agent.envs import api

TEST_SEED_OFFSET = api.HELD_OUT_SEED_OFFSET


@dataclasses.dataclass
class TaskBuilderConfig(tfds.core.BuilderConfig):
    """How many tasks per difficulty go into each split."""

    train_per_difficulty: int = 2000
    test_per_difficulty: int = 128


_CONFIGS = [
    TaskBuilderConfig(name="default", description="2000 train / 128 test tasks per difficulty."),
    TaskBuilderConfig(name="tiny", description="32 train / 8 test tasks per difficulty (tests).",
                      train_per_difficulty=32, test_per_difficulty=8),
]


class _EnvTasks(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Tasks of one environment, generated from seeds."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = _CONFIGS
    ENV = ""

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=f"Procedurally generated tasks of the jaxrl_agent `{self.ENV}` environment.",
            features=tfds.features.FeaturesDict({
                "task_id": tfds.features.Text(),
                "env": tfds.features.Text(),
                "difficulty": tfds.features.Scalar(dtype=np.int32),
                "prompt": tfds.features.Text(),
                "task_json": tfds.features.Text(),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        cfg = self.builder_config
        return {
            "train": self._generate_examples(0, cfg.train_per_difficulty),
            "test": self._generate_examples(TEST_SEED_OFFSET, cfg.test_per_difficulty),
        }

    def _generate_examples(self, first_seed: int, count: int):
        import jaxrl_agent.envs  # noqa: F401 - registers the environments

        env = api.make(self.ENV)
        for difficulty in env.difficulties:
            for seed in range(first_seed, first_seed + count):
                task = env.sample_task(seed, difficulty)
                yield task.id, {"task_id": task.id, "env": task.env, "difficulty": task.difficulty,
                                "prompt": task.prompt, "task_json": task.to_json()}


class CalculatorTasks(_EnvTasks):
    ENV = "calculator"


class KbSearchTasks(_EnvTasks):
    ENV = "kb_search"


class TerminalTasks(_EnvTasks):
    ENV = "terminal"


class CodeTasks(_EnvTasks):
    ENV = "code"


class ChainTasks(_EnvTasks):
    ENV = "chain"


class ChainSumTasks(_EnvTasks):
    ENV = "chain_sum"


BUILDERS = {b.ENV: b for b in (CalculatorTasks, KbSearchTasks, TerminalTasks, CodeTasks, ChainTasks, ChainSumTasks)}


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def example_to_task(example: Mapping[str, Any]) -> api.Task:
    """Our builders' examples carry the whole task as JSON."""
    return api.Task.from_json(_text(example["task_json"]))


def prepare(name: str, *, data_dir: str | None = None, config: str = "default") -> tfds.core.DatasetBuilder:
    """The TFDS builder for an environment name (or any registered TFDS dataset), generated if needed."""
    if name in BUILDERS:
        builder = BUILDERS[name](data_dir=data_dir, config=config)
    else:
        builder = tfds.builder(name, data_dir=data_dir)
    builder.download_and_prepare(file_format="array_record")
    return builder


def task_dataset(
    name: str,
    split: str = "train",
    *,
    data_dir: str | None = None,
    config: str = "default",
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    difficulties: tuple[int, ...] | None = None,
    to_task: Callable[[Mapping[str, Any]], api.Task] = example_to_task,
) -> grain.MapDataset:
    """A grain pipeline of Tasks.

    Args:
      name: an environment ('calculator', ...) or any TFDS dataset name (then pass `to_task`).
      split: 'train' or 'test'.
      seed: shuffle seed; the same seed gives the same task stream.
      num_epochs: None repeats forever.
      shard_index, shard_count: this process's shard (e.g. jax.process_index(), jax.process_count());
        shards are disjoint and together cover the split.
      difficulties: keep only these difficulties (filtered before sharding).

    Returns:
      A `grain.MapDataset` of `Task`s; `.to_iter_dataset()` gives a checkpointable iterator.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    builder = prepare(name, data_dir=data_dir, config=config)
    source = builder.as_data_source(split=split)
    ds = grain.MapDataset.source(source)
    if difficulties is not None:
        keep = [i for i in range(len(source)) if int(source[i]["difficulty"]) in difficulties]
        ds = grain.MapDataset.range(len(keep)).map(lambda i: source[keep[i]])
    ds = ds[shard_index::shard_count]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.map(to_task)
