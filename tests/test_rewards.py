"""Composite rewards, DAPO's overlong penalty, the rubric judge and its never-raising parser."""

import asyncio

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_agent import models, rewards, tokenizer as tok
from jaxrl_agent.sampling import AgentEngine, LocalSampler


def test_overlong_penalty_golden_values():
    # Lmax = 100, buffer 20: free up to 80, linear to -1 at 100, -1 beyond.
    assert rewards.overlong_penalty(50, 100, 20) == 0.0
    assert rewards.overlong_penalty(80, 100, 20) == 0.0
    assert rewards.overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert rewards.overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert rewards.overlong_penalty(150, 100, 20, factor=0.5) == -0.5
    np.testing.assert_allclose(rewards.overlong_penalty(np.array([70, 85, 120]), 100, 20), [0.0, -0.25, -1.0])
    with pytest.raises(ValueError, match="buffer=0"):
        rewards.overlong_penalty(10, 100, 0)


def test_composite_reward_reports_components_and_weights_them():
    reward = rewards.CompositeReward(weights={"correctness": 1.0, "format": 0.2, "overlong": 0.5, "turns": 0.1},
                                     max_tokens=100, overlong_buffer=20)
    out = reward(success=True, sampled_tokens=90, turns=3, tool_calls=4, tool_call_errors=1)
    assert out.components["correctness"] == 1.0 and out.components["format"] == 0.75
    assert out.components["overlong"] == pytest.approx(-0.5) and out.components["turns"] == -2.0
    assert out.total == pytest.approx(1.0 + 0.2 * 0.75 + 0.5 * -0.5 + 0.1 * -2.0)
    with pytest.raises(ValueError, match="unknown components \\['speed'\\]"):
        rewards.CompositeReward(weights={"speed": 1.0})(success=True, sampled_tokens=1)


def test_toggle_alternates_accuracy_and_budget_phases():
    assert [rewards.toggle_phase(i, 2) for i in range(6)] == ["accuracy"] * 2 + ["budget"] * 2 + ["accuracy"] * 2
    reward = rewards.CompositeReward(weights={"correctness": 1.0, "overlong": 1.0}, max_tokens=10,
                                     overlong_buffer=5, toggle_period=1)
    assert reward(success=True, sampled_tokens=50, iteration=0).total == 1.0  # accuracy phase: no length cost
    assert reward(success=True, sampled_tokens=50, iteration=1).total == 0.0


def test_length_bias():
    assert rewards.length_bias([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rewards.length_bias([1, 1, 1], [1, 2, 3]) == 0.0


def test_judge_score_parser_cases():
    assert rewards.parse_judge_score("looks right.\nSCORE: 7") == 0.7
    assert rewards.parse_judge_score("score = 3.5 ... final SCORE: 9") == 0.9
    assert rewards.parse_judge_score("I'd give it 8/10") == 0.8
    for bad in ("SCORE: 11", "SCORE: -2", "no idea", "", None, 42, "SCORE: nan"):
        assert rewards.parse_judge_score(bad) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet="SCORE:0123456789./ -+e\n"), st.binary(), st.integers(), st.none()))
def test_judge_parser_never_raises(text):
    score = rewards.parse_judge_score(text)
    assert score is None or 0.0 <= score <= 1.0


def test_rubric_judge_end_to_end_with_the_tiny_model():
    tokenizer = tok.CharTokenizer()
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, num_layers=1, hidden_size=32, intermediate_size=64,
                                num_heads=2, num_kv_heads=1, head_dim=16)
    engine = AgentEngine(config, models.init_params(config, jax.random.PRNGKey(0)), tokenizer,
                         max_concurrent_decodes=4, max_prefill_length=512, max_cache_length=600)
    with LocalSampler(engine) as sampler:
        judge = rewards.RubricJudge(sampler, tokenizer, tok.CHATML, max_tokens=24)

        async def score_all():
            return await asyncio.gather(*(judge.score("Q: 1+2=?", f"<answer>{i}</answer>") for i in range(3)))

        results = asyncio.run(score_all())
    for result in results:  # a random model's text: parsed (a score or a recorded failure), never a crash
        assert isinstance(result.text, str)
        assert result.score is None or 0.0 <= result.score <= 1.0
    assert judge.failures == sum(r.score is None for r in results)


class _LengthScoringSampler:
    """A scripted judge: 'SCORE: n' with n growing with the transcript's length (a verbosity-biased
    judge), or no score at all for transcripts containing 'X'."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids, sampling):
        from jaxrl_agent.sampling import Completion

        text = self.tokenizer.decode(prompt_ids)
        transcript = text.split("Transcript:")[1].split("Rubric:")[0]
        reply = "no idea" if "X" in transcript else f"SCORE: {min(len(transcript) // 4, 10)}"
        ids = tuple(self.tokenizer.encode(reply))
        return Completion(ids, tuple(-0.1 for _ in ids), tuple(0 for _ in ids), "stop")


def _episode(text, tokenizer, task_id):
    from jaxrl_agent.replay import Trajectory

    prompt, answer = tokenizer.encode("Q: 1+1=?"), tokenizer.encode(text)
    tokens = np.asarray(prompt + answer, np.int32)
    mask = np.asarray([0] * len(prompt) + [1] * len(answer), np.int32)
    return Trajectory(tokens=tokens, loss_mask=mask, sampler_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      policy_version=np.where(mask == 1, 0, -1).astype(np.int32), reward=0.0,
                      reward_components={"correctness": 1.0}, task_id=task_id)


def test_judge_groups_adds_the_component_counts_failures_and_flags_length_bias():
    tokenizer = tok.CharTokenizer()
    judge = rewards.RubricJudge(_LengthScoringSampler(tokenizer), tokenizer, tok.CHATML, rubric=("1. short",))
    groups = [[_episode("a" * n, tokenizer, f"t{n}") for n in (4, 12, 20)], [_episode("bX", tokenizer, "tx")]]
    judged, metrics = rewards.judge_groups(judge, groups, tokenizer.decode, length_bias_threshold=0.5)
    scores = [t.reward_components["judge"] for t in judged[0]]
    assert scores == sorted(scores) and scores[0] < scores[-1] <= 1.0
    assert judged[1][0].reward_components == {"correctness": 1.0, "judge": 0.0, "judge_failed": 1.0}
    assert metrics["judge/failures"] == 1.0 and metrics["judge/length_bias"] > 0.9
    assert metrics["judge/length_bias_warning"] == 1.0
    # The records handed in are untouched (each stage returns new ones).
    assert "judge" not in groups[0][0].reward_components
    # An unbiased judge (the same score for every length) raises no warning.
    flat = rewards.RubricJudge(_LengthScoringSampler(tokenizer), tokenizer, tok.CHATML)
    _, metrics = rewards.judge_groups(flat, [[_episode("a" * 40, tokenizer, "a"), _episode("a" * 44, tokenizer, "b")]],
                                      tokenizer.decode)
    assert "judge/length_bias_warning" not in metrics
