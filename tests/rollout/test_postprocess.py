"""Post-processing: pure functions from finished groups to new, frozen trajectories."""

import dataclasses

import numpy as np
import pytest

from jaxrl_agent import build, losses, rollout
from jaxrl_agent.replay import Trajectory
from jaxrl_agent.rollout import postprocess as pp


def _traj(reward, *, version=3, group="g", i=0, turns=1, components=None):
    mask = np.array([0, 1, 1, 0, 1], np.int32)
    return Trajectory(tokens=np.arange(5, dtype=np.int32), loss_mask=mask,
                      sampler_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      policy_version=np.where(mask == 1, version, -1).astype(np.int32), reward=reward,
                      reward_components=components or {"correctness": float(reward > 0), "success": float(reward > 0)},
                      group_id=group, sample_index=i, turns=[{"sample_seconds": 0.5}] * turns,
                      finish_reason="answer")


def test_records_are_frozen_and_inputs_never_change():
    groups = [[_traj(1.0, i=0), _traj(0.0, i=1)], [_traj(1.0, group="h"), _traj(1.0, group="h", i=1)]]
    before = [[dataclasses.asdict(t) for t in g] for g in groups]
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups[0][0].advantage = 1.0
    out = pp.postprocess(groups, pp.PostprocessSettings(shaping=pp.RewardShaping(overlong_factor=1.0, overlong_buffer=2,
                                                                                  max_context=4)),
                         iteration=1, current_version=3)
    after = [[dataclasses.asdict(t) for t in g] for g in groups]
    assert all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
               for ga, gb in zip(before, after) for a, b in zip(ga, gb) for k in a)
    # 3 generated tokens against max_context 4 with a buffer of 2: penalty -(3 - 2) / 2.
    assert all(t.reward_components["overlong"] == -0.5 for g in out.shaped_groups for t in g)
    assert [t.advantage for t in out.groups[0]] == [0.5, -0.5]
    # The all-equal group is kept for metrics but not trained on.
    assert len(out.trainable) == 2 and out.metrics["nonzero_advantage_group_share"] == 0.5


def test_distill_only_environments_keep_every_episode_at_advantage_zero_outside_the_signal():
    """rl.distill_envs: an earlier stage's environment's groups are trained (by distillation alone):
    advantage 0, never filtered as all-equal, not counted in the signal statistics."""
    a = [dataclasses.replace(_traj(1.0, group="a", i=i), env="calculator") for i in range(2)]  # all correct
    b = [dataclasses.replace(_traj(r, group="b", i=i), env="chain") for i, r in enumerate((1.0, 0.0))]
    c = [dataclasses.replace(_traj(r, group="c", i=i), env="calculator") for i, r in enumerate((1.0, 0.0))]
    settings = pp.PostprocessSettings(distill_only_envs=frozenset({"calculator"}))
    out = pp.postprocess([a, b, c], settings, iteration=1, current_version=3)
    assert sorted(t.group_id for t in out.trainable) == ["a", "a", "b", "b", "c", "c"]
    assert {t.group_id: t.advantage for t in out.trainable if t.env == "calculator"} == {"a": 0.0, "c": 0.0}
    assert [t.advantage for t in out.trainable if t.env == "chain"] == [0.5, -0.5]
    assert out.metrics["groups"] == 1 and out.metrics["nonzero_advantage_group_share"] == 1.0
    assert out.metrics["distill_only_groups"] == 2 and len(out.shaped_groups) == 3
    # Distillation off: sampled, recorded, never trained.
    off = pp.postprocess([a, b, c], dataclasses.replace(settings, distill=False), iteration=1, current_version=3)
    assert sorted(t.group_id for t in off.trainable) == ["b", "b"] and off.metrics == out.metrics
    # Without it, calculator's mixed group has an advantage and its all-correct group is dropped.
    plain = pp.postprocess([a, b, c], pp.PostprocessSettings(), iteration=1, current_version=3)
    assert sorted(t.group_id for t in plain.trainable) == ["b", "b", "c", "c"] and "distill_only_groups" not in plain.metrics


def test_staleness_under_the_async_schedule():
    groups = [[_traj(1.0, version=1), _traj(0.0, version=3, i=1)], [_traj(1.0, version=0, group="h")]]
    settings = pp.PostprocessSettings(max_staleness=1, drop_zero_advantage_groups=False)
    out = pp.postprocess(groups, settings, iteration=1, current_version=3)
    # Version 1 and 0 tokens are 2 and 3 versions old: dropped; the second group disappears.
    assert out.metrics["stale_dropped"] == 2 and [len(g) for g in out.groups] == [1]
    assert out.groups[0][0].advantage == 0.0  # a group of one has nothing to compare with


