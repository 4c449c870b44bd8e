"""The composite `chain_sum` environment: inline its transcript outgrows the context where a
delegating episode's does not; its sub-tasks are `chain` tasks on the parent's own log; both
scripted styles solve it and the reward is correctness alone."""

import pytest

from jaxrl_agent import envs, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.envs import chain_sum
from jaxrl_agent.rollout import delegation
from tests.rollout.test_rollout import TOKENIZER

MAX_CONTEXT = 240


def _demo(task, delegating: bool):
    expert = chain_sum.expert.delegate if delegating else chain_sum.expert
    return rollout.expert_trajectory(envs.make("chain_sum"), task, expert, TOKENIZER, tok.CHATML,
                                     delegate=delegation.scripted_subagent() if delegating else None)


def test_inline_transcripts_outgrow_the_context_where_delegating_ones_fit():
    env = envs.make("chain_sum")
    for d in env.difficulties:
        for seed in range(5):
            task = env.sample_task(seed, d)
            inline, delegating = _demo(task, False), _demo(task, True)
            assert inline.reward == delegating.reward == 1.0
            assert delegating.length < inline.length
            assert delegating.length <= MAX_CONTEXT, (d, seed, delegating.length)
            if d >= 2:  # two chains of two reads or more: inline does not fit
                assert inline.length > MAX_CONTEXT, (d, seed, inline.length)
    # The delegating demonstration: one reply delegating every chain, then calc, then the answer.
    task = env.sample_task(0, 5)
    demo = _demo(task, True)
    assert [len(t.get("delegations", ())) for t in demo.turns] == [3, 0, 0]
    assert [d["task"] for d in demo.turns[0]["delegations"]] == task.verifier["starts"]


def test_a_sub_task_is_the_chain_that_holds_the_key_on_the_parents_log():
    env = envs.make("chain_sum")
    parent = env.sample_task(7, 5)
    env.reset(parent)
    for j, start in enumerate(parent.verifier["starts"]):
        sub = env.subtask(parent, start)
        assert sub.env == "chain" and sub.prompt == f"Q: Follow the chain from {start}; answer its value."
        assert sub.verifier["answer"] == str(parent.verifier["values"][j])
        step, _, _ = envs.run_episode(envs.make("chain"), sub, envs.expert_policy("chain"))
        assert step.info["success"]
        # The chain task's log is the parent's: every record the sub-agent can read is the same.
        chain_env = envs.make("chain")
        chain_env.reset(sub)
        assert all(env._log[k] == v for k, v in chain_env._log.items())
    # A key in the middle of a chain is a sub-task too, with the same value.
    second = chain_sum.chain.build_log(parent.verifier["log_seeds"][1], parent.verifier["hops"])[0][1]
    assert env.subtask(parent, f"please follow {second}").verifier["answer"] == str(parent.verifier["values"][1])
    logs = [chain_sum.chain.build_log(s, parent.verifier["hops"])[1] for s in parent.verifier["log_seeds"]]
    absent = next(a + b for a in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" for b in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                  if not any(a + b in log for log in logs))
    for bad in ("", f"{absent} is not there", " and ".join(parent.verifier["starts"][:2])):
        with pytest.raises(envs.ToolError, match="names one key"):
            env.subtask(parent, bad)
    with pytest.raises(envs.ToolError, match="makes no sub-tasks"):
        envs.make("chain").subtask(parent, parent.verifier["starts"][0])


def test_the_chains_of_a_task_never_share_a_key():
    env = envs.make("chain_sum")
    for seed in range(30):
        task = env.sample_task(seed, 6)
        keys = [set(chain_sum.chain.build_log(s, task.verifier["hops"])[1]) for s in task.verifier["log_seeds"]]
        assert sum(len(k) for k in keys) == len(set().union(*keys))


def test_calculator_sub_tasks_are_expressions():
    calc = envs.make("calculator")
    parent = calc.sample_task(0, 1)
    sub = calc.subtask(parent, "Q: 17*23=?")
    assert sub.prompt == "Q: 17*23=?" and sub.verifier["answer"] == 391
    with pytest.raises(envs.ToolError):
        calc.subtask(parent, "import os")
