"""README.md as a newcomer reads it: every code block runs in a test here (or is `.ci/run`'s
command), every link resolves inside the repository, and the quick start stays short."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import pytest

from jaxrl_agent import models
from tests import hf_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Appended to README's training commands so that a test runs them in seconds, not minutes.
QUICK = {"sft.steps": 4, "sft.batch_size": 4, "sft.num_demonstrations": 16, "rl.iterations": 2,
         "rollout.prompts_per_iteration": 3, "rollout.group_size": 2, "eval.every": 0,
         "eval.tasks_per_difficulty": 2, "model.num_layers": 1, "model.hidden_size": 32,
         "model.intermediate_size": 64, "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
         "sampler.max_concurrent_decodes": 8}
# A user's machine: one CPU device (not the 8 simulated ones tests/conftest.py asks for).
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
# A distinctive piece of each block -> the test that runs it (a new block needs a new test).
TESTED_BLOCKS = {
    "pip install -U pip . && jaxrl-agent train": "test_quick_start_installs_without_the_test_extra_and_trains (slow)",
    'pip install -U pip -e ".[test]" && python -m pytest': "test_ci_runs_the_quick_start_test_command",
    "objective_from_loss(my_loss": "test_research_script_runs (slow)",
    "--config.rl.objective=ppo": "test_objective_override_command_runs (slow)",
    "jaxrl-agent train --mode smoke --config configs/hf_model.py": "test_real_model_commands_run (slow)",
    "huggingface-cli download Qwen/Qwen3-0.6B": "test_qwen3_section_commands_run (slow)",
    "launch/local_cluster.py -n 2": "test_local_cluster_command_runs (slow)",
    "jaxrl-agent env-server": "test_several_hosts_commands_run (slow)",
    "--config.sampler.addresses=": "test_sampler_servers_by_address_commands_run (slow)",
    'config.stages = "sft,calculator,chain"': "test_the_stage_list_block_is_configs_stages_tiny",
    'config.rollout.delegate = "initial"': "test_the_sub_agents_block_is_configs_chain_sum_tiny",
}


def _blocks():
    """[(language, body)] of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)


def _block(piece):
    return next(body for _, body in _blocks() if piece in body)


def _quick_start():
    return README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 5)]


def _commands(body):
    """A bash block's commands (one per line, `\\` continuations joined, `&` kept as a suffix)."""
    return [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def _run(command, *, cwd, overrides=None, timeout=600, env=None):
    """Runs one README command (`jaxrl-agent ...` as `python -m jaxrl_agent.cli ...`) with `overrides`
    appended to a training command."""
    args = shlex.split(command.replace("configs/", f"{ROOT}/configs/"))
    assert args[0] == "jaxrl-agent", command
    if args[1] == "train" and overrides:
        args += [f"--config.{k}={v}" for k, v in overrides.items()]
    return subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", *args[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **ONE_DEVICE, **(env or {})})


# ------------------------------------------------------------------------------------------ shape
def test_every_code_block_is_tested():
    for language, body in _blocks():
        assert language in ("python", "bash", "text"), f"unlabelled or unknown block: {body[:80]}"
        if language == "text":  # diagrams
            continue
        tested = [piece for piece in TESTED_BLOCKS if piece in body]
        assert len(tested) == 1, f"a README block with no test (or two): {body[:200]}"


def test_links_resolve_inside_the_repository():
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert links
    for link in links:
        assert not re.match(r"\w+://", link), f"README links outside the repository: {link}"
        assert (ROOT / link.split("#")[0]).exists(), f"README links to a missing file: {link}"
    for doc in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"\w+://", link):
                assert (doc.parent / link).exists(), f"{doc.name} links to a missing file: {link}"


def test_quick_start_is_two_commands_and_under_120_words():
    section = _quick_start()
    assert len(section.split()) < 120, len(section.split())
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2 and all(len(_commands(b)) == 1 for b in blocks)
    assert "jaxrl-agent train --config configs/calculator_tiny.py" in blocks[0]
    assert "[test]" not in blocks[0], "training installs without the test extra"
    assert "pytest" in blocks[1]


