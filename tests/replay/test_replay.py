"""Trajectory validation, the replay buffer, and packing."""

import dataclasses
import json

import numpy as np
import pytest

from jaxrl_agent.replay import (PartialRollout, ReplayBuffer, Trajectory, minibatch_dataset, minibatch_sizes, pack,
                                pad_batch, validate)


def _traj(n=10, generated=(5, 6, 7), seed=0, **overrides):
    rng = np.random.RandomState(seed)
    mask = np.zeros(n, np.int32)
    mask[list(generated)] = 1
    t = Trajectory(tokens=rng.randint(0, 50, n).astype(np.int32), loss_mask=mask,
                   sampler_logprobs=np.where(mask == 1, -rng.rand(n), 0).astype(np.float32),
                   policy_version=np.where(mask == 1, 3, -1).astype(np.int32), reward=1.0, advantage=0.5,
                   task_id=f"t{seed}")
    return dataclasses.replace(t, **overrides)


BAD = {
    "length_mismatch": dict(loss_mask=np.zeros(9, np.int32)),
    "token_out_of_vocab": dict(tokens=np.full(10, 99, np.int32)),
    "mask_not_binary": dict(loss_mask=np.full(10, 2, np.int32)),
    "no_generated_tokens": dict(loss_mask=np.zeros(10, np.int32)),
    "generated_first_token": dict(loss_mask=np.ones(10, np.int32)),
    "bad_logprobs": dict(sampler_logprobs=np.full(10, np.nan, np.float32)),
    "missing_version": dict(policy_version=np.full(10, -1, np.int32)),
    "non_finite_reward": dict(reward=float("inf")),
    "bad_segments": dict(segment_starts=(6, 4)),
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_invalid_records_are_rejected_with_their_reason(reason):
    t = _traj(**BAD[reason])
    assert validate(t, vocab_size=50, max_length=64) == reason
    buffer = ReplayBuffer()
    good = _traj(seed=1)
    assert buffer.admit([t, good], vocab_size=50, max_length=64) == [good]
    assert buffer.rejected == {reason: 1} and buffer.admitted == 1


def test_too_long():
    assert validate(_traj(n=100), vocab_size=50, max_length=64) == "too_long"


def test_versions_from_the_future_and_garbage_records():
    buffer = ReplayBuffer()
    assert buffer.admit([_traj()], vocab_size=50, max_length=64, current_version=2) == []
    assert buffer.rejected == {"version_from_future": 1}
    assert buffer.admit([object()], vocab_size=50, max_length=64) == []  # not even a Trajectory: counted
    assert sum(buffer.rejected.values()) == 2


def _task(i):
    from jaxrl_agent import envs

    return envs.make("calculator").sample_task(i, 1)


def _partial(n, seed=0):
    t = _traj(n=n, generated=range(n // 2, n), seed=seed)
    return PartialRollout(tokens=t.tokens, loss_mask=t.loss_mask, sampler_logprobs=t.sampler_logprobs,
                          policy_version=t.policy_version, turn_start=n // 2, actions=("a",),
                          observation_digests=("d",), messages=({"role": "user", "content": "q"},), suspensions=1)


def test_groups_with_finished_and_suspended_episodes_round_trip_exactly():
    buffer = ReplayBuffer()
    first, second = buffer.open(_task(0), 2), buffer.open(_task(1), 3)
    assert (first, second) == (0, 1)
    buffer.finish(first, 1, _traj(seed=1))
    buffer.suspend(first, 0, _partial(12))
    buffer.suspend(first, 0, _partial(20, seed=2))  # a later snapshot replaces the earlier one
    buffer.finish(second, 2, _traj(seed=3))
    assert buffer.tokens == 10 + 20 + 10 and buffer.partial_episodes() == 1
    assert buffer.unfinished_indices() == [0, 1] and buffer.finished_indices() == []
    with pytest.raises(ValueError, match="not finished"):
        buffer.take([first])
    restored = ReplayBuffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))  # through JSON, as checkpointed
    assert restored.tokens == buffer.tokens and restored.next_index == 2
    saved, original = restored.group(first).partial[0], buffer.group(first).partial[0]
    for field in ("tokens", "loss_mask", "sampler_logprobs", "policy_version"):
        np.testing.assert_array_equal(getattr(saved, field), getattr(original, field))
    assert (saved.turn_start, saved.actions, saved.messages) == (10, ("a",), ({"role": "user", "content": "q"},))
    np.testing.assert_array_equal(restored.group(first).done[1].tokens, _traj(seed=1).tokens)
    # The episode finishes: its snapshot's tokens are replaced by its trajectory's.
    restored.finish(first, 0, _traj(n=30, seed=4))
    assert restored.finished_indices() == [0] and restored.tokens == 10 + 30 + 10
    (group,) = restored.take([first])
    assert [t.length for t in group] == [30, 10] and restored.tokens == 10
    with pytest.raises(ValueError, match="finished twice"):
        restored.finish(second, 2, _traj())


@pytest.mark.parametrize("seed", range(3))
def test_memory_stays_within_the_token_capacity_under_heavy_tailed_lengths(seed):
    """Pareto-distributed episode lengths (a few episodes 100x the median): the tokens held, and the
    bytes of the arrays held, never exceed the capacity; every group lost to it is counted."""
    rng = np.random.RandomState(seed)
    capacity = 4_000
    buffer = ReplayBuffer(capacity_tokens=capacity)
    opened, taken, evicted_seen = [], 0, 0
    for step in range(400):
        if rng.rand() < 0.2 or not buffer.unfinished_indices():
            opened.append(buffer.open(_task(step), 4))
        index = int(rng.choice(buffer.unfinished_indices()))
        group = buffer.group(index)
        sample = int(rng.choice([i for i in range(4) if i not in group.done]))
        n = int(min(20 * (1 + rng.pareto(1.1)), 3_000))  # median ~25 tokens, tail to 3000
        evicted = (buffer.suspend(index, sample, _partial(max(n, 4), seed=step)) if rng.rand() < 0.4 else
                   buffer.finish(index, sample, _traj(n=max(n, 8), seed=step)))
        evicted_seen += len(evicted)
        assert all(i not in buffer for i in evicted)
        if rng.rand() < 0.1 and buffer.finished_indices():
            taken += len(buffer.take(buffer.finished_indices()[:1]))
        held = [buffer.group(i) for i in buffer.unfinished_indices() + buffer.finished_indices()]
        arrays = [a for g in held for r in [*g.done.values(), *g.partial.values()]
                  for a in (r.tokens, r.loss_mask, r.sampler_logprobs, r.policy_version)]
        assert buffer.tokens == sum(g.tokens for g in held) <= capacity
        assert sum(a.nbytes for a in arrays) <= capacity * 16  # 4 arrays x 4 bytes per token
    assert buffer.evicted_groups == evicted_seen > 0 and buffer.evicted_tokens > 0
    assert buffer.peak_tokens <= capacity
    assert len(buffer) + taken + evicted_seen == len(opened)  # every group accounted for


@pytest.mark.parametrize("count,minibatches", [(10, 4), (3, 5), (0, 2), (8, 1)])
def test_minibatch_sizes_split_as_array_split(count, minibatches):
    assert minibatch_sizes(count, minibatches) == [len(p) for p in np.array_split(np.arange(count), minibatches)]


def test_minibatch_sizes_reject_no_minibatches():
    with pytest.raises(ValueError, match="minibatches=0"):
        minibatch_sizes(4, 0)


def test_the_learner_reads_its_minibatches_through_grain_each_trajectory_once():
    """`minibatch_dataset`: every trajectory in exactly one minibatch, parts of `minibatch_sizes`,
    packed as `pack` packs them; the same seed gives the same minibatches, another seed another
    order; an iterator restored from `get_state()` continues with the same next minibatches."""
    trajectories = [_traj(n=8 + i, generated=(2, 3), seed=i) for i in range(11)]

    def ids(seed):
        dataset = minibatch_dataset(trajectories, 3, seed=seed, pack_fn=lambda part: [t.task_id for t in part])
        return [list(part) for part in dataset]

    parts = ids(7)
    assert [len(p) for p in parts] == minibatch_sizes(11, 3)
    assert sorted(i for p in parts for i in p) == sorted(t.task_id for t in trajectories)
    assert ids(7) == parts and ids(8) != parts

    def packed(part):
        return pack(part, 40)[0]

    dataset = minibatch_dataset(trajectories, 3, seed=7, pack_fn=packed)
    by_id = {t.task_id: t for t in trajectories}
    np.testing.assert_array_equal(dataset[1].tokens, packed([by_id[i] for i in parts[1]]).tokens)
    iterator = iter(dataset.to_iter_dataset())
    next(iterator)
    state = iterator.get_state()
    expected = [b.tokens for b in iterator]
    restored = iter(minibatch_dataset(trajectories, 3, seed=7, pack_fn=packed).to_iter_dataset())
    restored.set_state(state)
    got = [b.tokens for b in restored]
    assert len(got) == len(expected) == 2
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert [list(p) for p in minibatch_dataset([], 2, seed=0, pack_fn=list)] == [[], []]


def test_the_distill_mask_covers_the_distilled_environments_generated_tokens_only():
    a = _traj(seed=1, env="calculator")
    b = _traj(seed=2, env="chain", generated=(3, 4))
    batch, rows = pack([a, b], row_length=24, distill_envs=frozenset({"calculator"}))
    mask, covered = np.asarray(batch.loss_mask), np.asarray(batch.distill_mask)
    seg = np.asarray(batch.segment_ids)
    (r,) = [i for i, row in enumerate(rows) if row]
    first = 1 + rows[r].index(0)  # calculator's segment id in its row
    np.testing.assert_array_equal(covered[r], np.where(seg[r] == first, mask[r], 0))
    assert covered.sum() == a.generated_tokens and covered.dtype == np.float32
    assert pack([a, b], row_length=24)[0].distill_mask is None  # none configured: the term covers all
    padded = pad_batch(batch, rows=4)
    assert padded.distill_mask.shape == (4, 24) and padded.distill_mask[len(rows):].sum() == 0


def test_packing_keeps_every_token_and_separates_segments():
    trajectories = [_traj(n=n, generated=(2, n - 1), seed=i) for i, n in enumerate([30, 12, 25, 7, 18, 30])]
    batch, rows = pack(trajectories, 40, row_multiple=4)
    assert batch.tokens.shape[0] % 4 == 0
    assert sorted(i for r in rows for i in r) == list(range(6))
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            t = trajectories[i]
            sl = slice(start, start + t.length)
            np.testing.assert_array_equal(batch.tokens[r, sl], t.tokens)
            np.testing.assert_array_equal(batch.segment_ids[r, sl], segment)
            np.testing.assert_array_equal(batch.positions[r, sl], np.arange(t.length))
            np.testing.assert_array_equal(batch.loss_mask[r, sl], t.loss_mask)
            np.testing.assert_allclose(batch.advantages[r, sl], t.advantage * t.loss_mask)
            start += t.length
        assert np.all(batch.segment_ids[r, start:] == 0) and np.all(batch.loss_mask[r, start:] == 0)
    assert int(batch.loss_mask.sum()) == sum(t.generated_tokens for t in trajectories)
    with pytest.raises(ValueError, match="exceeds row_length=40"):
        pack([_traj(n=41)], 40)


def test_an_episode_of_several_learner_sequences_is_checked_and_packed_per_sequence():
    """`segment_starts` cut one record into learner sequences: each must fit a row (not the whole
    episode), none may begin with a generated token, and packing gives each its own attention
    segment and positions, with the episode's advantage on every generated token."""
    t = _traj(n=12, generated=(3, 4, 9, 10), segment_starts=(6,))
    assert t.segments == [(0, 6), (6, 12)] and t.longest_segment == 6
    assert validate(t, vocab_size=50, max_length=6) is None  # 12 tokens, but no sequence is longer than 6
    assert validate(dataclasses.replace(t, segment_starts=(9,)), vocab_size=50, max_length=64) == "generated_first_token"
    assert validate(dataclasses.replace(t, segment_starts=(12,)), vocab_size=50, max_length=64) == "bad_segments"
    batch, rows = pack([t], 8)
    assert rows == [[0], [0]]  # two sequences of 6 do not share a row of 8
    for r, (a, b) in enumerate(t.segments):
        np.testing.assert_array_equal(batch.tokens[r, :6], t.tokens[a:b])
        np.testing.assert_array_equal(batch.positions[r, :6], np.arange(6))
        np.testing.assert_array_equal(batch.segment_ids[r], [1] * 6 + [0] * 2)
        np.testing.assert_array_equal(batch.advantages[r, :6], 0.5 * t.loss_mask[a:b])
    assert Trajectory.from_dict(t.to_dict()).segment_starts == (6,)
    assert Trajectory.from_dict({k: v for k, v in t.to_dict().items() if k != "segment_starts"}).segment_starts == ()


def test_first_fit_places_a_prefix_in_order_and_pack_lays_it_out_in_those_rows():
    """Golden values by hand: rows of 40, lengths 30, 12, 25, 7, 18, 30 in that order. First fit:
    30 -> row 0 (10 left), 12 -> row 1 (28), 25 -> row 1 (3), 7 -> row 0 (3), 18 -> row 2 (22),
    30 -> row 3. With at most 3 rows the last one does not fit: 5 placed."""
    from jaxrl_agent.replay import first_fit

    trajectories = [_traj(n=n, generated=(2, n - 1), seed=i) for i, n in enumerate([30, 12, 25, 7, 18, 30])]
    assert first_fit(trajectories, 40) == (6, 4)
    assert first_fit(trajectories, 40, max_rows=3) == (5, 3)
    assert first_fit(trajectories, 40, max_rows=1) == (1, 1)
    assert first_fit([], 40, max_rows=2) == (0, 0)
    batch, rows = pack(trajectories[:5], 40, min_rows=3, decreasing=False)
    assert rows == [[0, 3], [1, 2], [4]] and batch.tokens.shape[0] == 3
    assert pack(trajectories[:5], 40, decreasing=True)[1] == [[0, 3], [2, 1], [4]]  # decreasing: 30, 25, 18, 12, 7
    # A record of several learner sequences is placed whole or not at all.
    split = _traj(n=12, generated=(3, 4, 9, 10), segment_starts=(6,))
    assert first_fit([split], 8) == (1, 2) and first_fit([split], 8, max_rows=1) == (0, 0)
    with pytest.raises(ValueError, match="exceeds row_length=40"):
        first_fit([_traj(n=41)], 40)
