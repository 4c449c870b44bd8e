"""The closed loop end to end on a tiny configuration (a few steps; learning itself is shown by the
launcher's default run, recorded in benchmarks/RESULTS.md)."""

import glob
import json
import math
import pathlib
import re

import jax
import pytest

from jaxrl_agent import build, checkpoint, config_lib, plot, run_schedule, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(workdir):
    config = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
    overrides = {
        "model.num_layers": 1, "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.head_dim": 16, "sampler.max_concurrent_decodes": 8,
        "sampler.max_prefill_length": 256, "sampler.max_cache_length": 256, "rollout.prompts_per_iteration": 3,
        "rollout.group_size": 2, "rollout.max_tokens_per_turn": 48, "rollout.max_context": 200,
        "sft.difficulties": "1", "eval.pass_k": 2,
        "rollout.drop_zero_advantage_groups": False, "sft.steps": 3, "sft.batch_size": 4, "sft.log_every": 1,
        "rl.iterations": 2, "eval.every": 1, "eval.tasks_per_difficulty": 2, "learner.row_length": 256,
        "env.eval_difficulties": "1,4", "workdir": str(workdir),
        "learner.target_multiple": 16,  # the real-model configs' path: logits at trained positions only
        "sampler.decode_options": "builtin",  # nothing measured per test (tests/sampling/test_host_tuning.py does)
    }
    for key, value in overrides.items():
        *sections, field = key.split(".")
        node = config
        for s in sections:
            node = node[s]
        node[field] = value
    return config


