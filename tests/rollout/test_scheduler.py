"""Schedules: windowed FIFO admission, the staleness bound, partial rollouts resumed on new weights."""

import numpy as np
import pytest

from jaxrl_agent import envs, replay, rollout
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


def _run_iterations(runner, sampler, iterations):
    """Advances `iterations` learner iterations (new weights each), or until nothing is unfinished."""
    for _ in range(iterations):
        assert runner.wait(runner.quiescent, timeout=30)
        if not runner.unfinished():
            return
        sampler.version += 1
        runner.next_iteration()
    assert runner.wait(runner.quiescent, timeout=30)


def _suspended_state(tasks, iterations=2):
    make_env = lambda task: rollout.InProcessEnv(envs.make("calculator"))
    sampler = VersionedSampler(version=0)
    runner = scheduler.RolloutRunner(sampler, make_env, TOKENIZER, tok.CHATML, _settings(), group_size=2,
                                     token_budget=7)
    try:
        runner.submit(tasks)
        _run_iterations(runner, sampler, iterations)
        return runner.pending_state()
    finally:
        runner.close()


def test_a_restored_runner_continues_suspended_episodes_from_their_saved_tokens():
    """A checkpoint taken while episodes are suspended, restored into a new runner (a new process):
    each suspended episode goes on from its saved ids, log-probs and versions (not from its task),
    and every episode of every saved group ends exactly once."""
    import json

    env = envs.make("calculator")
    tasks = [env.sample_task(s, 1 + s % 3) for s in range(3)]
    state = json.loads(json.dumps(_suspended_state(tasks)))  # through JSON, as a checkpoint holds it
    saved = {(g["index"], int(i)): p for g in state["groups"] for i, p in g["partial"].items()}
    assert len(saved) >= 4 and all(p["suspensions"] >= 2 for p in saved.values())
    sampler = VersionedSampler(version=10)  # the restarted run's weights
    make_env = lambda task: rollout.InProcessEnv(envs.make("calculator"))
    runner = scheduler.RolloutRunner(sampler, make_env, TOKENIZER, tok.CHATML, _settings(), group_size=2,
                                     token_budget=7)
    try:
        runner.restore_pending(state)
        assert runner.resumed_partials == len(saved)
        _run_iterations(runner, sampler, 10)
        assert not runner.unfinished()
        indices = runner.finished()
        groups = runner.take(indices)
        more = runner.submit([env.sample_task(9, 1)])
    finally:
        runner.close()
    assert indices == [g["index"] for g in state["groups"]] and more == [len(tasks)]  # indices continue
    reference = [rollout.expert_trajectory(env, task, envs.expert_policy("calculator"), TOKENIZER, tok.CHATML)
                 for task in tasks]
    for index, group, expected in zip(indices, groups, reference):
        assert [t.sample_index for t in group] == [0, 1]  # each episode once
        for t in group:
            np.testing.assert_array_equal(t.tokens, expected.tokens)
            assert t.reward == 1.0 and t.finish_reason == "answer"
            p = saved.get((index, t.sample_index))
            if p is None:
                continue
            n = len(p["tokens"])
            np.testing.assert_array_equal(t.policy_version[:n], p["policy_version"])  # the saved versions ...
            np.testing.assert_array_equal(t.sampler_logprobs[:n], np.float32(p["sampler_logprobs"]))
            sampled_after = t.policy_version[n:][t.loss_mask[n:] == 1]
            assert sampled_after.size and sampled_after.min() >= 10  # ... then the new weights' tokens
            assert t.policy_version[:n].max() < 10


def test_an_environment_that_answers_differently_on_replay_ends_its_episode_recorded():
    env = envs.make("calculator")
    tasks = [env.sample_task(s, 3) for s in range(2)]
    state = _suspended_state(tasks, iterations=3)
    tampered = [(g, int(i)) for g in state["groups"] for i, p in g["partial"].items() if p["observation_digests"]]
    assert tampered, "no suspended episode past its first tool call"
    group, sample = tampered[0]
    partial = group["partial"][str(sample)]
    partial["observation_digests"] = ["0" * 16] * len(partial["observation_digests"])
    sampler = VersionedSampler(version=5)
    runner = scheduler.RolloutRunner(sampler, lambda task: rollout.InProcessEnv(envs.make("calculator")), TOKENIZER,
                                     tok.CHATML, _settings(), group_size=2, token_budget=7)
    try:
        runner.restore_pending(state)
        _run_iterations(runner, sampler, 10)
        groups = dict(zip(runner.finished(), runner.take(runner.finished())))
    finally:
        runner.close()
    t = groups[group["index"]][sample]
    assert t.finish_reason == "env_resume_mismatch" and t.reward == 0.0 and "answered differently" in t.turns[-1]["error"]
    np.testing.assert_array_equal(t.tokens, partial["tokens"])  # its saved tokens kept, on the record
    others = [u for i, g in groups.items() for u in g if (i, u.sample_index) != (group["index"], sample)]
    assert others and all(u.finish_reason == "answer" for u in others)


def test_a_full_buffer_evicts_whole_groups_oldest_first_and_stops_their_episodes():
    env = envs.make("calculator")
    tasks = [env.sample_task(s, 3) for s in range(4)]
    sampler = VersionedSampler(version=0)
    buffer = replay.ReplayBuffer(capacity_tokens=250)
    runner = scheduler.RolloutRunner(sampler, lambda task: rollout.InProcessEnv(envs.make("calculator")), TOKENIZER,
                                     tok.CHATML, _settings(), group_size=2, token_budget=7, buffer=buffer)
    try:
        indices = runner.submit(tasks)
        _run_iterations(runner, sampler, 12)
        assert runner.running_episodes() == 0  # evicted groups' episodes were stopped, not left running
        kept = runner.finished()
        groups = runner.take(kept)
    finally:
        runner.close()
    assert buffer.evicted_groups > 0 and buffer.peak_tokens <= 250
    assert kept and set(kept) < set(indices) and min(kept) > min(indices)  # the oldest went first
    assert buffer.evicted_groups + len(kept) == len(indices)
    assert all(t.finish_reason == "answer" for g in groups for t in g)


def test_a_checkpoint_that_kept_open_groups_with_the_task_source_still_resumes():
    env = envs.make("calculator")
    tasks = [env.sample_task(s, 1) for s in range(2)]
    kept = rollout.expert_trajectory(env, tasks[1], envs.expert_policy("calculator"), TOKENIZER, tok.CHATML)
    legacy = {"next_index": 5, "groups": [
        {"index": 3, "task": tasks[0].to_dict(), "size": 2, "trajectories": None},
        {"index": 4, "task": tasks[1].to_dict(), "size": 1, "trajectories": [kept.to_dict()]}]}
    runner = scheduler.RolloutRunner(VersionedSampler(version=0), lambda task: rollout.InProcessEnv(
        envs.make("calculator")), TOKENIZER, tok.CHATML, _settings(), group_size=2)
    try:
        runner.restore_pending({"rejected": {}}, legacy_pending=legacy)
        assert runner.wait(lambda: not runner.unfinished_unlocked(), timeout=30)
        restarted, finished = runner.take([3, 4])
        assert runner.submit([tasks[0]]) == [5]
    finally:
        runner.close()
    assert [t.reward for t in restarted] == [1.0, 1.0]  # the unfinished group ran again from its task
    np.testing.assert_array_equal(finished[0].tokens, kept.tokens)  # the finished one kept as saved
