"""Sub-agents (`rollout.delegation`): an orchestrator's `delegate` calls run frozen sub-agent
episodes, concurrently, within depth, count and token limits; only the orchestrator's own tokens
are in its trajectory."""

import asyncio
import dataclasses
import re
import time

import numpy as np
import pytest

from jaxrl_agent import envs, replay, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.envs import tool_protocol as tp
from jaxrl_agent.envs.calculator import safe_eval
from jaxrl_agent.rollout import delegation
from jaxrl_agent.sampling import Completion, SamplingParams
from tests.rollout.test_rollout import END, TOKENIZER

CALC = envs.make("calculator")


def calc_task(expr, i=0):
    base = CALC.sample_task(i, 1)
    return dataclasses.replace(base, id=f"sub/{expr}", prompt=f"Q: {expr}=?", verifier={"answer": safe_eval(expr)})


def make_task(text, parent=None):
    return calc_task(text), rollout.InProcessEnv(envs.make("calculator"))


def _completion(text):
    ids = TOKENIZER.encode(text) + [END]
    return Completion(tuple(ids), tuple(-0.5 for _ in ids), tuple(3 for _ in ids), "stop")


class SubAgentSampler:
    """A frozen policy: calls calc on its task, then answers with the result (each call takes
    `delay` seconds, as a model would); it may also try to delegate (`delegate_too`)."""

    def __init__(self, delay=0.0, delegate_too=False, calls_per_turn=1):
        self.delay, self.delegate_too = delay, delegate_too
        self.outputs = []
        self.calls = 0

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        await asyncio.sleep(self.delay)
        text = TOKENIZER.decode(prompt_ids)
        expr = text.split("Q: ")[1].split("=?")[0]
        results = re.findall(r"<tool_result>(.*?)</tool_result>", text)
        if self.delegate_too and not results:
            out = tp.format_tool_call(tp.ToolCall("delegate", {"task": expr}))
        elif results:
            out = tp.format_answer(results[-1].replace("error: ", ""))
        else:
            out = tp.format_tool_call(tp.ToolCall("calc", {"expr": expr}))
        completion = _completion(out)
        completion = Completion(completion.token_ids[:sampling.max_tokens], completion.logprobs[:sampling.max_tokens],
                                completion.versions[:sampling.max_tokens], "stop")
        self.outputs.append(list(completion.token_ids))
        return completion


class Orchestrator:
    """Splits 'Q: a+b+c+...=?' into one `delegate` call per term pair, then answers with the sum of
    the results."""

    def __init__(self, parts):
        self.parts = parts
        self.outputs = []

    async def generate(self, prompt_ids, sampling):
        text = TOKENIZER.decode(prompt_ids)
        results = re.findall(r"<tool_result>(.*?)</tool_result>", text)
        if results:
            total = sum(int(r) for r in results if r.lstrip("-").isdigit())
            out = tp.format_answer(str(total))
        else:
            out = "".join(tp.format_tool_call(tp.ToolCall("delegate", {"task": p})) for p in self.parts)
        completion = _completion(out)
        self.outputs.append(list(completion.token_ids))
        return completion


def _run(orchestrator, sub_sampler, parts, limits=delegation.DelegationLimits(max_subagents=8, token_budget=4096)):
    expr = "+".join(parts)
    task = calc_task(expr)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=400), max_context=2000,
                                       max_turns=4)
    sub_settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=60), max_context=400,
                                           max_turns=3)
    subagents = delegation.SubAgents(sub_sampler, make_task, sub_settings, TOKENIZER, tok.CHATML, limits)
    return asyncio.run(rollout.run_episode(orchestrator, rollout.InProcessEnv(envs.make("calculator")), task,
                                           TOKENIZER, tok.CHATML, settings, subagents=subagents))


def test_delegations_return_the_sub_agents_answers_and_only_the_orchestrator_is_trained():
    parts = ["12+7", "30+4", "5+5"]
    orchestrator, subs = Orchestrator(parts), SubAgentSampler()
    t = _run(orchestrator, subs, parts)
    assert t.reward_components["success"] == 1.0 and t.finish_reason == "answer"
    (turn, answer) = t.turns
    assert [d["answer"] for d in turn["delegations"]] == ["19", "34", "10"]
    assert all(d["success"] == 1.0 and d["depth"] == 1 and d["turns"] == 2 for d in turn["delegations"])
    # Only the orchestrator's sampled ids are trained: exactly its two replies, in order.
    trained = t.tokens[t.loss_mask == 1].tolist()
    assert trained == orchestrator.outputs[0] + orchestrator.outputs[1]
    text = TOKENIZER.decode(t.tokens.tolist())
    assert "<tool_result>19</tool_result><tool_result>34</tool_result><tool_result>10</tool_result>" in text
    assert '"name":"calc"' not in text  # no sub-agent token is in the orchestrator's sequence
    batch, _ = replay.pack([dataclasses.replace(t, advantage=1.0)], 2048)
    assert sorted(np.asarray(batch.tokens)[np.asarray(batch.loss_mask) == 1].tolist()) == sorted(trained)
    # The sub-agents' own trajectories are kept for analysis, whole.
    kept = [replay.Trajectory.from_dict(d["trajectory"]) for d in turn["delegations"]]
    assert sorted(k.tokens[k.loss_mask == 1].tolist() for k in kept) == sorted(
        subs.outputs[i] + subs.outputs[j] for i, j in [(0, 3), (1, 4), (2, 5)])
    assert delegation.critical_path_turns(t.turns) == 2 + 2 and delegation.total_turns(t.turns) == 2 + 3 * 2