def test_sft_then_rl_runs_and_reports_every_stage(tmp_path):
    config = tiny_config(tmp_path)
    config.invariants.distinct_solutions_floor = 100.0  # always "collapsed": the guard must fire
    path = trainer.train_and_evaluate(config, quiet=True)
    records = [json.loads(line) for line in open(path)]
    stages = [r["stage"] for r in records]
    # eval.initial='auto': random weights with SFT first are not evaluated; the SFT eval is the baseline.
    assert stages[:2] == ["start", "sft"] and "initial_eval" not in stages
    assert records[0]["decode_options"] == "large=fast_minmax small=small_batch (builtin)"
    assert records[0]["sampler_engines"] == str(build.local_engine_count(config))  # the auto choice, logged
    assert records[0]["env_service"] == "inprocess (auto)"  # env.service='auto' with calculator, logged
    assert stages.count("sft") == 3 and "sft_eval" in stages
    assert stages.count("rl") == 2 and stages.count("rl_eval") == 2
    rl = [r for r in records if r["stage"] == "rl"]
    for record in rl:
        assert record["trained_trajectories"] == 6 and record["generated_tokens"] > 0
        assert 0.0 <= record["nonzero_advantage_group_share"] <= 1.0
        assert math.isfinite(record["loss"]) and math.isfinite(record["drift/sampler_abs_diff_max"])
        # On-policy, and the metric is from the last of two minibatches, after one small update.
        assert record["drift/sampler_abs_diff_max"] < 0.05
        assert record["policy_lag_max"] == 0
        # Train/serve gap measured apart from learning: same parameters as the sampler, numerics only
        # (the sampler test's tolerance); the policy's movement over the updates reported separately.
        assert record["invariants/drift/serve_gap_tokens"] > 0
        assert record["invariants/drift/serve_gap_max"] <= 1e-5
        assert record["invariants/drift/policy_kl"] > 0
        # The three invariants' figures on every iteration (on-policy: no lag).
        assert record["invariants/exploration/entropy_min"] == record["sampled_entropy/calculator"]
        assert record["invariants/exploration/pass_gap"] == pytest.approx(record["pass@2"] - record["success"])
        assert 0.0 <= record["invariants/exploration/identical_group_share"] <= 1.0
        assert record["invariants/signal/nonzero_share"] == record["nonzero_advantage_group_share"]
        assert record["invariants/signal/all_correct"] + record["invariants/signal/all_wrong"] <= 1.0
        assert record["invariants/drift/lag_max"] == 0.0
    evals = [r for r in records if r["stage"].endswith("eval")]
    assert all({"eval/pass@1/d1", "eval/pass@1/d4", "eval/success", "eval/pass@2/d4"} <= set(r) for r in evals)
    assert all(r["eval/pass@2/d1"] >= r["eval/sampled_pass@1/d1"] for r in evals)
    for r in evals:  # greedy (deployed) against sampled (trained) success on the same tasks
        gaps = [r[f"eval/pass@1/d{d}"] - r[f"eval/sampled_pass@1/d{d}"] for d in (1, 4)]
        assert r["eval/deploy_gap"] == pytest.approx(sum(gaps) / 2)
    for record in rl:  # exploration and throughput figures on every iteration
        assert record["pass@2"] >= record["success"] - 1e-9
        # Mean distinct tool-call sequences per task over 3 groups of 2: a multiple of 1/3 in [1, 2]
        # (averaging over episodes instead of tasks, or counting per episode, would break this).
        clusters_total = record["distinct_solutions"] * record["groups"]
        assert record["groups"] == 3 and abs(clusters_total - round(clusters_total)) < 1e-9
        assert 3 <= round(clusters_total) <= 6
        assert record["sampled_entropy/calculator"] > 0 and record["trained_tokens"] > 0
        assert record["guard/solution_collapse"] == 1.0 and "guard/entropy_collapse" not in record
        # Multi-turn episodes: later turns continue cached prefixes instead of prefilling the history.
        assert record["sampler_prefill_tokens"] > 0 and record["sampler_reused_tokens"] > 0
        assert 0 < record["sampler_live_per_call"] <= record["sampler_rows_per_call"]
        assert record["sampler_decode_seconds"] > 0 and record["sampler_generate_calls"] > 0
    # Demonstrations only from sft.difficulties; RL tasks from env.train_difficulties.
    sft_eval = next(r for r in records if r["stage"] == "sft_eval")
    assert sft_eval["step"] == 3
    # The run ends with its headline: held-out success after SFT and at the end, and the gain.
    summary = records[-1]
    assert summary["stage"] == "summary" and stages.count("summary") == 1
    assert summary["after_sft/success"] == sft_eval["eval/success"]
    assert summary["final/pass@1/d4"] == evals[-1]["eval/pass@1/d4"]
    assert summary["gain_points"] == pytest.approx(100 * (evals[-1]["eval/success"] - sft_eval["eval/success"]))

    # TensorBoard scalars carry the same numbers as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(events[0])
    accumulator.Reload()
    scalars = {(tag, e.step): e.value for tag in accumulator.Tags()["scalars"] for e in accumulator.Scalars(tag)}
    last = rl[-1]
    assert last["global_step"] == config.sft.steps + last["step"]
    assert scalars[("rl/loss", last["global_step"])] == pytest.approx(last["loss"], rel=1e-6)
    assert ("rl/finish_reasons/" + next(iter(last["finish_reasons"])), last["global_step"]) in scalars
    # Held-out success is one curve from the first evaluation to the last, on one step axis:
    # after SFT (sft.steps) and during RL (sft.steps + iteration); eval.initial adds step 0.
    curve = sorted((e.step, e.value) for e in accumulator.Scalars("eval/success"))
    assert curve == [(r["global_step"], pytest.approx(r["eval/success"])) for r in evals]
    assert [step for step, _ in curve] == [3, 4, 5]
    assert not any(tag.startswith(("sft_eval/", "rl_eval/", "initial_eval/")) for tag in accumulator.Tags()["scalars"])
    # The resolved config (overrides applied) is in the workdir, and its hyper-parameters in TensorBoard.
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["hidden_size"] == 32 and saved["rl"]["iterations"] == 2
    from tensorboard.plugins.hparams import plugin_data_pb2

    start_info = plugin_data_pb2.HParamsPluginData.FromString(
        accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start_info.hparams["model.hidden_size"].number_value == 32
    assert start_info.hparams["rl.objective"].string_value == saved["rl"]["objective"]

    # The plot command writes a PNG of the curves.
    png = plot.plot(str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # ... and the invariants page, whose panels read the records' invariants/* figures.
    assert open(tmp_path / "invariants.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    records = plot.load_records(str(tmp_path))
    drawn = [(stages, key) for _, lines in plot.invariant_panels(records) for stages, key, _ in lines]
    assert all(plot.series(records, stages, key)[0] for stages, key in drawn), drawn


@pytest.mark.parametrize("rows_per_update,microbatches", [(-1, 0), (8, 0), (-1, 16)])
def test_sft_updates_of_fixed_rows_compile_one_shape(tmp_path, monkeypatch, rows_per_update, microbatches):
    """sft.rows_per_update: every SFT update packs the same number of rows (-1: measured and
    recorded at the start), the demonstrations first fit in the order drawn; the SFT step
    accumulates over sft.microbatches parts, which the rows are a multiple of."""
    from jaxrl_agent import learner, replay

    config = tiny_config(tmp_path)
    config.sft.rows_per_update, config.sft.steps, config.rl.iterations = rows_per_update, 4, 0
    config.sft.microbatches = microbatches
    config.metrics.tensorboard = False
    shapes, original = [], replay.pack
    steps, make_step = [], learner.make_train_step

    def pack(trajectories, row_length, **kwargs):
        batch, rows = original(trajectories, row_length, **kwargs)
        shapes.append((batch.tokens.shape, kwargs.get("decreasing", True), len(trajectories)))
        return batch, rows

    def make_train_step(*args, **kwargs):
        steps.append((kwargs.get("sft"), kwargs.get("microbatches")))
        return make_step(*args, **kwargs)

    monkeypatch.setattr(trainer.replay, "pack", pack)
    monkeypatch.setattr(learner, "make_train_step", make_train_step)
    path = trainer.train_and_evaluate(config, quiet=True)
    records = [json.loads(line) for line in open(path)]
    rows = next(r for r in records if r["stage"] == "data")["sft_rows_per_update"]
    # -1: four demonstrations fill at most 4 rows of 256; rounded to the nearest multiple of the
    # learner's row multiple (4, the mesh's batch axes: every device, and the SFT microbatches),
    # at least one multiple.
    multiple = math.lcm(4, jax.device_count(), microbatches or 1)
    assert steps == [(True, microbatches or 1)]  # 0: learner.microbatches
    assert rows == (8 if rows_per_update == 8 else multiple)
    assert [s[:2] for s in shapes] == [((rows, 256), False)] * 4
    assert sum(s[2] for s in shapes) > 4 and [r["step"] for r in records if r["stage"] == "sft"] == [1, 2, 3, 4]


def test_rl_rows_split_into_the_learner_microbatches(tmp_path):
    """learner.microbatches that the configured row multiples do not hold (3 against 4, 8 and the
    mesh's devices): RL's rows are padded to a multiple of it too, and the iteration trains."""
    config = tiny_config(tmp_path)
    config.learner.microbatches, config.sft.steps, config.rl.iterations, config.eval.every = 3, 1, 1, 0
    config.metrics.tensorboard = False
    path = trainer.train_and_evaluate(config, quiet=True)
    records = [json.loads(line) for line in open(path)]
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(rl) == 1 and rl[0]["trained_tokens"] > 0 and math.isfinite(rl[0]["loss"])


@pytest.mark.slow
def test_resume_continues_the_same_schedule(tmp_path):
    config = tiny_config(tmp_path)
    config.checkpoint.every = 1
    trainer.train_and_evaluate(config, quiet=True)
    first = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    saved_version = [r for r in first if r["stage"] == "rl"][-1]
    config.resume = True
    config.rl.iterations = 3
    trainer.train_and_evaluate(config, quiet=True)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][len(first):]
    stages = [r["stage"] for r in records]
    assert "sft" not in stages and "initial_eval" not in stages
    resume = next(r for r in records if r["stage"] == "resume")
    assert resume["step"] == 2 and resume["from_stage"] == "rl"
    assert [r["step"] for r in records if r["stage"] == "rl"] == [3]
    rl3 = next(r for r in records if r["stage"] == "rl")
    assert rl3["policy_lag_max"] == 0 and rl3["drift/sampler_abs_diff_max"] < 0.05
    assert saved_version["trained_trajectories"] == 6


@pytest.mark.slow
def test_rl_with_two_jetstream_sampler_server_processes(tmp_path, monkeypatch):
    """The loop with `sampler.num_servers=2`: episodes sampled by two JetStream server processes,
    weights pushed over gRPC after every update, log-probs matching the learner's."""
    config = tiny_config(tmp_path)
    config.sampler.num_servers = 2
    config.sampler.server_devices = "0;1"  # each server pinned to its own (here: harmless) GPU index
    config.sft.steps = 2
    config.eval.pass_k = 0
    config.metrics.tensorboard = False
    pinned = []
    original_wait_ready = build.SamplerServers._wait_ready

    def wait_ready(self, process):
        # Read the environment once the server says it listens: just after Popen returns, the
        # kernel may not have set the new image's environment yet (/proc/PID/environ reads empty).
        address = original_wait_ready(self, process)
        environ = dict(kv.split("=", 1) for kv in open(f"/proc/{process.pid}/environ").read().split("\0") if "=" in kv)
        pinned.append(environ.get("CUDA_VISIBLE_DEVICES"))
        return address

    monkeypatch.setattr(build.SamplerServers, "_wait_ready", wait_ready)
    path = trainer.train_and_evaluate(config, quiet=True)
    assert pinned == ["0", "1"]
    records = [json.loads(line) for line in open(path)]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for record in rl:
        assert record["trained_trajectories"] == 6 and record["generated_tokens"] > 0
        # Every trained token was sampled by the weights just pushed to the servers.
        assert record["policy_lag_max"] == 0
        assert record["drift/sampler_abs_diff_max"] < 0.05
        # The servers' own counters (over Info), summed over both.
        assert record["sampler_generate_calls"] > 0 and record["sampler_decode_seconds"] > 0
        assert 0 < record["sampler_live_per_call"] <= record["sampler_rows_per_call"]
        assert record["sampler_prefill_tokens"] > 0
    assert (tmp_path / "sampler_config.py").exists()


@pytest.mark.parametrize("schedule,extra", [
    ("windowed_fifo", {"rollout.window": 2}),
    ("async", {"rollout.max_staleness": 0, "rollout.stale_policy": "mask"}),
])
def test_asynchronous_schedules_with_partial_rollouts(tmp_path, schedule, extra):
    config = tiny_config(tmp_path)
    config.rollout.schedule = schedule
    config.rollout.token_budget = 8  # episodes need several iterations: partial rollouts
    config.rollout.max_tokens_per_turn = 12  # and at most 3 of them (2 turns of <= 12 tokens)
    config.rollout.max_turns = 2
    config.rl.iterations = 4
    config.sft.steps = 1
    config.eval.every = 100
    config.eval.pass_k = 0
    config.metrics.tensorboard = False
    for key, value in extra.items():
        section, field = key.split(".")
        config[section][field] = value
    path = trainer.train_and_evaluate(config, quiet=True)
    rl = [json.loads(line) for line in open(path) if '"stage": "rl"' in line]
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert sum(r["trained_trajectories"] for r in rl) > 0
    assert max(r["suspended_episodes"] for r in rl) > 0  # budgets cut episodes
    # The groups just taken are refilled before the update: P + ahead (3 + 3) stay open through it.
    assert all(r["groups_pending"] == 6 for r in rl), [r["groups_pending"] for r in rl]
    if schedule == "async":
        assert all(r["policy_lag_max"] == 0 for r in rl)  # S = 0, stale tokens masked
    else:
        assert max(r["policy_lag_max"] for r in rl) >= 1  # resumed episodes carry older tokens


@pytest.mark.slow
def test_real_model_config_end_to_end_on_a_tiny_random_checkpoint(tmp_path):
    """configs/qwen3_0_6b_agentic.py with a tiny random Qwen3 saved as a Hugging Face folder (config.json,
    safetensors) with Qwen's real vocabulary and a Qwen3-style chat template: the model's own
    template, Qwen3's tool format, system prompt, SFT then RL, a few steps; then the export. (The
    config's float32 master weights are a no-op on these float32 parameters.)"""
    import jax

    from jaxrl_agent import models
    from tests import real_vocab

    checkpoint = tmp_path / "qwen3_tiny"
    checkpoint.mkdir()
    tiny = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=151936, num_layers=1, hidden_size=16,
                              intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8)
    models.save_hf(str(checkpoint), tiny, models.init_params(tiny, jax.random.PRNGKey(0)))
    real_vocab.qwen3_folder(str(checkpoint))
    config = config_lib.load_config(str(ROOT / "configs" / "qwen3_0_6b_agentic.py"))
    config.checkpoint.hf_path = str(checkpoint)
    config.checkpoint.param_dtype = config.checkpoint.compute_dtype = "float32"
    for section, key, value in [("sampler", "max_concurrent_decodes", 8), ("sft", "steps", 2), ("sft", "batch_size", 4),
                                ("sft", "num_demonstrations", 8), ("rl", "iterations", 2), ("rollout", "prompts_per_iteration", 2),
                                ("rollout", "group_size", 2), ("rollout", "max_tokens_per_turn", 16),
                                ("rollout", "token_budget", 8), ("eval", "tasks_per_difficulty", 1), ("eval", "every", 2),
                                ("env", "eval_difficulties", "1"), ("learner", "microbatches", 1),
                                ("metrics", "tensorboard", False), ("workdir", None, str(tmp_path / "run"))]:
        if key is None:
            config[section] = value
        else:
            config[section][key] = value
    records = [json.loads(line) for line in open(trainer.train_and_evaluate(config, quiet=True))]
    stages = [r["stage"] for r in records]
    assert "sft_eval" in stages and stages.count("rl") == 2 and "rl_eval" in stages
    # The run's episodes are rendered in the model's own format: Qwen3's tools block and tool responses.
    from jaxrl_agent import build, chat_template, envs, rollout, tokenizer as tokenizer_lib

    template = build.build_template(config)
    assert isinstance(template, chat_template.ChatTemplate) and config.tokenizer.tool_format == "qwen3"
    env = envs.make("calculator")
    tok = tokenizer_lib.HFTokenizer.from_file(str(checkpoint))
    demo = rollout.expert_trajectory(env, env.sample_task(0, 1), envs.expert_policy("calculator"), tok, template,
                                     include_system_prompt=True, tool_format="qwen3")
    assert "<tools>" in tok.decode(demo.tokens) and "<tool_response>" in tok.decode(demo.tokens)
    # Export: launch/export_hf.py from the workdir alone; transformers loads it with our logits and
    # our sampler's greedy tokens, with the tokenizer files and the chat template alongside.
    # (transformers runs in a process of its own: torch and this process's JAX runtime, sampler
    # thread included, are kept apart.)
    import subprocess
    import sys

    import numpy as np

    from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "export_hf.py"), f"--workdir={tmp_path / 'run'}",
                           f"--out={out}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported checkpoint step" in done.stdout
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    prompt = demo.tokens[:48].astype(np.int64)
    np.save(tmp_path / "prompt.npy", prompt)
    reference = ("import sys, numpy as np, torch, transformers\n"
                 "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
                 "p = torch.as_tensor(np.load(sys.argv[2])[None])\n"
                 "with torch.no_grad():\n"
                 "    logits = m(input_ids=p).logits[0].float().numpy()\n"
                 "    greedy = m.generate(p, max_new_tokens=8, do_sample=False, eos_token_id=None,"
                 " pad_token_id=0)[0, p.shape[1]:].numpy()\n"
                 "np.savez(sys.argv[3], logits=logits, greedy=greedy)\n")
    done = subprocess.run([sys.executable, "-c", reference, str(out), str(tmp_path / "prompt.npy"),
                           str(tmp_path / "hf.npz")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    hf = np.load(tmp_path / "hf.npz")
    ours_config, ours = models.load_hf(str(out))
    np.testing.assert_allclose(hf["logits"], np.asarray(models.forward(ours_config, ours,
                                                                       prompt[None].astype(np.int32)))[0],
                               atol=1e-4, rtol=0)
    engine = AgentEngine(ours_config, ours, tok, max_concurrent_decodes=1, max_prefill_length=64,
                         max_cache_length=64, steps_per_call=4, stop_token_ids=[])
    with LocalSampler(engine) as sampler:
        (completion,) = sampler.generate_many([prompt.tolist()], SamplingParams(temperature=0.0, max_tokens=8))
    assert list(completion.token_ids) == hf["greedy"].tolist()
    exported_template = chat_template.ChatTemplate.from_folder(str(out))
    assert exported_template.source == template.source
    # Qwen3 with thinking off drops earlier replies' empty think blocks when it re-renders: the run says so,
    # and re-renders each turn (a new learner sequence at each rewrite), its SFT data as well.
    start = next(r for r in records if r["stage"] == "start")
    assert "<think>" in start["template_rewrites_history"] and start["history"] == "template"
    assert len(demo.segments) == 2  # the tool call, then the answer in a re-rendered context
    assert next(r for r in records if r["stage"] == "start")["params"] == models.count_params(
        models.init_params(tiny, jax.random.PRNGKey(0)))


def _early_stop_config(tmp_path, checkpoint_every: int):
    """50 RL iterations planned, evaluations only at the end (a period of 0; so is SFT's logging):
    a stopping rule must end RL early with its own checkpoint and evaluation."""
    config = tiny_config(tmp_path)
    config.rl.iterations = 50
    config.checkpoint.every = checkpoint_every
    config.eval.every = 0
    config.sft.log_every = 0
    config.eval.pass_k = 0
    config.sft.steps = 1
    config.metrics.tensorboard = False
    return config


def test_stop_after_trained_tokens_ends_with_a_checkpoint_and_an_evaluation(tmp_path):
    # checkpoint.every=1: the iteration's own checkpoint must not be written twice.
    config = _early_stop_config(tmp_path, checkpoint_every=1)
    config.rl.stop_after_trained_tokens = 1  # reached at the first iteration
    records = [json.loads(line) for line in open(trainer.train_and_evaluate(config, quiet=True))]
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1]
    assert [r["step"] for r in records if r["stage"] == "rl_eval"] == [1]


@pytest.mark.slow
def test_time_budget_ends_rl_at_an_iteration_boundary_with_a_checkpoint_and_an_evaluation(tmp_path):
    config = _early_stop_config(tmp_path, checkpoint_every=0)  # 0: only at the end
    # Already spent by the time RL starts (the initial and post-SFT evaluations take longer).
    config.rl.time_budget_minutes = 1e-4
    records = [json.loads(line) for line in open(trainer.train_and_evaluate(config, quiet=True))]
    assert [r["step"] for r in records if r["stage"] == "sft"] == [config.sft.steps]  # log_every 0: at the end
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1]
    assert [r["step"] for r in records if r["stage"] == "rl_eval"] == [1]
    (end,) = [r for r in records if r["stage"] == "rl_end"]
    assert end["reason"] == "time_budget" and end["iterations"] == 1 and end["elapsed_seconds"] > 0
    # The run's wall time so far is checkpointed: a resumed run keeps counting from it.
    meta = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), 2).latest()
    assert meta.iteration == 1 and 0 < meta.elapsed_seconds <= end["elapsed_seconds"]
    config.resume = True
    config.rl.time_budget_minutes = 0.0
    resumed = trainer.build_run(config, str(tmp_path), quiet=True)
    try:
        assert resumed.elapsed_seconds() >= meta.elapsed_seconds
    finally:
        resumed.close()


