"""Slow tools: heavy-tailed latency, and blocking steps that do not stall other episodes."""

import asyncio
import concurrent.futures
import time

import pytest

from jaxrl_agent import envs, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.envs.testing import ToolLatency
from tests.rollout.test_rollout import TOKENIZER, ScriptedSampler, _settings


def test_latency_is_pareto_with_the_given_median_and_cap():
    env = ToolLatency(envs.make("calculator"), median_s=0.1, alpha=1.2, max_s=3.0)
    assert env.latency(0.5) == pytest.approx(0.1)
    assert env.latency(0.99) > 10 * env.latency(0.5)  # heavy tail
    assert env.latency(0.999999) == 3.0
    with pytest.raises(ValueError, match="alpha > 0"):
        ToolLatency(envs.make("calculator"), median_s=0.1, alpha=0.0)


def test_blocking_tool_steps_overlap_across_episodes():
    base = envs.make("calculator")
    tasks = [base.sample_task(s, 1) for s in range(8)]
    executor = concurrent.futures.ThreadPoolExecutor(16)
    make_env = lambda task: rollout.InProcessEnv(ToolLatency(envs.make("calculator"), median_s=0.3, alpha=50.0),
                                                 executor=executor)
    started = time.perf_counter()
    groups = asyncio.run(rollout.collect_groups(ScriptedSampler(), make_env, tasks, 1, TOKENIZER, tok.CHATML,
                                                _settings()))
    elapsed = time.perf_counter() - started
    executor.shutdown()
    assert all(g[0].reward == 1.0 for g in groups)
    # Eight episodes each wait ~0.3 s on their tool call; run one after another they take >= 2.4 s.
    assert elapsed < 1.5, elapsed
