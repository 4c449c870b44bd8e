"""Schedules: windowed FIFO admission, the staleness bound, partial rollouts resumed on new weights."""

import numpy as np
import pytest

from jaxrl_agent import envs, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout import scheduler
from jaxrl_agent.sampling import SamplingParams
from tests.rollout.test_rollout import TOKENIZER, ScriptedSampler, _settings


def test_windowed_fifo_selects_only_groups_within_the_window_of_the_oldest_unfinished():
    assert scheduler.windowed_fifo_selectable([0, 1, 5, 6, 9], [2, 3], window=4) == [0, 1, 5]
    assert scheduler.windowed_fifo_selectable([7, 8], [], window=1) == [7, 8]
    assert scheduler.windowed_fifo_selectable([3], [0], window=3) == []


@pytest.mark.parametrize("seed", range(20))
def test_windowed_fifo_never_trains_a_group_outside_its_window(seed):
    """Simulated runs with random finishing order: every trained group lay within the window."""
    rng = np.random.RandomState(seed)
    window, unfinished, finished, trained = 3, set(range(12)), set(), []
    while unfinished or finished:
        if unfinished and (not finished or rng.rand() < 0.6):
            done = int(rng.choice(sorted(unfinished)))
            unfinished.discard(done)
            finished.add(done)
        for i in scheduler.windowed_fifo_selectable(sorted(finished), sorted(unfinished), window):
            assert not unfinished or i < min(unfinished) + window
            finished.discard(i)
            trained.append(i)
    assert sorted(trained) == list(range(12))


def _trajectory(versions, mask):
    n = len(versions)
    return Trajectory(tokens=np.ones(n, np.int32), loss_mask=np.asarray(mask, np.int32),
                      sampler_logprobs=np.zeros(n, np.float32), policy_version=np.asarray(versions, np.int32), reward=0.0)


def test_staleness_bound_drops_or_masks_old_tokens():
    t = _trajectory([-1, 3, 5, 6, -1, 6], [0, 1, 1, 1, 0, 1])
    assert scheduler.apply_staleness(t, 7, 4, "drop") is t  # lag 4 allowed
    assert scheduler.apply_staleness(t, 8, 2, "drop") is None
    masked = scheduler.apply_staleness(t, 8, 2, "mask")
    np.testing.assert_array_equal(masked.loss_mask, [0, 0, 0, 1, 0, 1])
    lag = 8 - masked.policy_version[masked.loss_mask == 1]
    assert lag.max() <= 2  # the bound holds on every trained token
    assert scheduler.apply_staleness(t, 20, 2, "mask") is None  # nothing left to train


def test_bad_schedules_are_rejected():
    with pytest.raises(ValueError, match="rollout.schedule='fast'"):
        scheduler.Schedule(mode="fast")
    with pytest.raises(ValueError, match="stale_policy='keep'"):
        scheduler.Schedule(stale_policy="keep")
    with pytest.raises(ValueError, match="window=0"):
        scheduler.Schedule(mode="windowed_fifo", window=0)


class VersionedSampler(ScriptedSampler):
    """The scripted expert, honouring max_tokens exactly and stamping the current version."""

    async def generate(self, prompt_ids, sampling):
        text = TOKENIZER.decode(prompt_ids)
        # Continue a cut turn: drop what was already produced after the last assistant header.
        head, _, done = text.rpartition("<|im_start|>assistant\n")
        full = await super().generate(TOKENIZER.encode(head + "<|im_start|>assistant\n"),
                                      SamplingParams(temperature=1.0, max_tokens=1000))
        already = len(TOKENIZER.encode(done)) if done else 0
        ids = list(full.token_ids)[already:][: sampling.max_tokens]
        reason = "stop" if ids and ids[-1] == TOKENIZER.eos_id else "length"
        return type(full)(tuple(ids), tuple(-0.5 for _ in ids), tuple(self.version for _ in ids), reason)


def test_partial_rollouts_resume_on_new_weights_and_carry_mixed_versions():
    env = envs.make("calculator")
    tasks = [env.sample_task(s, 2) for s in range(3)]
    sampler = VersionedSampler(version=0)
    make_env = lambda task: rollout.InProcessEnv(envs.make("calculator"))
    runner = scheduler.RolloutRunner(sampler, make_env, TOKENIZER, tok.CHATML, _settings(), group_size=2,
                                     token_budget=7)
    try:
        indices = runner.submit(tasks)
        iterations = 0
        while runner.unfinished():
            assert runner.wait(runner.quiescent, timeout=30)
            if not runner.unfinished():
                break
            iterations += 1
            sampler.version += 1  # "new weights" between iterations
            runner.next_iteration()
        groups = runner.take(indices)
    finally:
        runner.close()
    assert iterations >= 3  # episodes of ~25 sampled tokens with 7 per iteration
    reference = [rollout.expert_trajectory(env, task, envs.expert_policy("calculator"), TOKENIZER, tok.CHATML)
                 for task in tasks]
    for group, expected in zip(groups, reference):
        for t in group:
            # The resumed episodes are exactly the uninterrupted ones ...
            np.testing.assert_array_equal(t.tokens, expected.tokens)
            np.testing.assert_array_equal(t.loss_mask, expected.loss_mask)
            assert t.reward == 1.0 and t.finish_reason == "answer"
            # ... but their tokens were sampled by several policy versions, at most 7 per version.
            sampled_versions = t.policy_version[t.loss_mask == 1]
            assert len(set(sampled_versions.tolist())) >= 3
            assert np.all(np.diff(sampled_versions) >= 0)
            assert np.bincount(sampled_versions).max() <= 7
            assert any(turn["sampler_calls"] > 1 for turn in t.turns)  # a turn was cut and resumed


def test_groups_of_different_sizes_and_their_checkpointed_state():
    env = envs.make("calculator")
    tasks = [env.sample_task(s, 1) for s in range(3)]
    make_env = lambda task: rollout.InProcessEnv(envs.make("calculator"))
    runner = scheduler.RolloutRunner(VersionedSampler(version=0), make_env, TOKENIZER, tok.CHATML, _settings(),
                                     group_size=2)
    try:
        with pytest.raises(ValueError, match="group sizes"):
            runner.submit(tasks, [1, 2])
        indices = runner.submit(tasks, [1, 3, 5])
        state = runner.pending_state()
        assert [g["size"] for g in state["groups"]] == [1, 3, 5]
        assert runner.wait(lambda: not runner.unfinished_unlocked(), timeout=30)
        groups = runner.take(indices)
    finally:
        runner.close()
    assert [len(g) for g in groups] == [1, 3, 5]
    assert all(t.reward == 1.0 for g in groups for t in g)
    # A restored checkpoint re-runs unfinished groups at their own sizes.
    runner = scheduler.RolloutRunner(VersionedSampler(version=0), make_env, TOKENIZER, tok.CHATML, _settings(),
                                     group_size=2)
    try:
        runner.restore_pending(state)
        assert runner.wait(lambda: not runner.unfinished_unlocked(), timeout=30)
        assert [len(g) for g in runner.take(indices)] == [1, 3, 5]
    finally:
        runner.close()
