"""Task data through TFDS builders and grain: reproducible streams, disjoint shards."""

import itertools

import pytest

from jaxrl_agent import envs

datasets = pytest.importorskip("jaxrl_agent.envs.datasets")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _ids(ds, n):
    return [t.id for t in itertools.islice(iter(ds.to_iter_dataset()), n)]


@pytest.mark.parametrize("env", envs.BUILTIN_ENVS)
def test_builders_generate_every_difficulty_and_hold_out_test_seeds(env, data_dir):
    train = list(datasets.task_dataset(env, "train", data_dir=data_dir, config="tiny", num_epochs=1, shuffle=False))
    test = list(datasets.task_dataset(env, "test", data_dir=data_dir, config="tiny", num_epochs=1, shuffle=False))
    difficulties = envs.make(env).difficulties
    assert len(train) == 32 * len(difficulties) and len(test) == 8 * len(difficulties)
    assert {t.difficulty for t in train} == set(difficulties)
    assert not {t.id for t in train} & {t.id for t in test}
    # A stored task is exactly the task the environment generates for that seed.
    first = train[0]
    seed = int(first.id.rsplit("/", 1)[1])
    assert envs.make(env).sample_task(seed, first.difficulty) == first


def test_same_seed_same_stream_and_different_seed_different_stream(data_dir):
    a = _ids(datasets.task_dataset("calculator", data_dir=data_dir, config="tiny", seed=3), 300)
    b = _ids(datasets.task_dataset("calculator", data_dir=data_dir, config="tiny", seed=3), 300)
    c = _ids(datasets.task_dataset("calculator", data_dir=data_dir, config="tiny", seed=4), 300)
    assert a == b and a != c
    assert len(set(a[:160])) == 160  # one epoch visits every task once


def test_process_shards_are_disjoint_and_cover_the_split(data_dir):
    shards = [
        {t.id for t in datasets.task_dataset("kb_search", data_dir=data_dir, config="tiny", num_epochs=1,
                                             shard_index=i, shard_count=3)}
        for i in range(3)
    ]
    assert all(not (shards[i] & shards[j]) for i in range(3) for j in range(i + 1, 3))
    everything = {t.id for t in datasets.task_dataset("kb_search", data_dir=data_dir, config="tiny", num_epochs=1)}
    assert set().union(*shards) == everything
    with pytest.raises(ValueError, match="shard_index"):
        datasets.task_dataset("kb_search", data_dir=data_dir, config="tiny", shard_index=3, shard_count=3)


def test_iterator_state_restores_the_same_continuation(data_dir):
    ds = datasets.task_dataset("terminal", data_dir=data_dir, config="tiny", seed=7).to_iter_dataset()
    it = iter(ds)
    for _ in range(10):
        next(it)
    state = it.get_state()
    expected = [next(it).id for _ in range(5)]
    resumed = iter(ds)
    resumed.set_state(state)
    assert [next(resumed).id for _ in range(5)] == expected


def test_difficulty_filter(data_dir):
    tasks = list(datasets.task_dataset("calculator", data_dir=data_dir, config="tiny", num_epochs=1,
                                       difficulties=(2, 5)))
    assert len(tasks) == 64 and {t.difficulty for t in tasks} == {2, 5}