def test_delegations_in_one_reply_run_at_once():
    one = time.perf_counter()
    _run(Orchestrator(["1+1"]), SubAgentSampler(delay=0.25), ["1+1"])
    one = time.perf_counter() - one
    parts = [f"{i}+1" for i in range(6)]
    many = time.perf_counter()
    t = _run(Orchestrator(parts), SubAgentSampler(delay=0.25), parts)
    many = time.perf_counter() - many
    assert t.reward_components["success"] == 1.0
    assert many < 2.0 * one < 6 * one, (one, many)  # 6 sub-agents of 2 turns x 0.25 s each: ~0.5 s, not ~3 s


def test_depth_count_and_budget_limits_hold():
    parts = [f"{i}+2" for i in range(5)]
    t = _run(Orchestrator(parts), SubAgentSampler(), parts, delegation.DelegationLimits(max_subagents=3))
    (turn, _) = t.turns
    assert len(turn["delegations"]) == 3
    text = TOKENIZER.decode(t.tokens.tolist())
    assert text.count("error: no sub-agents left (at most 3 per episode)") == 2
    # Depth: sub-agents that try to delegate are refused at depth 1 (max_depth 1) ...
    t = _run(Orchestrator(["3+4"]), SubAgentSampler(delegate_too=True), ["3+4"])
    sub = t.turns[0]["delegations"][0]["trajectory"]
    assert "sub-agents at depth 1 cannot delegate (max_depth 1)" in TOKENIZER.decode(sub["tokens"])
    # ... and may, one level down, with max_depth 2, the delegation counted in the same ledger.
    t = _run(Orchestrator(["3+4"]), SubAgentSampler(delegate_too=True), ["3+4"],
             delegation.DelegationLimits(max_depth=2, max_subagents=2))
    inner = t.turns[0]["delegations"][0]["trajectory"]["turns"][0]["delegations"]
    assert len(inner) == 1 and inner[0]["depth"] == 2
    assert delegation.critical_path_turns(t.turns) > delegation.critical_path_turns(t.turns[:1]) >= 3
    # Budget: 60 tokens for all sub-agents; the first one spends it, the next ones end or are refused.
    parts = [f"{i}+3" for i in range(4)]
    t = _run(Orchestrator(parts), SubAgentSampler(), parts, delegation.DelegationLimits(token_budget=60))
    records = t.turns[0]["delegations"]
    spent = sum(d["sampled_tokens"] for d in records)
    assert spent <= 60 and any(d["finish_reason"] == "delegation_budget" for d in records)
    assert t.reward_components["success"] == 0.0  # some sub-task went unanswered


def test_a_reply_for_the_environment_is_not_a_delegation():
    call = tp.format_tool_call(tp.ToolCall("delegate", {"task": "1+1"}))
    assert delegation.delegate_calls(call + call) == ["1+1", "1+1"]
    assert delegation.delegate_calls(call + tp.format_tool_call(tp.ToolCall("calc", {"expr": "1"}))) is None
    assert delegation.delegate_calls(call + tp.format_answer("2")) is None
    assert delegation.delegate_calls("no call") is None
    (bad,) = delegation.delegate_calls(tp.format_tool_call(tp.ToolCall("delegate", {"text": "x"})))
    assert isinstance(bad, tp.ToolCallError) and "missing required argument 'task'" in bad.message
    first = envs.make("calculator").reset(calc_task("1+1"))
    shown = envs.api.with_runner_tool(first, delegation.DELEGATE_TOOL)  # how run_episode advertises it
    assert shown.tools[-1]["name"] == "delegate" and '"name":"delegate"' in shown.system
    with pytest.raises(ValueError, match="delegation.max_depth=0"):
        delegation.DelegationLimits(max_depth=0)


def test_sub_agents_in_the_episode_settings_reach_every_episode_path():
    """`EpisodeSettings.subagents` (how a run's config sets them, `rollout.delegate`): episodes run
    by `collect_groups` (rollout groups, evaluation) delegate without being handed them."""
    parts = ["2+2", "3+3"]
    limits = delegation.DelegationLimits(max_subagents=8, token_budget=4096)
    sub_settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=60), max_context=400,
                                           max_turns=3)
    subs = SubAgentSampler()
    settings = rollout.EpisodeSettings(
        sampling=SamplingParams(temperature=1.0, max_tokens=400), max_context=2000, max_turns=4,
        subagents=delegation.SubAgents(subs, make_task, sub_settings, TOKENIZER, tok.CHATML, limits))
    (group,) = asyncio.run(rollout.collect_groups(Orchestrator(parts), lambda t: rollout.InProcessEnv(
        envs.make("calculator")), [calc_task("+".join(parts))], 2, TOKENIZER, tok.CHATML, settings))
    assert all(t.reward_components["success"] == 1.0 for t in group)
    assert [len(t.turns[0]["delegations"]) for t in group] == [2, 2] and subs.calls == 2 * 2 * 2


def test_a_resumed_episodes_ledger_counts_the_sub_agents_its_turns_ran():
    parts = ["1+2", "2+3"]
    t = _run(Orchestrator(parts), SubAgentSampler(), parts)
    ledger = delegation.Ledger(delegation.DelegationLimits(max_subagents=2, token_budget=4096), t.turns)
    assert ledger.started == 2 and ledger.tokens == sum(d["sampled_tokens"] for d in t.turns[0]["delegations"])
    assert ledger.refusal(0) == "no sub-agents left (at most 2 per episode)"
    assert delegation.Ledger(delegation.DelegationLimits()).started == 0
