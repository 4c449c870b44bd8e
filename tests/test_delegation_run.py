"""`rollout.delegate` in a run: demonstrations show delegation, the sub-agents' weights are a
frozen copy of the SFT policy through RL and resume, and the iteration records count delegations."""

import json

import jax
import numpy as np
import pytest

from jaxrl_agent import build, checkpoint, trainer
from tests.test_trainer import tiny_config


def _delegating_config(workdir):
    config = tiny_config(workdir)
    config.env.name = "chain_sum"
    config.env.train_difficulties = config.env.eval_difficulties = config.sft.difficulties = "1"
    config.rollout.delegate = "initial"
    config.rollout.max_turns, config.rollout.max_context = 6, 240
    config.eval.pass_k = 0
    config.checkpoint.every, config.checkpoint.keep = 1, 10
    return config


def _arrays(workdir, step):
    manager = checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=10)
    try:
        ocp = manager._ocp
        return manager.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(None)))["state"]
    finally:
        manager.close()


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_demonstrations_delegate_when_sub_agents_are_on(tmp_path):
    config = _delegating_config(tmp_path)
    environments = build.Environments(config)
    try:
        tok, template = build.build_tokenizer(config), build.build_template(config)
        demos = build.build_demonstrations(config, environments, {"chain_sum": (1,)}, tok, template, first_seed=0)
        trajectories = demos.sample(np.random.RandomState(0), 4)
        for t in trajectories:
            assert t.reward == 1.0 and len(t.turns[0]["delegations"]) == 2
            assert '"name":"delegate"' in tok.decode(t.tokens[t.loss_mask == 1].tolist())
        # sft.delegate_share: that share of tasks (by task id) delegating, the rest inline (every
        # one a success: level 1 fits the context inline).
        config.sft.num_demonstrations = 0  # a fresh demonstration per task: every task seen
        for share, expect in ((0.0, {False}), (0.5, {False, True}), (1.0, {True})):
            config.sft.delegate_share = share
            mixed = build.build_demonstrations(config, environments, {"chain_sum": (1,)}, tok, template,
                                               first_seed=0).sample(np.random.RandomState(0), 32)
            styles = {bool(t.turns[0].get("delegations")) for t in mixed}
            assert styles == expect, (share, styles)
            assert all(t.reward == 1.0 for t in mixed)
            if share == 0.5:
                assert 8 <= sum(bool(t.turns[0].get("delegations")) for t in mixed) <= 24
        config.sft.delegate_share = 1.2
        with pytest.raises(build.ConfigError, match=r"sft.delegate_share=1.2"):
            build.validate_config(config)
        config.sft.delegate_share, config.sft.num_demonstrations = 1.0, 512
        config.rollout.delegate = ""  # without sub-agents: the inline expert
        inline = build.build_demonstrations(config, environments, {"chain_sum": (1,)}, tok, template, first_seed=0)
        assert all("delegations" not in turn for t in inline.sample(np.random.RandomState(0), 4) for turn in t.turns)
    finally:
        environments.close()


@pytest.mark.slow  # ~90 s: in CI's slow pass
def test_sub_agent_weights_stay_frozen_through_rl_and_resume(tmp_path):
    config = _delegating_config(tmp_path)
    trainer.train_and_evaluate(config, quiet=True)
    config.resume, config.rl.iterations = True, 3
    trainer.train_and_evaluate(config, quiet=True)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for r in rl:
        assert {"delegation/per_episode", "delegation/subagent_success", "delegation/critical_path_turns",
                "delegation/total_turns"} <= set(r)
        assert 0 < r["delegation/critical_path_turns"] <= r["delegation/total_turns"]
    sft_done = _arrays(tmp_path, config.sft.steps)
    assert _same(sft_done["subagent_params"], sft_done["params"])
    for step in (config.sft.steps + 2, config.sft.steps + 3):  # before and after the resume
        later = _arrays(tmp_path, step)
        assert _same(later["subagent_params"], sft_done["params"])  # the sub-agents never trained
        assert not _same(later["params"], sft_done["params"])  # while the orchestrator did
    # Deployment (`agent.load`) brings the same frozen sub-agents, and its episodes can delegate.
    from jaxrl_agent import agent, envs
    from jaxrl_agent.rollout.episode import run_coroutine
    from jaxrl_agent.sampling import SamplingParams

    with agent.load(str(tmp_path)) as deployed:
        assert deployed.settings.subagents is not None and deployed.settings.subagents.sampler is deployed.subagent_sampler
        model_config, params = build.build_model(config)
        sft_params, _, _ = checkpoint.restore_policy(str(tmp_path / "checkpoints"), params, keep=10,
                                                     step=config.sft.steps)
        reference = build.build_subagent_sampler(config, model_config, sft_params, deployed.tokenizer)
        prompt = deployed.tokenizer.encode("Q: Follow the chain from KQ; answer its value.")
        sampling = SamplingParams(temperature=0.0, max_tokens=8)
        frozen = run_coroutine(deployed.subagent_sampler.generate(prompt, sampling))
        expected = run_coroutine(reference.generate(prompt, sampling))
        policy = run_coroutine(deployed.sampler.generate(prompt, sampling))
        reference.close()
        assert frozen.token_ids == expected.token_ids and np.allclose(frozen.logprobs, expected.logprobs)
        # The deployed policy is the trained one: other tokens, or the same tokens at other log-probs.
        assert (policy.token_ids != frozen.token_ids
                or not np.allclose(policy.logprobs, frozen.logprobs)), (policy, frozen)
        task = envs.make("chain_sum").sample_task(10**6, 1)
        result = agent.run(task, deployed.sampler, envs.make("chain_sum"), tokenizer=deployed.tokenizer,
                           template=deployed.template, settings=deployed.settings)
        assert result.trajectory.env == "chain_sum" and result.trajectory.finish_reason


