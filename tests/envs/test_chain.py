"""The long-horizon `chain` environment: the difficulty sets how far a transcript outgrows the
context, and context management is what lets an episode go on past it."""

import pytest

from jaxrl_agent import envs, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.rollout import context
from tests.rollout.test_rollout import TOKENIZER

MAX_CONTEXT = 160  # configs/chain_tiny.py


def _demo(task, strategy):
    env = envs.make("chain")
    settings = context.ContextSettings(strategy, keep_turns=1, trigger=0.6)
    return rollout.expert_trajectory(env, task, envs.expert_policy("chain"), TOKENIZER, tok.CHATML, context=settings,
                                     max_context=MAX_CONTEXT)


def test_the_transcript_grows_with_the_difficulty_past_the_context():
    env = envs.make("chain")
    lengths = [_demo(env.sample_task(0, d), "none").length for d in (1, 2, 3, 4, 6, 8)]
    assert lengths == sorted(lengths) and lengths[0] < MAX_CONTEXT < lengths[2] and lengths[-1] > 2 * MAX_CONTEXT
    # Each read is one record: the chain is the answer's only path (the prompt names only the start).
    task = env.sample_task(3, 4)
    env.reset(task)
    assert task.verifier["answer"] not in task.prompt
    step = env.step(envs.format_tool_call(envs.ToolCall("read", {"k": "??"})))
    assert "no record" in step.observation.text and not step.done


@pytest.mark.parametrize("strategy", ["keep_recent", "summarize"])
def test_managed_demonstrations_fit_the_context_at_every_level(strategy):
    env = envs.make("chain")
    for d in env.difficulties:
        t = _demo(env.sample_task(1, d), strategy)
        assert t.reward == 1.0 and t.longest_segment <= MAX_CONTEXT, (d, t.longest_segment)
        if d >= 3:
            assert t.segment_starts
    # The expert's summary is the key it reads next (or the value at the end): what it needs to go on.
    t = _demo(env.sample_task(1, 6), "summarize")
    a, b = t.summary_spans[0]
    assert TOKENIZER.decode(t.tokens[a:b].tolist()).startswith("next ")


def test_a_bad_difficulty_is_refused():
    with pytest.raises(ValueError, match="chain difficulty 0"):
        envs.make("chain").sample_task(0, 0)
    with pytest.raises(ValueError, match="needs 13 turns; max_turns=12"):
        envs.make("chain").sample_task(0, 12)
