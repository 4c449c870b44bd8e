"""Stage lists (`config.stages`): each stage a run from the previous one's final policy, one
global step, an evaluation of every environment after each stage, and resume in the right stage."""

import json
import re
import os
import pathlib
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from jaxrl_agent import build, config_lib, stages
from tests.test_trainer import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def staged(workdir, rl_iterations=2):
    """The tests' tiny config as a three-stage list: SFT on calculator, RL on calculator, then RL on
    a calculator of another kind of task (kb_search) with distillation from the calculator stage."""
    config = tiny_config(workdir)
    config.unlock()
    config.metrics.tensorboard, config.eval.pass_k, config.eval.every = False, 0, 100
    config.env.eval_difficulties, config.eval.tasks_per_difficulty = "1", 2
    config.checkpoint.every = 1
    config.stages = "sft,calc,kb"
    config.stage.sft = ml_collections.ConfigDict({"rl": {"iterations": 0}})
    config.stage.calc = ml_collections.ConfigDict({"sft": {"steps": 0}, "rl": {"iterations": rl_iterations}})
    config.stage.kb = ml_collections.ConfigDict({
        "sft": {"steps": 0}, "env": {"name": "kb_search", "train_difficulties": "1", "eval_difficulties": "1"},
        "rl": {"iterations": rl_iterations, "distill_coef": 0.5}})
    return config


def test_each_stage_is_the_base_config_with_its_overrides_and_bad_ones_are_named(tmp_path):
    config = staged(tmp_path)
    (sft, sft_dir, sft_config), (calc, _, calc_config), (kb, kb_dir, kb_config) = stages.stage_configs(config, str(tmp_path))
    assert (sft, calc, kb) == ("sft", "calc", "kb")
    assert sft_dir == str(tmp_path / "stages" / "0_sft") and kb_dir == str(tmp_path / "stages" / "2_kb")
    assert sft_config.rl.iterations == 0 and sft_config.sft.steps == config.sft.steps
    assert kb_config.env.name == "kb_search" and kb_config.rl.distill_coef == 0.5 and kb_config.sft.steps == 0
    assert kb_config.model.hidden_size == config.model.hidden_size and kb_config.stages == ""
    assert config.env.name == "calculator" and config.rl.distill_coef == 0.0  # the base is not changed
    for build_stage in (sft_config, calc_config, kb_config):
        build.validate_config(build_stage)
    config.stage.kb.rl.distil_coef = 0.1
    with pytest.raises(stages.StageError, match=r"stage.kb.rl.distil_coef: the config has no field 'distil_coef'"):
        stages.stage_configs(config, str(tmp_path))
    del config.stage.kb.rl["distil_coef"]
    config.stages = "sft,calc,missing"
    with pytest.raises(stages.StageError, match=r"stage 'missing' has no config.stage.missing"):
        stages.stage_configs(config, str(tmp_path))
    config.stages = "sft,sft"
    with pytest.raises(stages.StageError, match="appears twice"):
        stages.stage_configs(config, str(tmp_path))
    config.stages = "sft,calc"
    config.stage.calc = ml_collections.ConfigDict({"rl": {"iterations": "two"}})
    with pytest.raises(stages.StageError, match=r"stage.calc.rl.iterations='two'"):
        stages.stage_configs(config, str(tmp_path))


def _records(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path).read().splitlines() if line.strip().endswith("}")]


def _config_file(tmp_path, workdir):
    """A config file of the staged tiny config, for the launcher."""
    path = tmp_path / "staged_config.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.test_stages import staged\n\n\n"
                    f"def get_config():\n    return staged({str(workdir)!r}, rl_iterations=3)\n")
    return str(path)