def test_sub_agents_sample_at_their_own_temperature_and_greedily_in_evaluation(tmp_path):
    """rollout.delegate_temperature: -1 = the orchestrator's; otherwise that, never above the
    orchestrator's (a greedy evaluation keeps greedy sub-agents); a bad value is a config error."""
    config = tiny_config(tmp_path)
    config.rollout.delegate = "initial"
    sub = lambda temperature: build.build_subagents(config, None, lambda task: None, None, None,
                                                    temperature).settings.sampling.temperature
    assert build.build_subagents(config, None, lambda task: None, None, None, 1.0).settings.sampling.max_tokens \
        == config.rollout.max_tokens_per_turn
    assert (sub(1.0), sub(0.0)) == (1.0, 0.0)  # the default: the orchestrator's
    config.rollout.delegate_temperature = 0.0
    assert (sub(1.0), sub(0.0)) == (0.0, 0.0)
    config.rollout.delegate_temperature = 0.5
    assert (sub(1.0), sub(0.3), sub(0.0)) == (0.5, 0.3, 0.0)
    config.rollout.delegate_temperature = -0.5
    with pytest.raises(build.ConfigError, match=r"rollout.delegate_temperature=-0.5: expected -1"):
        build.validate_config(config)


def test_sub_agents_from_a_hugging_face_folder_sample_that_checkpoint(tmp_path):
    """rollout.delegate=<folder>: the sub-agents sample the folder's weights (a separate checkpoint,
    e.g. one exported by launch/export_hf.py), not the weights RL starts from; a path that is not a
    folder is a config error."""
    from jaxrl_agent import models
    from jaxrl_agent.rollout.episode import run_coroutine
    from jaxrl_agent.sampling import LocalSampler, SamplingParams

    config = tiny_config(tmp_path)
    model_config, params = build.build_model(config)
    config.seed = 1
    _, other = build.build_model(config)  # another initialisation: the separate checkpoint
    folder = tmp_path / "subagent_hf"
    models.save_hf(str(folder), model_config, other)
    config.rollout.delegate = str(folder)
    build.validate_config(config)
    tok = build.build_tokenizer(config)
    prompt = tok.encode("Q: Follow the chain from KQ; answer its value.")
    sampling = SamplingParams(temperature=0.0, max_tokens=8)
    samplers = {"delegate": build.build_subagent_sampler(config, model_config, params, tok),
                "folder": LocalSampler(build.build_engine(config, model_config, other, tok)),
                "initial": LocalSampler(build.build_engine(config, model_config, params, tok))}
    try:
        out = {name: run_coroutine(s.generate(prompt, sampling)) for name, s in samplers.items()}
    finally:
        for s in samplers.values():
            s.close()
    assert out["delegate"].token_ids == out["folder"].token_ids
    assert np.allclose(out["delegate"].logprobs, out["folder"].logprobs, atol=1e-5)
    assert out["delegate"].token_ids != out["initial"].token_ids \
        or not np.allclose(out["delegate"].logprobs, out["initial"].logprobs, atol=1e-3)
    config.rollout.delegate = str(tmp_path / "missing")
    with pytest.raises(build.ConfigError,
                       match=r"rollout.delegate=.*missing.*expected '' \(no sub-agents\), 'initial' or a Hugging Face"):
        build.validate_config(config)
