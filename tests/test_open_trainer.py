"""The open trainer: every choice reachable from the config — objectives, advantages, corrections,
the reference KL, environments (imports, kwargs, mixtures, services, the watchdog), rewards — and a
user project outside the package trained through the launcher."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import build, learner, losses, models, replay, trainer
from tests.test_trainer import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
USER_PROJECT = FIXTURES / "user_project"


def _rl_only(config, iterations=2):
    config.sft.steps = 0
    config.rl.iterations = iterations
    config.eval.every = 100
    config.eval.pass_k = 0
    config.eval.tasks_per_difficulty = 2
    config.env.eval_difficulties = "1"
    config.metrics.tensorboard = False
    return config


def _records(path):
    return [json.loads(line) for line in open(path)]


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("key,value,message", [
    ("rl.objective", "trpo", r"rl.objective='trpo': expected one of \('mirror_descent'"),
    ("rl.advantage", "gae", r"rl.advantage='gae': expected one of"),
    ("rl.correction", "vtrace", r"rl.correction='vtrace': expected one of"),
    ("rl.kl_estimator", "k4", r"rl.kl_estimator='k4'"),
    ("rl.reference", "/no/such/folder", r"rl.reference='/no/such/folder'"),
    ("rl.objective_fn", "no_such_module_xyz:f", r"rl.objective_fn='no_such_module_xyz:f': cannot import"),
    ("rl.objective_fn", "jaxrl_agent.losses:nothing_here", r"module 'jaxrl_agent.losses' has no 'nothing_here'"),
    ("env.imports", "no_such_module_xyz", r"env.imports: cannot import 'no_such_module_xyz'"),
    ("env.mixture", "calculator:0.5,nowhere:0.5", r"environment 'nowhere' is not registered"),
    ("env.mixture", "calculator:x", r"weight 'x' of 'calculator' is not a number"),
    ("env.service", "pool2", r"env.service='pool2': expected one of \('auto', 'inprocess', 'pool'\)"),
    ("env.kwargs", "[1, 2]", r"env.kwargs='\[1, 2\]': expected a JSON object"),
    ("reward.weights", "correctness", r"reward.weights='correctness': expected 'name:weight"),
    ("reward.fn", "no_such_module_xyz:f", r"reward.fn='no_such_module_xyz:f': cannot import"),
    ("tokenizer.template", "alpaca", r"tokenizer.template='alpaca': expected one of \('chatml', 'llama3', 'model'\)"),
    ("tokenizer.template", "model", r"tokenizer.template='model' reads the tokenizer folder's chat_template: it "
                                    r"needs tokenizer.kind='hf'"),
    ("tokenizer.tool_format", "qwen3", r"tokenizer.tool_format='qwen3' is a model's own format: it needs "
                                       r"tokenizer.template='model'"),
    ("tokenizer.tool_format", "hermes", r"tokenizer.tool_format='hermes': expected one of \('env', 'llama3.1', "
                                        r"'qwen3'\)"),
    ("tokenizer.kind", "hf", r"tokenizer.template='chatml' is a built-in template for the character tokenizer"),
    ("rollout.max_think_tokens", -1, r"rollout.max_think_tokens=-1: expected >= 0"),
    ("rollout.top_k", -1, r"rollout.top_k=-1: expected >= 0"),
    ("rollout.top_p", 0.0, r"rollout.top_p=0.0: expected in \(0, 1\]"),
    ("eval.initial", "sometimes", r"eval.initial='sometimes': expected one of auto, true, false"),
    ("sft.rows_per_update", 6, r"sft.rows_per_update=6: expected -1 .* or a multiple of 4 \(learner.row_multiple=4 "
                               r"and the SFT microbatches, 1\)"),
    ("sft.microbatches", -1, r"sft.microbatches=-1: expected an integer >= 0 \(0 = learner.microbatches\)"),
    ("learner.microbatches", 0, r"learner.microbatches=0: expected an integer >= 1"),
    ("sft.rows_per_update", -2, r"sft.rows_per_update=-2: expected -1"),
    ("sampler.shape_reuse_calls", -2.0, r"sampler.shape_reuse_calls=-2.0: expected >= 0 \(0 = compile every shape\)"),
    ("sampler.decode_shape_reuse_calls", -3.0, r"sampler.decode_shape_reuse_calls=-3.0: expected >= 0"),
    ("learner.shape_reuse_calls", -1.0, r"learner.shape_reuse_calls=-1.0: expected >= 0 \(0 = compile every shape\)"),
])
def test_bad_choices_fail_before_any_model_is_built(tmp_path, key, value, message):
    config = tiny_config(tmp_path)
    section, field = key.split(".")
    config[section][field] = value
    with pytest.raises(build.ConfigError, match=message):
        build.validate_config(config)


def test_sft_rows_per_update_must_split_into_the_sft_microbatches(tmp_path):
    config = tiny_config(tmp_path)
    config.sft.microbatches, config.sft.rows_per_update = 8, 12
    with pytest.raises(build.ConfigError, match=r"sft.rows_per_update=12: expected -1 .* or a multiple of 8 "
                                                r"\(learner.row_multiple=4 and the SFT microbatches, 8\)"):
        build.validate_config(config)
    config.sft.microbatches = 0  # learner.microbatches (1): 12 rows split
    build.validate_config(config)
    assert build.sft_microbatches(config) == 1


def test_sft_needs_an_expert_or_none(tmp_path):
    from jaxrl_agent import envs

    envs.register("no_expert_calc", lambda: envs.make("calculator"), overwrite=True)
    config = tiny_config(tmp_path)
    config.env.name = "no_expert_calc"
    with pytest.raises(build.ConfigError, match="environment 'no_expert_calc' has no scripted expert"):
        build.validate_config(config)


# ------------------------------------------------------------------------------ objectives
# Together the variants cover every named objective, advantage, correction and KL estimator.
VARIANTS = {
    "ppo+grpo+none+dual_clip": {"rl.objective": "ppo", "rl.advantage": "grpo", "rl.correction": "none",
                                "rl.dual_clip": 3.0, "rl.clip_eps_high": 0.28},
    "gspo+rloo+icepop+k3": {"rl.objective": "gspo", "rl.advantage": "rloo", "rl.correction": "icepop",
                            "rl.kl_coef": 0.05, "rl.kl_estimator": "k3", "rl.negative_advantage_weight": 1.0},
    "cispo+ploo+decoupled": {"rl.objective": "cispo", "rl.advantage": "ploo", "rl.correction": "decoupled",
                             "rl.clip_eps_low": 1.0, "rl.tau": 1.0},
    "reinforce+dr_grpo+tis+entropy+k1": {"rl.objective": "reinforce", "rl.advantage": "dr_grpo",
                                         "rl.correction": "tis", "rl.entropy_coef": 0.01, "rl.kl_coef": 0.05,
                                         "rl.kl_estimator": "k1"},
    "mirror_descent_sequence+k2": {"rl.objective": "mirror_descent", "rl.level": "sequence", "rl.kl_coef": 0.05,
                                   "rl.kl_estimator": "k2"},
}
EXPECTED_METRICS = {
    "ppo+grpo+none+dual_clip": ["ppo_clip/loss", "ppo/clip_frac_low"],
    "gspo+rloo+icepop+k3": ["gspo/loss", "kl_k3/loss", "kl_k3/mean", "icepop/masked_frac"],
    "cispo+ploo+decoupled": ["cispo/loss", "decoupled/behaviour_weight_mean"],
    "reinforce+dr_grpo+tis+entropy+k1": ["reinforce/loss", "entropy/mean", "kl_k1/loss", "tis/weight_mean"],
    "mirror_descent_sequence+k2": ["mirror_descent/loss", "kl_k2/loss"],
}


def _scrambled_reward(trajectory) -> float:
    return float(np.random.RandomState(abs(hash((trajectory.group_id, trajectory.sample_index))) % 2**31).rand())


# One variant in the default suite; the others (~20 s each) in the slow pass.
@pytest.mark.parametrize("name", [name if name == "ppo+grpo+none+dual_clip" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in sorted(VARIANTS)])
def test_every_named_objective_advantage_correction_and_kl_runs_from_the_config(tmp_path, name):
    config = _rl_only(tiny_config(tmp_path))
    for key, value in VARIANTS[name].items():
        section, field = key.split(".")
        config[section][field] = value
    # Untrained, the policy fails every task alike; rewards that differ within a group (a fixed
    # pseudo-random value per episode) give every update a non-zero advantage to act on.
    records = _records(trainer.train_and_evaluate(config, quiet=True, reward_fn=_scrambled_reward))
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    trained = [r for r in rl if r["trained_trajectories"] > 0]
    assert trained, "no iteration trained (every group all-equal twice)"
    for record in trained:
        assert np.isfinite(record["loss"]) and record["grad_norm"] > 0
        missing = [k for k in EXPECTED_METRICS[name] if k not in record]
        assert not missing, f"{name}: objective metrics {missing} did not reach metrics.jsonl"
        # rl.negative_advantage_weight reaches the trained advantages: the config's 0.25 scales the
        # failures of these mixed groups (a positive mean); at 1 a centred estimator's mean is 0.
        if config.rl.negative_advantage_weight < 1:
            assert record["advantage_mean"] > 0.01
        elif config.rl.advantage in ("grpo", "dr_grpo", "rloo"):
            assert abs(record["advantage_mean"]) < 1e-5
        if "rl.kl_coef" in VARIANTS[name]:
            # One update from the reference at most: the KL is small but computed (reference forward pass).
            assert abs(record[f"kl_{VARIANTS[name]['rl.kl_estimator']}/mean"]) < 1.0


def test_kl_to_the_reference_falls_when_only_kl_is_optimised():
    from jaxrl_agent import envs, rollout, tokenizer as tok

    tokenizer = tok.CharTokenizer()
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, num_layers=1, hidden_size=32,
                                intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    reference = models.init_params(config, jax.random.PRNGKey(0))
    # The policy starts away from the reference.
    params = jax.tree.map(lambda p, n: p + 3.0 * n, reference,
                          models.init_params(config, jax.random.PRNGKey(1)))
    env = envs.make("calculator")
    trajectories = [rollout.expert_trajectory(env, env.sample_task(s, 1), envs.expert_policy("calculator"),
                                              tokenizer, tok.CHATML) for s in range(4)]
    batch, _ = replay.pack(trajectories, 128, row_multiple=2)
    objective = losses.make_objective([losses.KLTerm("k3", coef=1.0)])
    assert objective.needs_reference
    optimizer = learner.make_optimizer(learning_rate=3e-3, warmup_steps=1, total_steps=40)
    state = learner.init_state(params, optimizer, ref_params=reference)
    step = jax.jit(learner.make_train_step(config, optimizer, objective=objective))
    kls = []
    for _ in range(25):
        state, metrics = step(state, batch)
        kls.append(float(metrics["kl_k3/mean"]))
    assert kls[0] > 1.0 and kls[-1] < 0.5 * kls[0], kls
    # The reference is frozen.
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(reference)))


@pytest.mark.slow
def test_an_objective_and_a_reward_fn_passed_from_python(tmp_path):
    seen = []

    def my_loss(logprobs, sampler_logprobs, ref_logprobs, advantages, mask, cfg):
        return losses.masked_token_mean(-advantages * logprobs, mask), {"tokens_seen": jnp.sum(mask)}

    def reward_fn(trajectory):
        seen.append(trajectory.task_id)
        return 1.0 if trajectory.finish_reason == "answer" else 0.0

    config = _rl_only(tiny_config(tmp_path))
    objective = losses.objective_from_loss(my_loss, name="mine")
    records = _records(trainer.train_and_evaluate(config, quiet=True, objective=objective, reward_fn=reward_fn))
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(seen) == sum(r["rollouts"] for r in rl)
    for record in rl:
        # With no reward.weights the function's value is the reward.
        assert record["reward"] == pytest.approx(record["reward/custom"])
        assert record["reward/custom"] == pytest.approx(record["finish_reasons"].get("answer", 0) / record["rollouts"])
        if record["trained_trajectories"]:
            assert record["mine/tokens_seen"] > 0
    assert next(r for r in records if r["stage"] == "start")["objective"] == "mine"


# ------------------------------------------------------------------------------ environments
def test_a_mixture_reports_per_environment_metrics_and_evaluation(tmp_path):
    config = _rl_only(tiny_config(tmp_path))
    config.env.mixture = "calculator:0.5,kb_search:0.5"
    config.rollout.prompts_per_iteration = 6
    config.rl.iterations = 1
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    (rl,) = [r for r in records if r["stage"] == "rl"]
    assert rl["rollouts/calculator"] + rl["rollouts/kb_search"] == rl["rollouts"] == 12
    for env in ("calculator", "kb_search"):
        assert 0.0 <= rl[f"success/{env}"] <= 1.0 and 0.0 <= rl[f"signal_share/{env}"] <= 1.0
        assert f"sampled_entropy/{env}" in rl
    final = [r for r in records if r["stage"] == "rl_eval"][-1]
    assert {"eval/calculator/pass@1/d1", "eval/kb_search/pass@1/d1", "eval/calculator/success",
            "eval/kb_search/success", "eval/success"} <= set(final)
    assert final["eval/success"] == pytest.approx(
        (final["eval/calculator/success"] + final["eval/kb_search/success"]) / 2)


@pytest.mark.slow  # in CI's slow pass: keeps the default suite under ~15 min on a clean clone
def test_a_hanging_step_in_process_ends_only_its_episode(tmp_path):
    config = _rl_only(tiny_config(tmp_path))
    config.env.imports = "tests.fixtures.faulty_envs"
    config.env.name = "calc_hang"
    config.env.service = "inprocess"  # ('auto' would put this subclass of calculator in the pool)
    config.env.step_timeout_s = 2.0  # well above a normal step on a loaded 2-core host, well below the 4 s hang
    config.rl.iterations = 1
    config.rollout.prompts_per_iteration = 4  # task seeds 0..3: seed 0 hangs
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    (rl,) = [r for r in records if r["stage"] == "rl"]
    assert rl["finish_reasons"].get("env_timeout", 0) == 2  # both episodes of task 0
    assert sum(rl["finish_reasons"].values()) == 8


def test_env_service_auto_keeps_the_library_s_pure_environments_in_process_and_isolates_the_rest(tmp_path):
    from jaxrl_agent import envs
    from tests.fixtures import faulty_envs  # noqa: F401 - registers calc_hang / calc_crash

    config = tiny_config(tmp_path)
    assert config.env.service == "auto" and build.env_service(config) == "inprocess"  # calculator
    config.env.mixture = "calculator:0.5,kb_search:0.3,terminal:0.2"
    assert build.env_service(config) == "inprocess"
    for mixture in ("calculator:0.5,code:0.5",  # runs the policy's code
                    "calculator:0.5,calc_hang:0.5",  # a subclass of calculator does not inherit the flag
                    "calculator:0.5,faulty:0.5"):
        config.env.mixture = mixture
        assert build.env_service(config) == "pool", mixture
    config.env.service = "inprocess"
    assert build.env_service(config) == "inprocess"  # an explicit choice stands
    config.env.service, config.env.mixture = "auto", ""
    original = envs.api._REGISTRY["calculator"]
    try:  # a project that registers 'calculator' again with its own factory gets worker processes
        envs.api.register("calculator", lambda **kw: original.factory(**kw), expert=original.expert, overwrite=True)
        assert build.env_service(config) == "pool"
    finally:
        envs.api._REGISTRY["calculator"] = original
    assert build.env_service(config) == "inprocess"
    environments = build.Environments(config)
    try:  # in process, no service; a pure environment steps on the event loop, no thread per step
        assert environments.service is None and environments.service_name == "inprocess"
        task = environments.environments["calculator"].sample_task(0, 1)
        assert environments.make_env(task).executor is None
    finally:
        environments.close()
    config.env.service, config.env.imports, config.env.name = "inprocess", "tests.fixtures.faulty_envs", "calc_hang"
    environments = build.Environments(config)
    try:  # any other environment in process keeps its thread and watchdog
        env = environments.make_env(environments.environments["calc_hang"].sample_task(0, 1))
        assert env.executor is not None and env.step_timeout_s == config.env.step_timeout_s
    finally:
        environments.close()


def test_a_pool_worker_dying_mid_episode_ends_only_that_episode(tmp_path):
    config = _rl_only(tiny_config(tmp_path))
    config.env.imports = "tests.fixtures.faulty_envs"
    config.env.name = "calc_crash"
    config.env.service = "pool"
    config.env.pool_workers = 2
    config.env.step_timeout_s = 20.0
    config.rollout.prompts_per_iteration = 4  # seed 0 of each iteration's stream crashes its worker
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert rl[0]["finish_reasons"].get("env_crash", 0) >= 1
    assert rl[-1]["env_service/worker_restarts"] >= 1 and rl[-1]["env_service/env_crash"] >= 1
    assert next(r for r in records if r["stage"] == "start")["env_service"] == "pool"
    assert all(sum(r["finish_reasons"].values()) == 8 for r in rl)
    assert [r for r in records if r["stage"] == "summary"]


def test_the_default_config_on_remote_env_servers(tmp_path):
    servers = [subprocess.Popen([sys.executable, str(ROOT / "launch" / "env_server.py"), "--port", "0",
                                 "--workers", "1"], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(2)]
    try:
        addresses = [s.stdout.readline().split()[-1] for s in servers]
        config = _rl_only(tiny_config(tmp_path))
        # A third address has no server: episodes fail over to the two that answer.
        config.env.service = ",".join(addresses + ["127.0.0.1:9"])
        records = _records(trainer.train_and_evaluate(config, quiet=True))
        rl = [r for r in records if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [1, 2] and all(r["rollouts"] == 6 for r in rl)
        assert "env_reset_error" not in rl[0]["finish_reasons"]
        assert rl[-1]["env_service/failovers"] >= 1
    finally:
        for s in servers:
            s.kill()


# ------------------------------------------------------------------------------ a user project
@pytest.mark.slow  # a launcher subprocess (~15 s warm, more on a cold cache); CI's slow pass runs it
def test_a_user_project_trains_through_the_launcher(tmp_path):
    """tests/fixtures/user_project: its own environment, objective and reward, no edit to jaxrl_agent/."""
    overrides = {"workdir": str(tmp_path), "sft.steps": 20, "sft.batch_size": 8, "sft.log_every": 10,
                 "rl.iterations": 2, "eval.every": 100, "eval.tasks_per_difficulty": 4, "eval.pass_k": 0,
                 "metrics.tensorboard": False, "model.num_layers": 1, "model.hidden_size": 32,
                 "model.intermediate_size": 64, "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
                 "rollout.prompts_per_iteration": 4, "rollout.group_size": 2, "sampler.max_concurrent_decodes": 8,
                 "sft.num_demonstrations": 32, "env.service": "pool", "env.pool_workers": 1}
    command = [sys.executable, str(ROOT / "launch" / "tpu_run.py"), "--config", str(USER_PROJECT / "config.py")]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(USER_PROJECT), str(ROOT)])})
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path / "metrics.jsonl")
    start = next(r for r in records if r["stage"] == "start")
    assert start["objective"] == "reverse_ppo" and start["environments"] == "reverse"
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for record in rl:
        assert "reward/first_letter" in record and "sampled_entropy/reverse" in record
        # reward = correctness + first_letter (0.5 x correctness) + 0.1 x format
        assert record["reward"] == pytest.approx(record["reward/correctness"] * 1.5 + 0.1 * record["reward/format"],
                                                 abs=1e-6)
        if record["trained_trajectories"]:
            assert "length/mean_length" in record and "ppo_clip/loss" in record
    assert any(r["stage"] == "summary" for r in records)


# ------------------------------------------------------------------------------ data
def test_sft_from_a_demonstrations_file_on_an_environment_without_an_expert(tmp_path):
    from tests.fixtures import no_expert_env  # noqa: F401 - registers calc_no_expert
    from tests.test_data import _chat_record

    env = no_expert_env.CalculatorWithoutExpert()
    demos = [_chat_record(env.sample_task(5000 + i, 1)) for i in range(16)]
    path = str(tmp_path / "demos.jsonl")
    from jaxrl_agent import data

    data.write_jsonl(path, demos)
    with open(path, "a") as f:
        f.write("garbage\n")
    config = _rl_only(tiny_config(tmp_path / "run"), iterations=1)
    config.env.imports = "tests.fixtures.no_expert_env"
    config.env.name = "calc_no_expert"
    with pytest.raises(build.ConfigError, match="has no scripted expert; give data.demonstrations"):
        config.sft.steps = 6
        build.validate_config(config)
    config.data.demonstrations = path
    config.sft.warmup_steps = 1
    config.sft.log_every = 1
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    (info,) = [r for r in records if r["stage"] == "data"]
    assert info["demonstration_records"] == 16 and info["skipped_records"] == {"not_json": 1}
    sft = [r for r in records if r["stage"] == "sft"]
    assert [r["step"] for r in sft] == list(range(1, 7)) and sft[-1]["loss"] < sft[0]["loss"]
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1]


def test_a_frozen_policy_judge_and_reward_weights_from_the_config(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=1)
    config.reward.judge = "policy"
    config.reward.judge_rubric = "1. correct"  # short: the character tokenizer spends a token per letter
    config.reward.judge_max_tokens = 8
    config.reward.weights = "correctness:1,judge:0.5,turns:0.01"
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    (rl,) = [r for r in records if r["stage"] == "rl"]
    # An untrained judge rarely writes 'SCORE: n': its failures are counted, not fatal.
    assert rl["judge/failures"] + (rl["judge/score_mean"] > 0) >= 1 and "judge/length_bias" in rl
    assert rl["reward"] == pytest.approx(rl["reward/correctness"] + 0.5 * rl["reward/judge"]
                                         + 0.01 * rl["reward/turns"], abs=1e-6)
    assert rl["reward/judge_failed"] == pytest.approx(rl["judge/failures"] / rl["rollouts"])
    config.reward.weights = "correctness:1,speed:2"
    with pytest.raises(build.ConfigError, match=r"no component named \['speed'\]"):
        build.validate_config(config)


def test_the_judges_engine_decodes_with_the_options_chosen_for_the_host(tmp_path):
    config = tiny_config(tmp_path)
    config.reward.judge = "policy"
    config.sampler.decode_options = "small_batch,xla_defaults"
    tok = build.build_tokenizer(config)
    model_config, params = build.build_model(config)
    judge = build.build_judge(config, model_config, params, tok, build.build_template(config))
    choice = judge.sampler.engine.decode_choice
    assert (choice.large, choice.small, choice.source) == ("small_batch", "xla_defaults", "config")


def _saved_like_the_policy(config, folder, seed):
    """A Hugging Face folder holding a random model of the policy's shapes (another init seed)."""
    model_config = models.ModelConfig.from_config_dict(config.model)
    models.save_hf(str(folder), model_config, models.init_params(model_config, jax.random.PRNGKey(seed)))
    return str(folder)


