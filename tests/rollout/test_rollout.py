"""Episodes as coroutines: token bookkeeping, context limits, advantages."""

import asyncio

import jax
import numpy as np

from jaxrl_agent import envs, models, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.sampling import AgentEngine, Completion, LocalSampler, SamplingParams

TOKENIZER = tok.CharTokenizer()
END = TOKENIZER.eos_id


class ScriptedSampler:
    """Replies with the calculator expert's actions as ids, with made-up log-probs and versions."""

    def __init__(self, version=3):
        self.version = version
        self.prompts = []

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        text = TOKENIZER.decode(prompt_ids)
        expr = text.split("Q: ")[1].split("=?")[0]
        if "<tool_result>" not in text:
            action = envs.format_tool_call(envs.ToolCall("calc", {"expr": expr}))
        else:
            action = envs.format_answer(text.rsplit("<tool_result>", 1)[1].split("</tool_result>")[0])
        ids = (TOKENIZER.encode(action) + [END])
        reason = "stop" if len(ids) <= sampling.max_tokens else "length"
        ids = ids[: sampling.max_tokens]
        return Completion(tuple(ids), tuple(-0.5 for _ in ids), tuple(self.version for _ in ids), reason)


def _settings(max_context=400):
    return rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100), max_context=max_context,
                                   max_turns=4)


def test_episode_tokens_are_prompt_sampled_ids_and_observations():
    env = envs.make("calculator")
    task = env.sample_task(4, 2)
    sampler = ScriptedSampler()
    t = asyncio.run(rollout.run_episode(sampler, rollout.InProcessEnv(env), task, TOKENIZER, tok.CHATML, _settings()))
    assert t.reward_components["success"] == 1.0 and t.finish_reason == "answer" and t.reward == 1.0
    # The rendered conversation equals the turn template applied to the same messages.
    call = envs.format_tool_call(envs.ToolCall("calc", {"expr": task.verifier["expr"]}))
    result = f"<tool_result>{task.verifier['answer']}</tool_result>"
    expected = tok.CHATML.render([
        {"role": "user", "content": task.prompt}, {"role": "assistant", "content": call},
        {"role": "tool", "content": result}, {"role": "assistant", "content": f"<answer>{task.verifier['answer']}</answer>"},
    ], TOKENIZER)
    n = len(t.tokens)
    np.testing.assert_array_equal(t.tokens, expected.ids[:n])
    np.testing.assert_array_equal(t.loss_mask, expected.assistant_mask[:n])
    # Sampler bookkeeping only on generated tokens.
    assert set(t.sampler_logprobs[t.loss_mask == 1].tolist()) == {-0.5}
    assert set(t.sampler_logprobs[t.loss_mask == 0].tolist()) == {0.0}
    assert set(t.policy_version[t.loss_mask == 1].tolist()) == {3}
    # The second prompt the sampler saw is the full history so far, as ids.
    assert sampler.prompts[1] == t.tokens[: len(sampler.prompts[1])].tolist()


def test_expert_trajectory_matches_a_sampled_episode():
    env = envs.make("kb_search")
    task = env.sample_task(1, 2)
    t = rollout.expert_trajectory(env, task, envs.expert_policy("kb_search"), TOKENIZER, tok.CHATML)
    assert t.reward_components["correctness"] == 1.0
    assistant = TOKENIZER.decode(t.tokens[t.loss_mask == 1])
    assert assistant.count("<|im_end|>") == 3 and assistant.count("<tool_call>") == 2


def test_context_limit_ends_the_episode():
    env = envs.make("calculator")
    t = asyncio.run(rollout.run_episode(ScriptedSampler(), rollout.InProcessEnv(env), env.sample_task(0, 1),
                                        TOKENIZER, tok.CHATML, _settings(max_context=45)))
    assert t.finish_reason == "context_limit" and t.reward == 0.0 and len(t.tokens) <= 45


def test_group_advantages_and_signal_share():
    def traj(reward):
        return rollout.episode.Trajectory(tokens=np.zeros(3, np.int32), loss_mask=np.array([0, 1, 1], np.int32),
                                          sampler_logprobs=np.zeros(3, np.float32),
                                          policy_version=np.zeros(3, np.int32), reward=reward)

    groups = [[traj(1.0), traj(0.0), traj(1.0), traj(0.0)], [traj(1.0)] * 4]
    groups, stats = rollout.assign_advantages(groups)
    assert [t.advantage for t in groups[0]] == [0.5, -0.5, 0.5, -0.5]
    assert all(t.advantage == 0.0 for t in groups[1])
    assert stats["nonzero_advantage_group_share"] == 0.5
    # Groups of different sizes (adaptive allocation, staleness drops): each against its own mean.
    ragged = [[traj(1.0), traj(0.0), traj(0.0)], [traj(0.0)] * 2, [traj(1.0), traj(0.0), traj(1.0), traj(0.0)]]
    ragged, stats = rollout.assign_advantages(ragged)
    np.testing.assert_allclose([t.advantage for t in ragged[0]], [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    assert [t.advantage for t in ragged[1]] == [0.0, 0.0] and [t.advantage for t in ragged[2]] == [0.5, -0.5, 0.5, -0.5]
    assert stats["nonzero_advantage_group_share"] == 2 / 3 and stats["groups"] == 3


def test_real_sampler_and_env_pool_episode():
    config = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=1)
    engine = AgentEngine(config, models.init_params(config, jax.random.PRNGKey(0)), TOKENIZER,
                         max_concurrent_decodes=4, max_prefill_length=64, max_cache_length=128)
    from jaxrl_agent.envs.pool import EnvPool

    with LocalSampler(engine) as sampler, EnvPool(1) as pool:
        env = envs.make("calculator")
        tasks = [env.sample_task(s, 1) for s in range(2)]
        groups = asyncio.run(rollout.collect_groups(
            sampler, lambda task: rollout.ServiceEnv(pool, "calculator"), tasks, 2, TOKENIZER, tok.CHATML,
            _settings(max_context=120)))
    for t in (t for g in groups for t in g):
        assert t.generated_tokens > 0 and t.finish_reason in ("answer", "max_turns", "context_limit")
        assert len(t.tokens) <= 120


def test_run_coroutine_works_inside_a_running_event_loop():
    """Jupyter and Colab kernels run an event loop: evaluation must not call asyncio.run there."""
    import asyncio
    import threading

    from jaxrl_agent.rollout.episode import run_coroutine

    async def answer():
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert run_coroutine(answer()) == threading.current_thread().name  # no loop: this thread

    async def inside_a_loop():
        return run_coroutine(answer())

    assert asyncio.run(inside_a_loop()).startswith("run_coroutine")
