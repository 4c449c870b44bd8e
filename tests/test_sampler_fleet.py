"""Sampler servers run elsewhere (`sampler.addresses`): the default config trains on them, requests
fail over while one is gone, and one that returns after a restart rejoins with the current weights."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from jaxrl_agent import auth, build, trainer
from jaxrl_agent.sampling.client import BackgroundSamplerClient
from tests.test_trainer import tiny_config


def _serve(config_path, port, token):
    env = {**os.environ, auth.TOKEN_ENV: token, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "jaxrl_agent.cli", "sampler-server", "--config", config_path,
                             "--port", str(port), "--await_weights"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)


def _address(process, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        if line.startswith("sampler server listening on "):
            return line.split()[-1]
        assert time.monotonic() < deadline, "the sampler server did not start"
    raise AssertionError(f"the sampler server exited with {process.wait()}")


def _rl_records(workdir):
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if '"stage": "rl"' in line and line.endswith("}")]


@pytest.mark.slow
def test_the_default_config_on_sampler_servers_by_address_with_one_restarted(tmp_path, monkeypatch):
    token = auth.new_token()
    monkeypatch.setenv(auth.TOKEN_ENV, token)
    config = tiny_config(tmp_path / "run")
    config.sft.steps = 2
    config.eval.every = 1000
    config.eval.pass_k = 0
    config.metrics.tensorboard = False
    config.rl.iterations = 1000
    config.rl.time_budget_minutes = 1.5  # long enough for a server to be killed and come back
    config.sampler.rejoin_check_s = 0.5
    config.sampler.weight_chunk_mb = 0.001  # ~1 KiB chunks: every push is many messages
    config_path = build.write_config_file(config, str(tmp_path / "served_config.py"))
    servers = [_serve(config_path, 0, token) for _ in range(2)]
    events = {}
    try:
        addresses = [_address(s) for s in servers]
        config.sampler.addresses = ",".join(addresses)

        def kill_and_restart():
            while not _rl_records(tmp_path / "run"):
                time.sleep(0.2)
            servers[1].kill()
            servers[1].wait()
            events["killed_after"] = len(_rl_records(tmp_path / "run"))
            servers[1] = _serve(config_path, int(addresses[1].rsplit(":", 1)[1]), token)
            _address(servers[1])
            events["back_after"] = len(_rl_records(tmp_path / "run"))

        helper = threading.Thread(target=kill_and_restart, daemon=True)
        helper.start()
        trainer.train_and_evaluate(config, quiet=True)
        helper.join(timeout=60)
        rl = _rl_records(tmp_path / "run")
        assert "back_after" in events and len(rl) > events["back_after"] + 1, (events, len(rl))
        # Every trained token came from the weights just pushed: the returned server was sent them.
        assert all(r["policy_lag_max"] == 0 and r["drift/sampler_abs_diff_max"] < 0.05 for r in rl)
        assert rl[-1]["sampler_rejoined"] >= 1
        client = BackgroundSamplerClient([addresses[1]], token=token)
        try:
            (info,) = client._run(client.client.info())
        finally:
            client.close()
        assert info["version"] == rl[-1]["version"]  # the restarted server holds the last weights ...
        assert info["sampler"]["generate_calls"] > 0  # ... and sampled with them
    finally:
        for s in servers:
            s.kill()
