"""Allocation rules against hand-computed cases."""

import numpy as np
import pytest

from jaxrl_agent.rollout import allocation as al


def test_p_nondegenerate_and_knapsack_value():
    assert al.p_nondegenerate(0.5, 4) == pytest.approx(1 - 2 / 16)
    assert al.p_nondegenerate(0.9, 2) == pytest.approx(1 - 0.81 - 0.01)
    assert al.p_nondegenerate(0.3, 1) == 0.0
    assert al.knapsack_value(0.9, 3) == pytest.approx((1 - 0.729 - 0.001) * 0.09)
    assert al.knapsack_value(1.0, 8) == 0.0


def test_uniform_gives_equal_groups_until_the_budget_runs_out():
    np.testing.assert_array_equal(al.allocate("uniform", [0.5] * 5, 12, group_size=4), [4, 4, 4, 0, 0])


def test_variance_allocation_is_proportional_to_bernoulli_std():
    # weights sqrt(p(1-p)) = .5, .3, 0, .3 (sum 1.1): shares 16*.5/1.1 = 7.3 -> 7, 4.4 -> 4, -, 4
    np.testing.assert_array_equal(al.allocate("variance", [0.5, 0.1, 1.0, 0.9], 16), [7, 4, 0, 4])
    np.testing.assert_array_equal(al.allocate("variance", [0.0, 1.0], 16), [0, 0])


def test_knapsack_allocation_hand_computed():
    # Values v(n) = (1 - p^n - (1-p)^n) p(1-p). For p = .5: v(2..6) = .125, .1875, .21875, .234375,
    # .2421875; for p = .9: v(2) = .0162. Greedy per unit cost: the first group (2 rollouts) to the
    # p = .5 task (.0625 per rollout > .0081), then each extra rollout there (.0625, .03125, .0156,
    # .0078) beats opening the p = .9 task (.0081) or the never-solved one (0): [6, 0, 0].
    np.testing.assert_array_equal(al.allocate("knapsack", [0.5, 0.9, 0.0], 6), [6, 0, 0])
    # With more budget the second task opens once the first's marginal value falls below its own.
    counts = al.allocate("knapsack", [0.5, 0.9, 0.0], 12)
    assert counts[1] >= 2 and counts[2] == 0 and counts.sum() == 12
    # Costs: a task 4x as expensive per rollout is opened only when it is worth it.
    np.testing.assert_array_equal(al.allocate("knapsack", [0.5, 0.5], 8, costs=[1, 4]), [8, 0])
    assert al.allocate("knapsack", [0.5, 0.5], 16, max_group=8).tolist() == [8, 8]


def test_allocation_spends_more_where_groups_are_mixed():
    p = np.array([0.02, 0.5, 0.98, 0.4, 0.0, 1.0])
    for strategy in ("variance", "knapsack"):
        counts = al.allocate(strategy, p, 24)
        expected_signal = np.sum(al.p_nondegenerate(p, counts) * (counts > 0))
        uniform = al.allocate("uniform", p, 24, group_size=4)
        assert expected_signal > np.sum(al.p_nondegenerate(p, uniform)), strategy
        assert counts.sum() <= 24 and counts[4] == counts[5] == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy 'best'"):
        al.allocate("best", [0.5], 4)
    with pytest.raises(ValueError, match="decay=0"):
        al.TaskPosterior(decay=0.0)


def test_until_mixed_and_dynamic_sampling():
    assert not al.until_mixed_done([1, 1, 1], cap=8)
    assert al.until_mixed_done([1, 0], cap=8)
    assert al.until_mixed_done([0] * 8, cap=8)
    assert al.dynamic_sampling_prompts(64, 0.3) == 214  # ceil(64 / .3)
    assert al.dynamic_sampling_prompts(64, 0.1) == 256  # over-sampling capped at 4x