def test_ci_runs_the_quick_start_test_command():
    command = _commands(re.findall(r"```bash\n(.*?)```", _quick_start(), flags=re.S)[1])[0]
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_picture_is_a_png():
    image = re.search(r"!\[[^]]*\]\(([^)]+)\)", README).group(1)
    assert (ROOT / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------ the blocks
@pytest.mark.slow
def test_quick_start_installs_without_the_test_extra_and_trains(tmp_path):
    """The first command on a fresh machine: a new virtual environment, `pip install .` (no test
    extra: no torch), then training (shortened by QUICK), from a copy of the tracked files."""
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((ROOT / name).read_bytes())
    command = _commands(re.findall(r"```bash\n(.*?)```", _quick_start(), flags=re.S)[0])[0]
    command += "".join(f" --config.{k}={v}" for k, v in QUICK.items())
    command += " && pip show jaxrl_agent && python -c 'import importlib.util as u; print(\"torch:\", u.find_spec(\"torch\"))'"
    environment = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    environment["PATH"] = os.pathsep.join(p for p in environment["PATH"].split(os.pathsep)
                                          if not p.startswith(str(ROOT)))
    done = subprocess.run(["bash", "-c", command], cwd=checkout, capture_output=True, text=True, timeout=1800,
                          env=environment)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held-out success" in done.stdout and "License-Expression: Apache-2.0" in done.stdout
    assert "torch: None" in done.stdout
    training_stderr = done.stderr
    assert not re.search(r"cuda|cuInit|onednn|absl::InitializeLog", training_stderr, re.I), training_stderr[-3000:]
    records = [json.loads(line) for line in open(checkout / "runs" / "calculator_tiny" / "metrics.jsonl")]
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1, 2]
    # sampler.decode_options='auto': chosen on this host (measured now, or read from its cache), logged at start
    assert re.fullmatch(r"large=\w+ small=\w+ \((measured|measured again|cached)"
                        r"(, measured under load: other processes \d+% of the CPU)?\)", records[0]["decode_options"]), records[0]


@pytest.mark.slow  # in CI's slow pass: keeps the default suite under ~15 min on a clean clone
def test_research_script_runs(tmp_path, monkeypatch):
    """The "Bring your own" script: a pure loss, a reward component and a task file, trained."""
    block = _block("objective_from_loss(my_loss")
    assert len([line for line in block.splitlines() if line.strip()]) <= 20
    monkeypatch.chdir(tmp_path)
    block = block.replace('"configs/calculator_tiny.py"', repr(str(ROOT / "configs" / "calculator_tiny.py")))
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    records = [json.loads(line) for line in open(namespace["path"])]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and all("reward/brevity" in r for r in rl)
    assert next(r for r in records if r["stage"] == "data")["task_records"] == 64
    assert all(len(r["task_ids"]) == 8 for r in rl)
    assert next(r for r in records if r["stage"] == "start")["objective"] == "mine"


@pytest.mark.slow  # a launcher subprocess (~15 s warm, more on a cold cache); CI's slow pass runs it
def test_objective_override_command_runs(tmp_path):
    (command,) = _commands(_block("--config.rl.objective=ppo"))
    done = _run(command, cwd=ROOT, overrides={**QUICK, "workdir": tmp_path})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert next(r for r in records if r["stage"] == "start")["objective"].startswith("ppo")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["rl"]["clip_eps_high"], config["rl"]["advantage"], config["rl"]["correction"]) == \
        (0.28, "grpo", "icepop")