@pytest.mark.slow
def test_a_reference_and_a_judge_from_hugging_face_folders(tmp_path):
    config = _rl_only(tiny_config(tmp_path / "initial"), iterations=1)
    config.rl.kl_coef = 0.05
    (initial,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    config = _rl_only(tiny_config(tmp_path / "folder"), iterations=1)
    config.rl.kl_coef = 0.05
    config.rl.reference = _saved_like_the_policy(config, tmp_path / "reference", seed=11)
    config.reward.judge = _saved_like_the_policy(config, tmp_path / "judge", seed=12)
    config.reward.judge_rubric = "1. correct"
    config.reward.judge_max_tokens = 8
    (folder,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    # The initial weights are the policy itself (the learning rate warms up from 0: KL 0 at the
    # first updates); another model is not.
    assert abs(initial["kl_k3/mean"]) < 1e-4 and folder["kl_k3/mean"] > 1e-3
    assert folder["judge/failures"] + (folder["judge/score_mean"] > 0) >= 1 and "reward/judge" in folder


@pytest.mark.slow
def test_resume_keeps_the_frozen_reference_and_judge(tmp_path):
    import orbax.checkpoint as ocp

    from jaxrl_agent import checkpoint

    config = _rl_only(tiny_config(tmp_path), iterations=1)
    config.sft.steps = 2
    config.checkpoint.every = 1
    config.rl.kl_coef = 0.05
    config.reward.judge = "policy"
    config.reward.judge_rubric = "1. correct"
    config.reward.judge_max_tokens = 8
    trainer.train_and_evaluate(config, quiet=True)
    saved = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), 2)
    arrays = saved.manager.restore(saved.manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(None)))["state"]
    saved.close()
    # Both are the weights RL started from (after SFT), not the weights trained since.
    leaves = lambda name: jax.tree.leaves(arrays[name])
    assert all(np.array_equal(a, b) for a, b in zip(leaves("judge_params"), leaves("ref_params")))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves("judge_params"), leaves("params")))
    config.resume = True
    config.rl.iterations = 2
    records = _records(trainer.train_and_evaluate(config, quiet=True))
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    # Regularised against the restored post-SFT weights: two small updates away (a fresh random
    # reference would be ~1e-2 away, as the Hugging Face folder test shows).
    assert rl[-1]["kl_k3/mean"] < 1e-3 and "judge/failures" in rl[-1]


