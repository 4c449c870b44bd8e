"""Trajectory validation, the replay buffer, and packing."""

import dataclasses

import numpy as np
import pytest

from jaxrl_agent.replay import ReplayBuffer, Trajectory, pack, validate


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
    buffer = ReplayBuffer(vocab_size=50, max_length=64)
    assert buffer.insert([t, _traj(seed=1)]) == 1
    assert buffer.rejected == {reason: 1} and len(buffer) == 1


def test_too_long():
    assert validate(_traj(n=100), vocab_size=50, max_length=64) == "too_long"


def test_versions_from_the_future_and_garbage_records():
    buffer = ReplayBuffer(vocab_size=50, max_length=64)
    assert buffer.insert([_traj()], current_version=2) == 0
    assert buffer.rejected == {"version_from_future": 1}
    assert buffer.insert([object()]) == 0  # not even a Trajectory: counted, not raised
    assert sum(buffer.rejected.values()) == 2


def test_buffer_is_fifo_bounded_and_checkpointable():
    buffer = ReplayBuffer(vocab_size=50, max_length=64, capacity=3)
    buffer.insert([_traj(seed=i) for i in range(5)])
    assert len(buffer) == 3 and buffer.evicted == 2
    state = buffer.state_dict()
    restored = ReplayBuffer(vocab_size=50, max_length=64, capacity=3)
    restored.load_state_dict(state)
    a, b = buffer.take(), restored.take()
    assert [t.task_id for t in a] == [t.task_id for t in b] == ["t2", "t3", "t4"]
    np.testing.assert_array_equal(a[0].sampler_logprobs, b[0].sampler_logprobs)
    buffer.insert([_traj(seed=9)])
    assert [t.task_id for t in buffer.as_grain_dataset()] == ["t9"]


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