def test_a_negative_time_budget_is_rejected(tmp_path):
    config = tiny_config(tmp_path)
    config.rl.time_budget_minutes = -1.0
    with pytest.raises(ValueError, match="time_budget_minutes=-1.0"):
        build.validate_config(config)


def test_a_server_pipeline_depth_below_one_is_rejected(tmp_path):
    config = tiny_config(tmp_path)
    config.sampler.pipeline_depth = 0
    with pytest.raises(ValueError, match="sampler.pipeline_depth=0: expected >= 1"):
        build.validate_config(config)


@pytest.mark.parametrize("overrides,message", [
    ({"sampler.num_servers": 2, "sampler.server_devices": "0,1"}, "expected 2 groups of device indices"),
    ({"sampler.num_servers": 1, "sampler.server_devices": "a"}, "server_devices='a'"),
    ({"sampler.num_servers": 1, "sampler.addresses": "127.0.0.1:9000"}, "expected one of them"),
    ({"sampler.addresses": "localhost"}, "'localhost' is not 'host:port'"),
    ({"sampler.tls_ca_file": "/nonexistent.pem"}, "is for sampler.addresses"),
    # A turn's prompt can be a whole sequence: a shorter prefill would end episodes early, silently.
    ({"rollout.max_context": 192, "sampler.max_prefill_length": 128},
     "sampler.max_prefill_length=128 is below rollout.max_context=192 - 1"),
    ({"rollout.max_context": 128, "sampler.max_cache_length": 100, "sampler.max_prefill_length": 64},
     "sampler.max_prefill_length=64 is below rollout.max_context=128 - 1"),
    ({"rollout.max_context": 120, "sampler.max_cache_length": 100}, "sampler.max_cache_length=100 is below"),
    ({"sampler.decode_options": "fastest"}, "sampler.decode_options='fastest': expected 'auto', 'builtin'"),
    ({"sampler.decode_options": "small_batch,xla_defaults,fast_minmax"}, "or 'LARGE,SMALL' of them"),
])
def test_bad_sampler_fleet_settings_are_rejected(tmp_path, overrides, message):
    config = tiny_config(tmp_path)
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        build.validate_config(config)