@pytest.mark.slow  # in CI's slow pass: keeps the default suite under ~15 min on a clean clone
def test_real_model_commands_run(tmp_path):
    """The three commands on a tiny random Qwen3 folder standing in for /models/Qwen3-0.6B."""
    folder = tmp_path / "Qwen3-0.6B"
    config = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=400, hidden_size=32,
                                intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    models.save_hf(str(folder), config, models.init_params(config, jax.random.PRNGKey(0)))
    hf_reference.train_tiny_hf_tokenizer(folder)
    smoke, train, export = [c.replace("/models/Qwen3-0.6B", str(folder)) for c in
                            _commands(_block("jaxrl-agent train --mode smoke --config configs/hf_model.py"))]
    done = _run(smoke, cwd=tmp_path)
    assert done.returncode == 0 and "'architecture': 'qwen3'" in done.stdout, done.stderr[-3000:]
    quick = {k: v for k, v in QUICK.items() if not k.startswith("model.")}
    done = _run(train, cwd=tmp_path, overrides={**quick, "sft.steps": 0, "learner.target_multiple": 16})
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run(export, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    exported_config, exported = models.load_hf(str(tmp_path / "runs" / "qwen3" / "hf"))
    assert exported_config.architecture == "qwen3" and exported_config.hidden_size == 32
    assert (tmp_path / "runs" / "qwen3" / "hf" / "tokenizer.json").exists()


def _run_python(command, *, cwd, overrides=None, timeout=900, env=None):
    """Runs a README `python launch/... ` command from a checkout (paths under ROOT), with
    `overrides` appended as --config flags."""
    args = shlex.split(command.replace("configs/", f"{ROOT}/configs/").replace("launch/", f"{ROOT}/launch/"))
    assert args[0] == "python", command
    args += [f"--config.{k}={v}" for k, v in (overrides or {}).items()]
    return subprocess.run([sys.executable, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ONE_DEVICE, **(env or {})})


def _tiny_qwen3_folder(folder):
    config = models.ModelConfig(architecture="qwen3", qk_norm=True, vocab_size=400, hidden_size=32,
                                intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    models.save_hf(str(folder), config, models.init_params(config, jax.random.PRNGKey(0)))
    hf_reference.train_tiny_hf_tokenizer(folder)
    return folder


@pytest.mark.slow  # SFT and RL of the Qwen3 config on a tiny folder (~2 min); CI's slow pass runs it
def test_qwen3_section_commands_run(tmp_path):
    """'Agentic RL on Qwen3 with one GPU or TPU' on a tiny random Qwen3 folder standing in for the
    download (the install line needs a GPU or TPU host and is not run): smoke, train, export."""
    folder = _tiny_qwen3_folder(tmp_path / "Qwen3-0.6B")
    commands = [c for c in _commands(_block("huggingface-cli download Qwen/Qwen3-0.6B")) if not c.startswith(("#", "pip "))]
    smoke, train, export = [c.replace("/models/Qwen3-0.6B", str(folder)) for c in commands]
    done = _run(smoke, cwd=tmp_path)
    assert done.returncode == 0 and "'architecture': 'qwen3'" in done.stdout, done.stderr[-3000:]
    quick = {k: v for k, v in QUICK.items() if not k.startswith("model.")}
    done = _run_python(train, cwd=tmp_path, overrides={**quick, "sft.steps": 2, "rollout.max_context": 1024})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "runs" / "qwen3_0_6b_agentic" / "metrics.jsonl")]
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1, 2]
    done = _run_python(export, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    exported_config, _ = models.load_hf(str(tmp_path / "runs" / "qwen3_0_6b_agentic" / "hf"))
    assert exported_config.architecture == "qwen3" and exported_config.hidden_size == 32


@pytest.mark.slow  # two training processes (~1 min); CI's slow pass runs it
def test_local_cluster_command_runs(tmp_path):
    """'Several hosts': the local_cluster.py command, two processes of 4 simulated devices each."""
    (command,) = _commands(_block("launch/local_cluster.py -n 2"))
    quick = {**QUICK, "workdir": tmp_path / "run", "rl.time_budget_minutes": 0, "rollout.drop_zero_advantage_groups": False}
    done = _run_python(command, cwd=tmp_path, overrides=quick, env={"XLA_FLAGS": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    start = next(r for r in records if r["stage"] == "start")
    assert start["processes"] == 2 and start["devices"] == 8
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1, 2]


@pytest.mark.slow
def test_several_hosts_commands_run(tmp_path, monkeypatch):
    """An env server, and a trainer on it with two sampler server processes."""
    export, server_command, train = _commands(_block("jaxrl-agent env-server"))
    assert export.startswith("export JAXRL_AGENT_TOKEN=$(python3 -c ")
    token = subprocess.run(["bash", "-c", f"{export} && echo $JAXRL_AGENT_TOKEN"], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert len(token) == 64
    monkeypatch.setenv("JAXRL_AGENT_TOKEN", token)  # the servers, the trainer, and this test's process
    args = shlex.split(server_command.rstrip("&").strip())
    port_index = args.index("--port") + 1
    args[port_index] = "0"
    server = subprocess.Popen([sys.executable, "-m", "jaxrl_agent.cli", *args[1:]], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, **ONE_DEVICE})
    assert _run("jaxrl-agent env-server --port 0", cwd=ROOT, env={"JAXRL_AGENT_TOKEN": ""}).returncode == 2
    try:
        address = server.stdout.readline().split()[-1]
        train = train.replace("127.0.0.1:7100", address)
        done = _run(train, cwd=ROOT, overrides={**QUICK, "workdir": tmp_path}, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        rl = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        rl = [r for r in rl if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [1, 2] and all(r["rollouts"] == 6 for r in rl)
        assert json.loads((tmp_path / "config.json").read_text())["sampler"]["num_servers"] == 2
    finally:
        server.kill()


@pytest.mark.slow
def test_sampler_servers_by_address_commands_run(tmp_path, monkeypatch):
    """Two sampler servers started as README says (the same config, the token), then a trainer on
    them by address."""
    *servers, train = _commands(_block("--config.sampler.addresses="))
    monkeypatch.setenv("JAXRL_AGENT_TOKEN", "t" * 64)
    processes, addresses = [], []
    try:
        for command in servers:
            args = shlex.split(command.rstrip("&").strip().replace("configs/", f"{ROOT}/configs/"))
            assert args[:2] == ["jaxrl-agent", "sampler-server"] and "--await_weights" in args, command
            args[args.index("--port") + 1] = "0"
            args += [f"--config.{k}={v}" for k, v in QUICK.items()]  # the trainer's model, as README says
            processes.append(subprocess.Popen([sys.executable, "-m", "jaxrl_agent.cli", *args[1:]],
                                              stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                              env={**os.environ, **ONE_DEVICE}))
        for process in processes:
            line = next(line for line in process.stdout if line.startswith("sampler server listening on "))
            addresses.append(line.split()[-1])
        train = train.replace("127.0.0.1:9000,127.0.0.1:9001", ",".join(addresses))
        done = _run(train, cwd=ROOT, overrides={**QUICK, "workdir": tmp_path}, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        rl = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        rl = [r for r in rl if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [1, 2] and all(r["rollouts"] == 6 and r["policy_lag_max"] == 0 for r in rl)
        assert all(r["sampler_generate_calls"] > 0 for r in rl)
    finally:
        for process in processes:
            process.kill()


def test_the_stage_list_block_is_configs_stages_tiny():
    """README's stage list is the one configs/stages_tiny.py defines (tests/test_stages.py runs a
    list like it, killed and resumed), and it validates stage by stage."""
    from jaxrl_agent import build, config_lib, stages

    block = _block('config.stages = "sft,calculator,chain"')
    source = [line.split("  #")[0].strip() for line in (ROOT / "configs" / "stages_tiny.py").read_text().splitlines()]
    for line in block.splitlines():
        assert line.strip() in source, f"README's stage block line is not in configs/stages_tiny.py: {line}"
    config = config_lib.load_config(str(ROOT / "configs" / "stages_tiny.py"))
    listed = stages.stage_configs(config, "runs/stages_tiny")
    assert [name for name, _, _ in listed] == ["sft", "calculator", "chain"]
    for _, _, stage in listed:
        build.validate_config(stage)


def test_the_sub_agents_block_is_configs_chain_sum_tiny():
    """README's sub-agent block is configs/chain_sum_tiny.py's (tests/test_delegation_run.py runs
    such a run; tests/envs/test_chain_sum.py measures its contexts), and it validates."""
    from jaxrl_agent import build, config_lib

    block = _block('config.rollout.delegate = "initial"')
    path = ROOT / "configs" / "chain_sum_tiny.py"
    source = [line.split("  #")[0].strip() for line in path.read_text().splitlines()]
    for line in block.splitlines():
        assert line.strip() in source, f"README's sub-agent block line is not in configs/chain_sum_tiny.py: {line}"
    config = config_lib.load_config(str(path))
    build.validate_config(config)
    assert config.rollout.delegate == "initial" and config.env.name == "chain_sum"
