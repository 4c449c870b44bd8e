"""Deployment (`agent.run`, `launch/agent.py`): the same episodes as rollout and evaluation.

A tiny random policy on the `chain` environment: its malformed replies earn long errors, so every
strategy edits the context in most episodes, and the three paths must still give the
same transcript, token for token, for the same task and seed."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_agent import agent, build, envs, evaluation, rollout
from jaxrl_agent.rollout.episode import run_coroutine
from jaxrl_agent.sampling.local import LocalSampler
from tests.test_trainer import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEVEL = 3
MAX_CONTEXT = 512


def chain_config(tmp_path, strategy):
    config = tiny_config(tmp_path)
    config.env.name, config.env.train_difficulties, config.env.eval_difficulties = "chain", "3", "3"
    # An untrained policy's replies are malformed, and each earns a ~90-token error: a turn is ~100
    # tokens, so the context passes the trigger (256) after two turns.
    config.rollout.max_turns, config.rollout.max_context, config.rollout.max_tokens_per_turn = 6, MAX_CONTEXT, 8
    config.rollout.context, config.rollout.context_keep_turns, config.rollout.context_trigger = strategy, 1, 0.5
    config.sampler.max_cache_length = config.sampler.max_prefill_length = config.learner.row_length = MAX_CONTEXT
    return config


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    config = chain_config(tmp_path_factory.mktemp("agent"), "keep_recent")
    model_config, params = build.build_model(config)
    tok = build.build_tokenizer(config)
    sampler = LocalSampler(build.build_engine(config, model_config, params, tok))
    yield config, tok, build.build_template(config), sampler
    sampler.close()


@pytest.mark.parametrize("strategy", ["keep_recent", "discard_all", "summarize"])
def test_learner_rows_are_what_the_sampler_saw_with_log_prob_parity(tmp_path, strategy):
    """Sampled episodes under each strategy (prefix cache on: a new sequence shares its head with
    the previous one's), packed: every learner sequence is exactly one of the trajectory's
    segments, and the learner's log-probs of the sampled tokens equal the sampler's."""
    import jax.numpy as jnp

    from jaxrl_agent import learner, replay

    config = chain_config(tmp_path, strategy)
    model_config, params = build.build_model(config)
    tok, template = build.build_tokenizer(config), build.build_template(config)
    settings = build.episode_settings(config, 0.8)
    env = envs.make("chain")
    tasks = [env.sample_task(s, LEVEL) for s in range(3)]
    with LocalSampler(build.build_engine(config, model_config, params, tok)) as sampler:
        assert sampler.engine.prefix_cache_entries > 0
        groups = run_coroutine(rollout.collect_groups(sampler, lambda t: rollout.InProcessEnv(envs.make(t.env)),
                                                      tasks, 2, tok, template, settings))
    trajectories = [t for g in groups for t in g]
    assert sum(len(t.segment_starts) for t in trajectories) >= 2  # edited episodes are in the batch
    batch, rows = replay.pack(trajectories, config.learner.row_length)
    pieces = sorted((t.tokens[a:b].tolist() for t in trajectories for a, b in t.segments))
    packed = sorted(np.asarray(batch.tokens)[r][np.asarray(batch.segment_ids)[r] == k].tolist()
                    for r in range(len(rows)) for k in range(1, len(rows[r]) + 1))
    assert packed == pieces
    logp, _ = learner.sequence_logprobs(model_config, params, jax.tree.map(jnp.asarray, batch), temperature=0.8)
    mask = np.asarray(batch.loss_mask) == 1
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(batch.sampler_logprobs)[mask], atol=1e-5)


@pytest.mark.parametrize("strategy", ["none", "keep_recent", "summarize"])
def test_deployment_evaluation_and_rollout_give_the_same_transcript(policy, strategy):
    config, tok, template, sampler = policy
    settings = agent.with_context(build.episode_settings(config, 0.0), strategy)
    env = envs.make("chain")
    spec = evaluation.EvalSpec(levels={"chain": ((LEVEL,), (LEVEL,))}, tasks_per_difficulty=3)
    seen = {}
    evaluation.evaluate(sampler, lambda t: rollout.InProcessEnv(envs.make(t.env)), {"chain": env}, tok, template,
                        spec, greedy=settings, sampled=settings,
                        on_episodes=lambda name, level, results: seen.setdefault((name, level), results))
    evaluated = seen[("chain", LEVEL)]
    tasks = [env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, LEVEL) for i in range(3)]
    groups = run_coroutine(rollout.collect_groups(
        sampler, lambda t: rollout.InProcessEnv(envs.make(t.env)), tasks, 1, tok, template, settings,
        seed=evaluation.EVAL_GREEDY_SEED))
    # Deployment from the run's own settings, with the strategy given as deployment's override.
    plain = agent.with_context(build.episode_settings(config, 0.0), "none")
    deployed = [agent.run(task, sampler, envs.make("chain"), tokenizer=tok, template=template, settings=plain,
                          context=strategy, seed=rollout.episode_seed(evaluation.EVAL_GREEDY_SEED, i, 0))
                for i, task in enumerate(tasks)]
    for i in range(3):
        rolled = groups[i][0]
        assert deployed[i].transcript == evaluated[i].transcript == agent.transcript(rolled, tok)
        np.testing.assert_array_equal(deployed[i].trajectory.tokens, rolled.tokens)
        np.testing.assert_array_equal(deployed[i].trajectory.loss_mask, rolled.loss_mask)
        np.testing.assert_allclose(deployed[i].trajectory.sampler_logprobs, rolled.sampler_logprobs, atol=1e-5)
        assert len(deployed[i].transcript) == len(rolled.segments)
    edits = [sum("context_edit" in t for t in r.trajectory.turns) for r in deployed]
    if strategy == "none":
        assert not any(edits) and all(r.trajectory.finish_reason == "context_limit" or r.trajectory.length < MAX_CONTEXT
                                      for r in deployed)
    else:
        assert any(edits)  # the comparison covered edited episodes
        assert all(r.trajectory.longest_segment <= MAX_CONTEXT for r in deployed)
        text = deployed[edits.index(max(edits))].text()
        assert f"--- context edited ({strategy}) ---" in text


def test_more_edits_at_deployment_than_training_allowed(policy):
    config, tok, template, sampler = policy
    settings = agent.with_context(build.episode_settings(config, 0.0), "keep_recent", max_edits=1)
    task = envs.make("chain").sample_task(envs.HELD_OUT_SEED_OFFSET, LEVEL)
    capped = agent.run(task, sampler, envs.make("chain"), tokenizer=tok, template=template, settings=settings)
    scaled = agent.run(task, sampler, envs.make("chain"), tokenizer=tok, template=template, settings=settings,
                       max_edits=0)
    count = lambda r: sum("context_edit" in t for t in r.trajectory.turns)
    assert count(capped) <= 1 < count(scaled)
    # An environment served elsewhere (an episode environment) runs too; anything else is refused.
    served = agent.run(task, sampler, rollout.InProcessEnv(envs.make("chain")), tokenizer=tok, template=template,
                       settings=settings, max_edits=0)
    assert served.transcript == scaled.transcript
    with pytest.raises(TypeError, match="env='chain': expected an envs.Environment or an episode environment"):
        agent.run(task, sampler, "chain", tokenizer=tok, template=template, settings=settings)


@pytest.mark.slow
def test_launch_agent_runs_a_checkpoint_and_prints_transcripts(tmp_path):
    """The CLI on a run's workdir (config.json and a checkpoint): it restores that checkpoint's
    parameters, not the initial ones, and prints each episode's transcript and a tally."""
    from jaxrl_agent import checkpoint

    config = chain_config(tmp_path / "run", "keep_recent")
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(config.to_json())
    _, params = build.build_model(config)
    shifted = jax.tree.map(lambda x: x + 0.05, params)
    saver = checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=2)
    saver.save(7, {"params": shifted}, checkpoint.RunState("rl", 7, 7, 0.0, 0, {}, {}, []))
    saver.close()
    with agent.load(str(workdir)) as deployment:
        assert deployment.step == 7
        from jaxrl_agent import models

        held, _ = deployment.sampler.engine.current_params()
        for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(models.unstack_layers(shifted)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "agent.py"), f"--checkpoint={workdir}",
                           "--tasks=2", "--difficulty=2", "--context=summarize"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("=== chain/2/") == 2 and "Q: Follow the chain from" in done.stdout
    assert "chain level 2, checkpoint step 7, context summarize: " in done.stdout
    missing = subprocess.run([sys.executable, str(ROOT / "launch" / "agent.py"), f"--checkpoint={tmp_path / 'none'}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "config.json" in missing.stderr
    json.loads((workdir / "config.json").read_text())  # the workdir is left as it was


def test_a_summarize_run_edits_its_episodes_and_weights_its_summaries(tmp_path, monkeypatch):
    """The launcher's path with rollout.context=summarize and learner.summary_weight: the RL
    episodes are summarized (the run's context metrics say so), and every packed batch of the
    learner weights the summaries by the config's weight."""
    from jaxrl_agent import replay, trainer

    config = chain_config(tmp_path, "summarize")
    config.learner.summary_weight = 2.5
    config.sft.steps, config.rl.iterations, config.eval.every = 0, 2, 0
    config.env.eval_difficulties, config.eval.tasks_per_difficulty, config.eval.pass_k = "3", 1, 1
    weights, pack = [], replay.pack

    def recording_pack(trajectories, row_length, **kwargs):
        weights.append(kwargs.get("summary_weight", 1.0))
        return pack(trajectories, row_length, **kwargs)

    monkeypatch.setattr(replay, "pack", recording_pack)
    records = [json.loads(line) for line in open(trainer.train_and_evaluate(config, quiet=True))]
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(rl) == 2 and weights and set(weights) == {2.5}
    assert any(r["context/edits_per_episode"] > 0 and r["context/summary_token_share"] > 0 for r in rl)
    assert all(r["context/longest_sequence_max"] <= MAX_CONTEXT for r in rl)