@pytest.mark.parametrize("name", ["eval.every", "checkpoint.every", "sft.log_every", "sft.eval_every"])
def test_a_negative_period_is_rejected(tmp_path, name):
    config = tiny_config(tmp_path)
    section, field = name.split(".")
    config[section][field] = -2
    with pytest.raises(ValueError, match=rf"{name}=-2: expected >= 0"):
        build.validate_config(config)


def test_adaptive_allocation_over_a_task_pool_and_dapo_over_sampling(tmp_path):
    config = tiny_config(tmp_path)
    config.allocation.strategy = "knapsack"
    config.allocation.task_pool = 5
    config.allocation.dynamic_sampling = True
    config.rl.iterations = 3
    config.sft.steps = 1
    config.eval.every = 100
    config.eval.pass_k = 0
    config.metrics.tensorboard = False
    config.checkpoint.every = 1
    path = trainer.train_and_evaluate(config, quiet=True)
    rl = [json.loads(line) for line in open(path) if '"stage": "rl"' in line]
    share = 1.0
    for record in rl:
        # DAPO: ceil(P / running non-zero share) prompts' worth of rollouts (budget x group size),
        # spread by the knapsack rule over pool tasks in groups of at least group_size.
        budget = math.ceil(3 / share)
        assert record["rollouts"] == budget * 2 and record["groups"] <= budget
        assert "allocation/retired_tasks" in record
        share = 0.8 * share + 0.2 * record["nonzero_advantage_group_share"]
    # The allocator's posteriors are checkpointed: a resumed run continues with them.
    meta = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), 2).latest()
    posterior = meta.source["allocator"]["posterior"]
    assert set(posterior["alpha"]) <= {f"calculator/{d}/{i}" for i in range(5) for d in (1, 2, 3)}
    assert sum(posterior["alpha"].values()) + sum(posterior["beta"].values()) > 0

    config.allocation.task_pool = 0
    with pytest.raises(ValueError, match="allocation.strategy='knapsack' needs a revisited task pool"):
        build.validate_config(config)


