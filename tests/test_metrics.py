"""Exploration metrics: pass@k against the binomial formula, clusters, group signal, entropy."""

import math

import numpy as np
import pytest

from jaxrl_agent import metrics
from jaxrl_agent.envs import tool_protocol as tp


def test_pass_at_k_golden_values():
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert metrics.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert metrics.pass_at_k(4, 0, 4) == 0.0
    assert metrics.pass_at_k(4, 1, 4) == 1.0
    assert metrics.pass_at_k(100, 1, 10) == pytest.approx(0.1)


def test_pass_at_k_equals_binomial_formula_on_a_grid():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert metrics.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k,match", [(4, 5, 1, "exceeds"), (4, 2, 0, "k=0"), (4, 2, 5, "k=5"),
                                         (-1, 0, 1, "n=-1"), (4, 1.5, 1, "c=1.5")])
def test_pass_at_k_rejects_bad_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        metrics.pass_at_k(n, c, k)


def test_mean_pass_at_k():
    tasks = [[True, False, False, False], [False] * 4, [True] * 4]
    assert metrics.mean_pass_at_k(tasks, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert metrics.mean_pass_at_k(tasks, 4) == pytest.approx(2 / 3)


def test_solution_clusters_ignore_whitespace_and_answers():
    call = lambda expr: tp.format_tool_call(tp.ToolCall("calc", {"expr": expr}))
    a = metrics.solution_signature([call("1+2"), "<answer>3</answer>"])
    b = metrics.solution_signature([call("1 + 2"), "<answer>4</answer>"])
    c = metrics.solution_signature([call("2+1"), "<answer>3</answer>"])
    broken = metrics.solution_signature(['<tool_call>{"name": oops</tool_call>'])
    assert a == b != c
    assert broken == "!error"
    assert metrics.distinct_solutions({"t1": [a, b, c], "t2": [a, a]}) == pytest.approx((2 + 1) / 2)


def test_group_signal_counts_mixed_groups():
    assert metrics.group_signal([[1, 0, 0], [1, 1, 1], [0, 0, 0], [0.5, 0.5, 1]]) == pytest.approx(0.5)
    assert metrics.group_signal([]) == 0.0


def test_entropy_by_env_is_the_mean_negative_logprob_of_sampled_tokens():
    class T:
        def __init__(self, env, logprobs, mask):
            self.env, self.sampler_logprobs, self.loss_mask = env, np.asarray(logprobs), np.asarray(mask)

    out = metrics.entropy_by_env([T("a", [0.0, -1.0, -2.0], [0, 1, 1]), T("a", [-3.0, -9.0], [1, 0]),
                                  T("b", [-0.5], [1])])
    assert out == {"a": pytest.approx(2.0), "b": pytest.approx(0.5)}


def test_per_process_records_combine_into_the_jobs():
    """Several processes' records of one iteration: counts add, the slowest seconds and largest
    maxima stand, minima take the smallest, means average, count dicts add, lists concatenate,
    and the `keep` keys (already global, e.g. the learner's) are process 0's."""
    from jaxrl_agent.metrics import combine_process_records

    a = {"rollouts": 4, "success": 0.5, "sample_seconds": 2.0, "policy_lag_max": 1, "invariants/exploration/entropy_min": 0.3,
         "finish_reasons": {"answer": 3, "max_turns": 1}, "task_ids": ["a"], "loss": 0.7, "rollouts/calc": 4,
         "env_service/env_crash": 1, "schedule": "sync"}
    b = {"rollouts": 2, "success": 1.0, "sample_seconds": 3.0, "policy_lag_max": 2, "invariants/exploration/entropy_min": 0.1,
         "finish_reasons": {"answer": 2}, "task_ids": ["b", "c"], "loss": 0.7, "rollouts/calc": 2,
         "env_service/env_crash": 0, "schedule": "sync"}
    job = combine_process_records([a, b], keep=("loss",))
    assert job == {"rollouts": 6, "success": 0.75, "sample_seconds": 3.0, "policy_lag_max": 2,
                   "invariants/exploration/entropy_min": 0.1, "finish_reasons": {"answer": 5, "max_turns": 1},
                   "task_ids": ["a", "b", "c"], "loss": 0.7, "rollouts/calc": 6, "env_service/env_crash": 1,
                   "schedule": "sync"}
    assert combine_process_records([a]) == a


def test_context_metrics_count_edits_sequences_and_success_by_edits():
    from jaxrl_agent.metrics.records import context_metrics
    from jaxrl_agent.replay import Trajectory

    def episode(n, starts, edits, won):
        zeros = np.zeros(n, np.int32)
        return Trajectory(tokens=zeros, loss_mask=zeros, sampler_logprobs=np.zeros(n, np.float32),
                          policy_version=zeros, reward=float(won), reward_components={"success": float(won)},
                          segment_starts=starts, turns=[{"context_edit": "keep_recent"}] * edits + [{}])

    episodes = [episode(100, (), 0, True), episode(300, (120, 200), 2, True), episode(250, (150,), 1, False),
                episode(90, (), 0, False)]
    m = context_metrics(episodes)
    assert m["context/edits_per_episode"] == 0.75
    assert m["context/longest_sequence_max"] == 150  # 250 - 150 = 100 < 150; 300: 120, 80, 100
    assert m["context/longest_sequence_mean"] == (100 + 120 + 150 + 90) / 4
    assert (m["context/success/edits_0"], m["context/success/edits_1"], m["context/success/edits_2"]) == (0.5, 0.0, 1.0)
    assert "context/success/edits_0" not in context_metrics([episodes[0], episodes[3]])  # no edit, no split
    assert "context/summary_token_share" not in m
    mask = np.zeros(100, np.int32)
    mask[[10, 11, 12, 13, 40, 41, 42, 43, 44, 45]] = 1
    summarized = Trajectory(tokens=np.zeros(100, np.int32), loss_mask=mask, sampler_logprobs=np.zeros(100, np.float32),
                            policy_version=np.zeros(100, np.int32), reward=1.0, segment_starts=(46,),
                            turns=[{}, {"summary": True, "token_span": [40, 46], "context_edit": "summarize"}, {}])
    assert context_metrics([summarized])["context/summary_token_share"] == 0.6  # 6 of 10 generated tokens


def test_time_to_quality_is_the_first_rl_evaluation_that_many_points_over_the_cold_start():
    records = [{"stage": "start", "time": 100.0},
               {"stage": "initial_eval", "time": 110.0, "eval/success": 0.0},
               {"stage": "sft_eval", "time": 150.0, "eval/success": 0.40},
               {"stage": "rl_eval", "time": 200.0, "eval/success": 0.50},
               {"stage": "rl_eval", "time": 260.0, "eval/success": 0.55},  # +15.0: reached here
               {"stage": "rl_eval", "time": 300.0, "eval/success": 0.70}]
    assert metrics.seconds_to_gain(records, 15.0) == 160.0
    assert metrics.seconds_to_gain(records, 30.0) == 200.0
    assert metrics.seconds_to_gain(records, 31.0) is None
    assert metrics.summarize(records)["seconds_to_15_points"] == 160.0
    without_sft = [r for r in records if r["stage"] != "sft_eval"]  # the initial evaluation is the start
    assert metrics.seconds_to_gain(without_sft, 50.0) == 100.0
    assert "seconds_to_15_points" not in metrics.summarize(records[:4])
    assert metrics.seconds_to_gain([], 15.0) is None