def test_a_compact_console_line_per_iteration_and_a_used_workdir_is_refused(tmp_path, capsys):
    config = _rl_only(tiny_config(tmp_path), iterations=2)
    path = trainer.train_and_evaluate(config)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rl ")]
    assert [line.split("]")[0] for line in lines] == ["[rl 1/2", "[rl 2/2"]
    assert all(len(line) < 160 and "success=" in line and "eta=" in line for line in lines)
    # The file still has the whole record (every objective metric among them).
    rl = [r for r in _records(path) if r["stage"] == "rl"]
    assert len(rl) == 2 and all(len(r) > 40 and "mirror_descent/loss" in r for r in rl if r["trained_trajectories"])
    written = len(_records(path))
    with pytest.raises(build.ConfigError, match=r"already holds a run \(metrics.jsonl, checkpoints\): pass "
                                                r"--config.resume=True to continue it, or choose another"):
        trainer.train_and_evaluate(config, quiet=True)
    assert len(_records(path)) == written  # nothing appended


def test_env_kwargs_reach_the_environments_in_the_pool(tmp_path):
    config = _rl_only(tiny_config(tmp_path), iterations=1)
    config.env.kwargs = '{"max_turns": 1}'  # the calculator's own limit (the default is 4)
    (rl,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    # efficiency = -turns / max_turns: every episode that reached its first step used its one turn.
    stepped = rl["rollouts"] - rl["finish_reasons"].get("context_limit", 0)
    assert stepped > 0 and rl["reward/efficiency"] * rl["rollouts"] == pytest.approx(-stepped)
    assert set(rl["finish_reasons"]) <= {"answer", "max_turns", "context_limit"}


def test_episode_settings_carry_the_rollout_sampling_and_format_keys(tmp_path):
    config = tiny_config(tmp_path)
    config.rollout.top_k, config.rollout.top_p, config.rollout.max_think_tokens = 20, 0.95, 64
    settings = build.episode_settings(config, 0.7)
    assert (settings.sampling.temperature, settings.sampling.top_k, settings.sampling.top_p) == (0.7, 20, 0.95)
    assert settings.max_think_tokens == 64 and settings.tool_format == "env"
    assert settings.sampling.max_tokens == config.rollout.max_tokens_per_turn


def test_distillation_from_the_config_distils_against_the_weights_rl_starts_from(tmp_path):
    """rl.distill_coef adds the distillation term (its own loss term in the records); the teacher is
    a frozen copy of the weights RL starts from (after SFT), checkpointed; a Hugging Face folder of
    another model is a teacher too, and far from the policy."""
    import orbax.checkpoint as ocp

    from jaxrl_agent import checkpoint

    config = _rl_only(tiny_config(tmp_path / "initial"), iterations=2)
    config.sft.steps, config.checkpoint.every, config.checkpoint.keep = 2, 1, 5
    config.rl.distill_coef = 0.5
    # Rewards that differ within every group: the policy term updates the weights at both iterations
    # (the distillation term's gradient is zero at the teacher), whatever the untrained policy samples.
    rl = [r for r in _records(trainer.train_and_evaluate(config, quiet=True, reward_fn=_scrambled_reward))
          if r["stage"] == "rl"]
    assert all(r["trained_trajectories"] > 0 for r in rl)
    assert all(r["distill/loss"] == pytest.approx(0.5 * r["distill/kl_k3"], rel=1e-5) for r in rl)
    assert all(0.0 <= r["distill/kl_k3"] < 1e-3 for r in rl)  # a few small steps from the teacher
    saved = checkpoint.Checkpointer(str(tmp_path / "initial" / "checkpoints"), 2)
    arrays = saved.manager.restore(saved.manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(None)))["state"]
    saved.close()
    sft = checkpoint.Checkpointer(str(tmp_path / "initial" / "checkpoints"), 2)
    sft_params = sft.manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(None)))["state"]["params"]
    sft.close()
    leaves = jax.tree.leaves
    assert all(np.array_equal(a, b) for a, b in zip(leaves(arrays["teacher_params"]), leaves(sft_params)))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(arrays["teacher_params"]), leaves(arrays["params"])))
    config = _rl_only(tiny_config(tmp_path / "folder"), iterations=1)
    config.rl.distill_coef = 0.5
    config.rl.teacher = _saved_like_the_policy(config, tmp_path / "teacher", seed=13)
    (folder,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    # Two random initialisations differ by ~1e-2 nats a token here (0.0099 to over 0.01 by the episodes
    # sampled, whose timing varies): well above the < 1e-3 of the policy's own starting weights.
    assert folder["distill/kl_k3"] > 3e-3
    config.rl.teacher = str(tmp_path / "missing")
    with pytest.raises(build.ConfigError, match="rl.teacher=.*expected 'initial' or a Hugging Face model folder"):
        build.validate_config(config)


def test_distillation_on_an_earlier_stages_environment_alone(tmp_path):
    """rl.distill_envs: chain's episodes are trained by the distillation term alone (all kept, at
    advantage 0), calculator's by their rewards; the term covers chain's tokens only. With
    distill_coef 0 chain's episodes are sampled and not trained."""
    config = _rl_only(tiny_config(tmp_path / "distilled"), iterations=1)
    config.env.mixture = "calculator:1,chain:1"
    config.env.train_difficulties = config.env.eval_difficulties = "1"
    config.rollout.prompts_per_iteration = 4
    config.rl.distill_coef = 0.5
    config.rl.distill_envs = "chain"
    config.rl.teacher = _saved_like_the_policy(config, tmp_path / "teacher", seed=13)  # far from the policy
    (rl,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    chain_groups = rl["distill_only_groups"]
    assert chain_groups >= 1 and rl["groups"] + chain_groups == 4  # the signal counts calculator's only
    assert rl["trained_trajectories"] >= chain_groups * config.rollout.group_size  # every chain episode trained
    # Two random inits of this tiny model are ~0.01 apart on sampled tokens (0.0099-0.012 seen, by
    # the episodes drawn); a teacher equal to the policy's start stays below 1e-3 (the test above).
    assert rl["distill/kl_k3"] > 3e-3 and rl["distill/loss"] == pytest.approx(0.5 * rl["distill/kl_k3"], rel=1e-4)
    # Without distillation its episodes are sampled (their outcomes recorded), and not trained.
    config.rl.distill_coef = 0.0
    config.workdir = str(tmp_path / "plain")
    (plain,) = [r for r in _records(trainer.train_and_evaluate(config, quiet=True)) if r["stage"] == "rl"]
    assert plain["distill_only_groups"] >= 1 and "distill/loss" not in plain
    assert plain["trained_trajectories"] <= plain["groups"] * config.rollout.group_size
    for value, coef, message in (("kb_search", 0.5, r"rl.distill_envs='kb_search': expected environments of the "
                                                    r"mixture \['calculator', 'chain'\]"),
                                 ("chain,calculator", 0.5, r"covers every environment of the mixture")):
        config.rl.distill_envs, config.rl.distill_coef = value, coef
        with pytest.raises(build.ConfigError, match=message):
            build.validate_config(config)