def test_until_mixed_sampling_spends_the_iteration_budget_in_rounds(tmp_path):
    config = tiny_config(tmp_path)
    config.allocation.strategy = "until_mixed"
    config.allocation.task_pool = 6
    config.rollout.group_size = 4  # rounds of 2 rollouts; budget 3 x 4 = 12 per iteration
    # DAPO's overlong penalty ramping over the whole context: -L / 200 for an episode of L tokens.
    config.reward.overlong_factor = 1.0
    config.reward.overlong_buffer = 200
    config.rl.iterations = 2
    config.sft.steps = 1
    config.eval.every = 100
    config.eval.pass_k = 0
    config.metrics.tensorboard = False
    path = trainer.train_and_evaluate(config, quiet=True)
    rl = [json.loads(line) for line in open(path) if '"stage": "rl"' in line]
    for record in rl:
        assert record["rollouts"] == 12
        # At least 3 tasks (round 1); at most 6 (all mixed after their first 2 rollouts).
        assert 3 <= record["groups"] <= 6
        assert record["reward/overlong"] == pytest.approx(-record["generated_tokens"] / 12 / 200, rel=1e-6)
        assert "reward/success" in record and record["reward/overlong"] < 0

    config.rollout.schedule = "async"
    with pytest.raises(ValueError, match="until_mixed.*needs rollout.schedule='sync'"):
        build.validate_config(config)