@pytest.mark.parametrize("name,reference", [
    ("grpo", lambda r: losses.group_advantages(r, normalize_std=True)),
    ("dr_grpo", lambda r: losses.group_advantages(r, normalize_std=False)),
    ("rloo", losses.rloo_advantages),
    ("ploo", lambda r: losses.ploo_advantages(r, tau=0.05)),
])
def test_advantage_estimators_from_the_config(tmp_path, name, reference):
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    config.rl.advantage = name
    config.rl.negative_advantage_weight = 1.0  # the estimator's own advantages
    rewards = np.array([[1.0, 0.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    groups = [[_traj(float(r), i=i) for i, r in enumerate(row)] for row in rewards]
    out, _ = pp.assign_advantages(groups, build.build_advantage_fn(config))
    np.testing.assert_allclose([[t.advantage for t in g] for g in out], reference(rewards), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dr_grpo", "rloo"])
def test_the_negative_advantage_weight_from_the_config(tmp_path, name):
    from tests.test_trainer import tiny_config

    config = tiny_config(tmp_path)
    config.rl.advantage = name
    config.rl.negative_advantage_weight = 0.25
    build.validate_config(config)
    rewards = np.array([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    groups = [[_traj(float(r), i=i) for i, r in enumerate(row)] for row in rewards]
    out, stats = pp.assign_advantages(groups, build.build_advantage_fn(config))
    plain = np.asarray({"dr_grpo": lambda r: losses.group_advantages(r, normalize_std=False),
                        "rloo": losses.rloo_advantages}[name](rewards))
    np.testing.assert_allclose([[t.advantage for t in g] for g in out], np.where(plain < 0, 0.25 * plain, plain),
                               rtol=1e-5, atol=1e-6)
    assert stats["nonzero_advantage_group_share"] == pytest.approx(2 / 3)
    assert stats["advantage_mean"] == pytest.approx(float(np.where(plain < 0, 0.25 * plain, plain).mean()), abs=1e-6)
    assert stats["advantage_mean"] > 0 and abs(float(plain.mean())) < 1e-6  # centred before the weighting
    for bad in (-0.1, float("inf")):
        config.rl.negative_advantage_weight = bad
        with pytest.raises(build.ConfigError, match="rl.negative_advantage_weight"):
            build.validate_config(config)


def test_reward_weights_and_reward_fn():
    t = _traj(1.0, turns=3, components={"correctness": 1.0, "format": -0.5, "efficiency": -0.75, "success": 1.0})
    shaping = pp.RewardShaping(weights={"correctness": 1.0, "format": 0.1, "turns": 0.05, "bonus": 2.0},
                               reward_fn=lambda traj: {"bonus": 0.25})
    shaped = pp.shape_reward(t, shaping, iteration=0)
    # The environment's own format component wins over the library's of the same name.
    assert shaped.reward == pytest.approx(1.0 + 0.1 * -0.5 + 0.05 * -2.0 + 2.0 * 0.25)
    assert shaped.reward_components["turns"] == -2.0 and shaped.reward_components["wall_time"] == -1.5
    # A number replaces the reward when there are no weights; a raising function is counted, not fatal.
    assert pp.shape_reward(t, pp.RewardShaping(reward_fn=lambda traj: 0.3), 0).reward == 0.3

    def broken(traj):
        raise KeyError("oops")

    failed = pp.shape_reward(t, pp.RewardShaping(reward_fn=broken), 0)
    assert failed.reward == 0.0 and failed.reward_components["reward_fn_error"] == 1.0
    with pytest.raises(ValueError, match="unknown components"):
        pp.shape_reward(t, pp.RewardShaping(weights={"speed": 1.0}), 0)


def test_the_procedural_task_stream_resumes_exactly():
    from jaxrl_agent import envs

    environments = {n: envs.make(n) for n in ("calculator", "kb_search")}
    make = lambda: rollout.source.ProceduralTasks(environments, {"calculator": 0.7, "kb_search": 0.3},
                                                  {"calculator": (1, 2), "kb_search": (1,)}, seed=5)
    stream = make()
    first = [t.id for t in stream.take(10)]
    state = stream.state_dict()
    rest = [t.id for t in stream.take(10)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [t.id for t in resumed.take(10)] == rest and resumed.position == 20
    assert {t.split("/")[0] for t in first + rest} == {"calculator", "kb_search"}
    assert [t.id for t in make().take(10)] == first