def test_posterior_decay_and_retirement():
    post = al.TaskPosterior(decay=0.5)
    post.update("a", 3, 1)  # alpha = .5 * 1 + 3, beta = .5 * 1 + 1
    assert post.mean("a") == pytest.approx(3.5 / 5.0)
    assert post.evidence("a") == pytest.approx(3.0)
    assert post.mean("unseen") == 0.5
    saturated = al.TaskPosterior()
    saturated.update("easy", 40, 0)
    assert saturated.retired("easy") and not post.retired("a")
    restored = al.TaskPosterior.from_state_dict(saturated.state_dict())
    assert restored.mean("easy") == saturated.mean("easy")


def _pool(n):
    from jaxrl_agent import envs

    env = envs.make("calculator")
    return [env.sample_task(i, 1) for i in range(n)]


def test_allocator_uniform_draws_whole_groups_from_the_pool():
    allocator = al.TaskAllocator(_pool(10), "uniform", 4, seed=0)
    proposals = allocator.propose(3)
    assert [n for _, n in proposals] == [4, 4, 4]
    assert len({t.id for t, _ in proposals}) == 3


def test_allocator_variance_prefers_tasks_with_mixed_outcomes():
    pool = _pool(8)
    allocator = al.TaskAllocator(pool, "variance", 4, candidates=8.0, seed=0, decay=1.0)
    # Tasks 0-5 observed solved always / never (posterior mean 9/10 or 1/10); 6 and 7 half the time.
    for i, task in enumerate(pool):
        rewards = {0: [1] * 8, 1: [1] * 8, 2: [1] * 8, 3: [0] * 8, 4: [0] * 8, 5: [0] * 8}.get(i, [1, 0] * 4)
        allocator.observe(task.id, rewards)
    # Budget of 2 groups x 4 = 8 rollouts; all 8 tasks are candidates. Weights sqrt(p(1-p)):
    # 0.3 for the saturated / unsolved ones, 0.5 for the mixed ones; each share = round(8 w / 2.8)
    # is at most 1, so every chosen task gets min_group = 4 and the two mixed tasks take the budget.
    proposals = allocator.propose(2)
    assert sorted(t.id for t, _ in proposals) == sorted(t.id for t in pool[6:])
    assert [n for _, n in proposals] == [4, 4]


def test_allocator_retires_saturated_tasks_and_revisits_them_rarely():
    pool = _pool(4)
    allocator = al.TaskAllocator(pool, "uniform", 2, seed=0, decay=1.0, revisit_prob=0.0)
    allocator.observe(pool[0].id, [1] * 40)  # mean 41/42 >= 0.95 with 40 observations: retired
    assert allocator.retired_count() == 1
    for _ in range(20):
        assert pool[0].id not in {t.id for t, _ in allocator.propose(3)}
    # All retired: the whole pool is used again rather than nothing.
    for task in pool[1:]:
        allocator.observe(task.id, [1] * 40)
    assert len(allocator.propose(2)) == 2


def test_allocator_state_round_trips():
    pool = _pool(6)
    a = al.TaskAllocator(pool, "knapsack", 2, seed=3)
    a.observe(pool[1].id, [1, 0, 0])
    b = al.TaskAllocator(pool, "knapsack", 2, seed=99)
    b.load_state_dict(a.state_dict())
    assert [(t.id, n) for t, n in a.propose(2)] == [(t.id, n) for t, n in b.propose(2)]
    with pytest.raises(ValueError, match="strategy 'greedy'"):
        al.TaskAllocator(pool, "greedy", 2)
    with pytest.raises(ValueError, match="empty"):
        al.TaskAllocator([], "uniform", 2)


def test_allocator_until_mixed_first_round_and_draws_excluding_seen_tasks():
    pool = _pool(6)
    allocator = al.TaskAllocator(pool, "until_mixed", 4, min_group=2, seed=1)
    first = allocator.propose(3)
    assert [n for _, n in first] == [2, 2, 2]
    fresh = allocator.draw(5, exclude=[t.id for t, _ in first])
    assert len(fresh) == 3 and not {t.id for t in fresh} & {t.id for t, _ in first}