def test_export_at_every_save_writes_a_hugging_face_folder_of_that_checkpoint(tmp_path):
    """checkpoint.export_hf: each save (after SFT, each `checkpoint.every`, the end) also writes
    <workdir>/hf/<step>, whose weights are that checkpoint's (the last one equals the export of the
    newest checkpoint by launch/export_hf.py's function, and the SFT one differs from it)."""
    import numpy as np

    from jaxrl_agent import models
    from jaxrl_agent.cli import export_hf

    config = tiny_config(tmp_path / "run")
    config.checkpoint.export_hf = True
    config.checkpoint.every = 0
    config.eval.every = 0
    config.metrics.tensorboard = False
    trainer.train_and_evaluate(config, quiet=True)
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "hf").iterdir())
    assert steps == [config.sft.steps, config.sft.steps + config.rl.iterations]
    export_hf.export(config, str(tmp_path / "run"), str(tmp_path / "latest"))
    _, latest = models.load_hf(str(tmp_path / "latest"))
    _, at_end = models.load_hf(str(tmp_path / "run" / "hf" / str(steps[-1])))
    _, after_sft = models.load_hf(str(tmp_path / "run" / "hf" / str(steps[0])))
    import jax

    for a, b, c in zip(jax.tree.leaves(latest), jax.tree.leaves(at_end), jax.tree.leaves(after_sft)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(b), np.asarray(c))
               for b, c in zip(jax.tree.leaves(at_end), jax.tree.leaves(after_sft)))
    # --step picks an older checkpoint; a step that is not there is named with the ones that are.
    written = export_hf.export(config, str(tmp_path / "run"), str(tmp_path / "sft"), step=steps[0])
    assert written["step"] == steps[0] and written["stage"] == "sft_done"
    _, exported_sft = models.load_hf(str(tmp_path / "sft"))
    for a, c in zip(jax.tree.leaves(exported_sft), jax.tree.leaves(after_sft)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    with pytest.raises(FileNotFoundError, match=re.escape(f"; steps: {steps}")):
        export_hf.export(config, str(tmp_path / "run"), str(tmp_path / "none"), step=999)


def test_the_initial_evaluation_runs_unless_random_weights_go_to_sft_first(tmp_path):
    config = tiny_config(tmp_path)
    evaluates = lambda: run_schedule.evaluates_initial(config)
    assert not evaluates()  # 'auto', SFT first, random weights
    config.sft.steps = 0
    assert evaluates()  # RL straight from random weights: the initial evaluation is the baseline
    config.sft.steps = 3
    config.checkpoint.init_from = str(tmp_path / "earlier_run")
    assert evaluates()  # weights from a checkpoint: worth knowing before SFT changes them
    config.checkpoint.init_from = ""
    config.checkpoint.hf_path = str(tmp_path / "hf")
    assert evaluates()
    config.checkpoint.hf_path = ""
    for value, expected in (("TRUE", True), ("false", False)):
        config.eval.initial = value
        assert evaluates() is expected
    assert run_schedule.initial_eval_setting(True) == "true" and run_schedule.initial_eval_setting(False) == "false"
    config.sft.steps = 0
    config.eval.initial = "false"
    assert not evaluates()


def test_stop_reason_is_the_limit_the_run_reaches_first():
    import ml_collections

    rl = ml_collections.ConfigDict({"iterations": 10, "stop_after_trained_tokens": 0, "time_budget_minutes": 0.0})
    stop = lambda i, tokens=0, elapsed=0.0, durations=(5.0,), last_eval=0.0: trainer.stop_reason(
        rl, i, trained_tokens_total=tokens, elapsed_seconds=elapsed, durations=list(durations),
        last_eval_seconds=last_eval)
    assert stop(3, tokens=10**9, elapsed=10**9) is None  # no limit set
    rl.stop_after_trained_tokens = 1000
    assert stop(3, tokens=999) is None and stop(3, tokens=1000) == "trained_tokens"
    rl.time_budget_minutes = 1.0  # 60 s: one more iteration (the slowest of the last five) and the final eval
    assert stop(3, elapsed=40.0, durations=(30, 5, 5, 5, 5, 10), last_eval=9.0) is None  # 40 + 10 + 9 <= 60
    assert stop(3, elapsed=40.0, durations=(5, 5, 5, 5, 10, 5), last_eval=11.0) == "time_budget"  # 40 + 10 + 11
    assert stop(3, elapsed=46.0, durations=(15,), last_eval=0.0) == "time_budget"
    assert stop(10, elapsed=10**6) is None  # the last iteration ends the run anyway
    assert stop(10, tokens=1000, elapsed=10**6) == "trained_tokens"  # the tokens limit is still the reason


@pytest.mark.parametrize("reuse_calls", [0.0, 1000.0])
def test_rl_steps_run_in_compiled_shapes_that_hold_their_batches(tmp_path, monkeypatch, reuse_calls):
    """learner.shape_reuse_calls reaches the RL loop: each update runs in a shape that holds its
    packed minibatch (rows, target columns) — the minibatch's own with 0, else one of the shapes
    wanted before (`ShapeReuse`), padded. SFT's updates keep their own shapes either way."""
    config = tiny_config(tmp_path)
    config.sft.steps, config.rl.iterations, config.learner.shape_reuse_calls = 2, 3, reuse_calls
    config.eval.every, config.eval.pass_k = 0, 0
    config.learner.target_multiple, config.metrics.tensorboard = 1, False  # target columns that differ by batch
    wanted, ran = {True: [], False: []}, {True: [], False: []}
    from jaxrl_agent.learner import updates

    original_pack, original_global, original_build = trainer.replay.pack, updates.global_batch, build.build_learner
    stage = {"sft": True}
    shape = lambda b: (b.tokens.shape[0], 0 if b.target_index is None else b.target_index.shape[1])

    def pack(trajectories, row_length, **kwargs):  # SFT's packed batches
        batch, rows = original_pack(trajectories, row_length, **kwargs)
        if stage["sft"]:
            wanted[True].append(shape(batch))
        return batch, rows

    def global_batch(batch, *args, **kwargs):  # RL's packed minibatches, in the order they are trained
        wanted[False].append(shape(batch))
        return original_global(batch, *args, **kwargs)

    def build_learner(*args, **kwargs):
        state, step_fn = original_build(*args, **kwargs)
        sft = stage["sft"] = bool(kwargs.get("sft"))
        return state, lambda state, batch: (ran[sft].append(shape(batch)), step_fn(state, batch))[1]

    monkeypatch.setattr(trainer.replay, "pack", pack)
    monkeypatch.setattr(updates, "global_batch", global_batch)
    monkeypatch.setattr(trainer.build, "build_learner", build_learner)
    trainer.train_and_evaluate(config, quiet=True)
    assert ran[True] == wanted[True] and len(ran[True]) == 2  # SFT: every update in its own shape
    assert len(ran[False]) == len(wanted[False]) == config.rl.iterations * config.rl.minibatches
    assert all(r[0] >= w[0] and r[1] >= w[1] for r, w in zip(ran[False], wanted[False]))
    if reuse_calls == 0:
        assert ran[False] == wanted[False]
    else:
        assert all(r in wanted[False][:i + 1] for i, r in enumerate(ran[False]))
        assert len(set(ran[False])) < len(set(wanted[False]))  # fewer shapes compiled than the batches wanted