def _launch(config_file, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"))
    return subprocess.Popen([sys.executable, str(ROOT / "launch" / "tpu_run.py"), "--config", config_file, *flags],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_stage_list_killed_in_its_second_stage_resumes_there(tmp_path):
    workdir = tmp_path / "run"
    config_file = _config_file(tmp_path, workdir)
    run = _launch(config_file)
    calc = workdir / "stages" / "1_calc" / "metrics.jsonl"
    deadline = time.time() + 900
    while not any(r["stage"] == "rl" and r["step"] >= 2 for r in _records(calc)):
        assert run.poll() is None, run.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached the calc stage's second iteration"
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)
    run.wait()
    sft_before = (workdir / "stages" / "0_sft" / "metrics.jsonl").read_text()
    top = _records(workdir / "metrics.jsonl")
    assert [r["stage_name"] for r in top if r["stage"] == "stage_eval"] == ["sft"]
    resumed = _launch(config_file, "--config.resume=True")
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    top = _records(workdir / "metrics.jsonl")
    starts = [(r["stage_name"], r["resumed"]) for r in top if r["stage"] == "stage_start"]
    assert starts == [("sft", False), ("calc", False), ("calc", True), ("kb", False)]
    assert (workdir / "stages" / "0_sft" / "metrics.jsonl").read_text() == sft_before  # not run again
    calc_records = _records(calc)
    assert any(r["stage"] == "resume" for r in calc_records)
    assert sorted({r["step"] for r in calc_records if r["stage"] == "rl"}) == [1, 2, 3]
    # One global step across the list: each stage continues where the previous one ended.
    evals = {r["stage_name"]: r for r in top if r["stage"] == "stage_eval"}
    assert list(evals) == ["sft", "calc", "kb"]
    sft_steps = tiny_config(workdir).sft.steps
    assert evals["sft"]["global_step"] == sft_steps
    assert evals["calc"]["global_step"] == sft_steps + 3 and evals["kb"]["global_step"] == sft_steps + 6
    kb_records = _records(workdir / "stages" / "2_kb" / "metrics.jsonl")
    assert min(r["global_step"] for r in kb_records) == sft_steps + 3
    assert [r["global_step"] for r in kb_records if r["stage"] == "rl"] == [sft_steps + 4, sft_steps + 5, sft_steps + 6]
    # Every stage's final policy is evaluated on every environment of the list.
    for record in evals.values():
        assert {"eval/calculator/success", "eval/kb_search/success", "eval/calculator/pass@1/d1"} <= set(record)
    # The distillation stage distils (its own loss term), from the calc stage's final policy.
    assert all("distill/loss" in r for r in kb_records if r["stage"] == "rl")
    assert not any("distill/loss" in r for r in calc_records if r["stage"] == "rl")


def test_a_resumed_stage_list_records_the_config_it_resumed_with(tmp_path):
    # Every stage finished (its stage_eval written): a resume trains nothing, and config.json is
    # this invocation's resolved config, overrides included (it kept the first invocation's before).
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, name in enumerate(["sft", "calc", "kb"]):
            f.write(json.dumps({"stage": "stage_eval", "step": i, "global_step": i, "stage_name": name}) + "\n")
    config = staged(tmp_path)
    config.unlock()
    config.resume = True
    for coef in (0.5, 0.05):
        config.stage.kb.rl.distill_coef = coef
        stages.run_stages(config, str(tmp_path), quiet=True, train=lambda *a, **k: pytest.fail("nothing to train"))
        written = json.loads((tmp_path / "config.json").read_text())
        assert written["stage"]["kb"]["rl"]["distill_coef"] == coef and written["resume"] is True


def test_a_stage_field_its_overrides_do_not_list_is_set_from_the_command_line(tmp_path):
    # ml-collections can only set fields that exist: `stage.kb.seed` is not among kb's overrides,
    # so the launcher's command line splits it out and adds it, typed as the base config's field.
    config_file = _config_file(tmp_path, tmp_path)
    argv = ["prog", "--config", config_file, "--config.stage.kb.seed=7", "--config.stage.kb.rl.distill_coef=0.2",
            "--config.stage.calc.rl.learning_rate", "3e-4", "--config.resume=True"]
    config_lib.check_overrides(argv)
    rest, fields = config_lib.stage_field_overrides(argv)
    # Listed fields (kb's distill_coef) and top-level ones stay with ml-collections.
    assert rest == ["prog", "--config", config_file, "--config.stage.kb.rl.distill_coef=0.2", "--config.resume=True"]
    assert fields == {"stage.kb.seed": "7", "stage.calc.rl.learning_rate": "3e-4"}
    config = config_lib.load_config(config_file).lock()  # as the launcher loads it
    config_lib.apply_stage_field_overrides(config, fields)
    assert config.is_locked
    listed = {name: stage for name, _, stage in stages.stage_configs(config, str(tmp_path))}
    assert listed["kb"].seed == 7 and listed["calc"].seed == listed["sft"].seed == config.seed != 7
    assert listed["calc"].rl.learning_rate == 3e-4 and listed["kb"].rl.learning_rate == config.rl.learning_rate
    assert listed["calc"].rl.iterations == 3  # the stage's own overrides are kept beside the new one


@pytest.mark.parametrize("flag, named", [
    ("--config.stage.kb.sede=7", "has no field 'sede'; did you mean --config.stage.kb.seed"),
    ("--config.stage.nostage.seed=7", "has no field 'stage.nostage.seed'"),
    ("--config.stage.kb.seed=seven", "--config.stage.kb.seed='seven': expected int"),
    ("--config.stage.kb.model=1", "'model' is a section"),
])
def test_bad_stage_field_overrides_are_named(tmp_path, flag, named):
    argv = ["prog", "--config", _config_file(tmp_path, tmp_path), flag]
    with pytest.raises(config_lib.ConfigOverrideError, match=re.escape(named)):
        config_lib.check_overrides(argv)
        config_lib.stage_field_overrides(argv)


def test_the_launcher_runs_a_stage_with_a_field_its_overrides_do_not_list(tmp_path):
    # Through the launcher: a finished list resumed with a stage field on the command line trains
    # nothing and records the config it resolved (stage kb's seed among kb's overrides).
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, name in enumerate(["sft", "calc", "kb"]):
            f.write(json.dumps({"stage": "stage_eval", "step": i, "global_step": i, "stage_name": name}) + "\n")
    run = _launch(_config_file(tmp_path, tmp_path), "--config.resume=True", "--config.stage.kb.seed=7")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["stage"]["kb"]["seed"] == 7 and "seed" not in written["stage"]["calc"]
    bad = _launch(_config_file(tmp_path, tmp_path), "--config.resume=True", "--config.stage.kb.seed=seven")
    _, err = bad.communicate(timeout=300)
    assert bad.returncode != 0 and "expected int" in err and "Traceback" not in err
