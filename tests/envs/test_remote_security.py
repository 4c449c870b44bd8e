"""The env server's rules: a shared token on every request, episodes scoped to their connection
and freed with it, connection limits, idle timeouts, and bad input answered without harm."""

import asyncio
import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxrl_agent import auth, envs
from jaxrl_agent.envs import pool as pool_lib, remote

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = os.environ["JAXRL_AGENT_TOKEN"]


def _server(*flags, env=None):
    process = subprocess.Popen([sys.executable, "-m", "jaxrl_agent.cli", "env-server", "--port", "0", "--workers", "1",
                                *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=env or dict(os.environ))
    line = process.stdout.readline()
    assert line.startswith("env server listening on "), process.stderr.read()[-2000:]
    return process, int(line.split(":")[-1])


def _connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock, sock.makefile("rb")


def _request(connection, method, token=TOKEN, **params):
    sock, reader = connection
    sock.sendall((json.dumps({"id": 1, "method": method, "params": params, "token": token}) + "\n").encode())
    line = reader.readline()
    return json.loads(line) if line else None


@pytest.fixture(scope="module")
def server():
    process, port = _server()
    yield port
    process.kill()
    process.wait()


def _task():
    return envs.make("calculator").sample_task(0, 1).to_dict()


def test_a_request_without_the_token_is_refused_and_the_connection_closed(server):
    connection = _connect(server)
    reply = _request(connection, "num_workers", token="wrong")
    assert reply["error"].startswith("unauthenticated")
    assert connection[1].readline() == b""  # closed
    reply = _request(_connect(server), "num_workers", token=None)
    assert reply["error"].startswith("unauthenticated")
    assert _request(_connect(server), "num_workers")["result"] == 1


def test_episode_ids_are_random_and_belong_to_their_connection(server):
    owner, other = _connect(server), _connect(server)
    opened = _request(owner, "reset", env="calculator", task=_task())["result"]["episode_id"]
    again = _request(owner, "reset", env="calculator", task=_task())["result"]["episode_id"]
    assert len(opened) == 32 and int(opened, 16) >= 0 and opened != again
    denied = _request(other, "step", episode_id=opened, action="<answer>1</answer>")
    assert "unknown episode" in denied["error"]
    assert "unknown episode" in _request(other, "close_episode", episode_id=opened)["error"]
    step = _request(owner, "step", episode_id=opened, action="<answer>1</answer>")["result"]
    assert step["done"]


def test_a_closed_connection_frees_its_episodes():
    with pool_lib.EnvPool(1, step_timeout_s=30) as pool:
        loop = asyncio.new_event_loop()
        ports = []
        def run():
            try:
                loop.run_until_complete(remote.serve(pool, "127.0.0.1", 0, ports.append, token=TOKEN))
            except asyncio.CancelledError:
                pass

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while not ports:
            time.sleep(0.01)
        connection = _connect(ports[0])
        for _ in range(3):
            _request(connection, "reset", env="calculator", task=_task())
        assert len(pool._episodes) == 3
        connection[1].close()
        connection[0].close()
        deadline = time.monotonic() + 10
        while pool._episodes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool._episodes == {}
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(timeout=10)


def test_500_idle_connections_and_a_17_mib_line_still_leave_requests_served(server):
    idle = [_connect(server) for _ in range(500)]
    big = _connect(server)
    big[0].sendall(b'{"id": 1, "method": "reset", "params": {"x": "' + b"a" * (17 * 2**20) + b'"}}\n')
    reply = json.loads(big[1].readline())
    assert "request over" in reply["error"]
    assert _request(big, "num_workers")["result"] == 1  # the line was read through: the connection is in step
    garbage = _connect(server)
    garbage[0].sendall(b"\x00\xffnot json\n")
    assert "bad request" in json.loads(garbage[1].readline())["error"]
    assert _request(garbage, "num_workers")["result"] == 1  # the same connection goes on
    client = remote.RemoteEnvPool("127.0.0.1", server, timeout_s=30)
    episode, _ = client.reset("calculator", envs.make("calculator").sample_task(0, 1))
    assert client.step(episode, "<answer>1</answer>").done
    client.close()
    for sock, reader in idle:
        reader.close()
        sock.close()


def _lines(data: bytes, limit: int, max_discard: int, chunk: int = 5):
    """What `remote._read_line` makes of `data` fed in `chunk`-byte pieces to a reader of `limit`."""
    async def run():
        reader = asyncio.StreamReader(limit=limit)
        for start in range(0, len(data), chunk):
            reader.feed_data(data[start:start + chunk])
        reader.feed_eof()
        out = []
        while True:
            try:
                line = await remote._read_line(reader, max_discard)
            except remote._OverlongLine as err:
                out.append(("overlong", err.dropped, err.complete))
                if not err.complete:
                    return out
                continue
            if not line:
                return out
            out.append(line)
    return asyncio.run(run())


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_an_overlong_line_is_dropped_through_its_newline_and_the_next_line_is_read(chunk):
    data = b"ok\n" + b"x" * 40 + b"\n" + b"next\n" + b"y" * 17 + b"\n" + b"last"
    assert _lines(data, limit=16, max_discard=1000, chunk=chunk) == [
        b"ok\n", ("overlong", 41, True), b"next\n", ("overlong", 18, True), b"last"]


def test_an_overlong_line_past_the_discard_cap_or_cut_by_the_end_of_stream_is_incomplete():
    [(kind, dropped, complete)] = _lines(b"x" * 500 + b"\nafter\n", limit=16, max_discard=100)
    assert kind == "overlong" and dropped > 100 and complete is False
    assert _lines(b"x" * 50, limit=16, max_discard=1000) == [("overlong", 50, False)]


def test_the_client_refuses_a_request_over_the_servers_line_limit_without_sending_it(server):
    client = remote.RemoteEnvPool("127.0.0.1", server, timeout_s=30)
    task = dataclasses.replace(envs.make("calculator").sample_task(0, 1), prompt="x" * (remote.MAX_LINE_BYTES + 1))
    with pytest.raises(pool_lib.EnvServiceError, match=r"reset request of \d+ bytes: the env server takes requests "
                                                       r"of at most 16777216 bytes"):
        client.reset("calculator", task)
    assert client.num_workers == 1
    client.close()


def test_connection_limit_and_idle_timeout():
    process, port = _server("--max_connections", "2", "--idle_timeout_s", "1")
    try:
        first, second = _connect(port), _connect(port)
        assert _request(first, "num_workers")["result"] == 1 and _request(second, "num_workers")["result"] == 1
        third = _connect(port)
        assert "too many connections" in json.loads(third[1].readline())["error"]
        time.sleep(1.5)  # both idle past the timeout: closed, so new connections are served
        assert first[1].readline() == b""
        assert _request(_connect(port), "num_workers")["result"] == 1
    finally:
        process.kill()
        process.wait()


def test_the_server_refuses_to_start_without_a_token():
    env = {k: v for k, v in os.environ.items() if k not in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV)}
    done = subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", "env-server", "--port", "0"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 2 and "no authentication token: set JAXRL_AGENT_TOKEN" in done.stderr


def test_a_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-a-file\n")
    assert auth.load_token(str(path)) == "from-a-file"
    with pytest.raises(auth.AuthError, match="cannot read the token file"):
        auth.load_token(str(tmp_path / "missing"))
    assert auth.matches("a", "a") and not auth.matches("a", "b") and not auth.matches(None, "a")


def test_a_tls_server_serves_clients_that_trust_its_ca_and_no_others(tls_files):
    process, port = _server("--tls_cert_file", tls_files["cert"], "--tls_key_file", tls_files["key"])
    try:
        client = remote.RemoteEnvPool("127.0.0.1", port, tls_ca_file=tls_files["ca"])
        episode, observation = client.reset("calculator", envs.make("calculator").sample_task(0, 1))
        assert observation.text and client.num_workers == 1
        client.close_episode(episode)
        client.close()
        # Plain TCP gets no reply: the request is not a TLS handshake, so the server drops the connection.
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall((json.dumps({"id": 1, "method": "num_workers", "params": {}, "token": TOKEN}) + "\n").encode())
        assert b"result" not in sock.makefile("rb").read()
        sock.close()
        with pytest.raises(pool_lib.EnvServiceError):
            remote.RemoteEnvPool("127.0.0.1", port).num_workers  # noqa: B018 - a plain-TCP client
        with pytest.raises(pool_lib.EnvServiceError, match="CERTIFICATE_VERIFY_FAILED"):
            remote.RemoteEnvPool("127.0.0.1", port, tls_ca_file=tls_files["other_ca"]).num_workers  # noqa: B018
        # The trainer's side: env.tls_ca_file reaches the client.
        from jaxrl_agent import build, config_lib

        config = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
        config.env.service = f"127.0.0.1:{port}"
        config.env.tls_ca_file = tls_files["ca"]
        build.validate_config(config)
        environments = build.Environments(config)
        assert environments.service.servers[0].num_workers == 1
        environments.close()
    finally:
        process.kill()
        process.wait()


def test_tls_settings_that_cannot_work_are_errors(tls_files, tmp_path):
    from jaxrl_agent import build, config_lib

    config = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
    config.env.tls_ca_file = tls_files["ca"]
    with pytest.raises(build.ConfigError, match="env.tls_ca_file=.* is for remote env servers"):
        build.validate_config(config)
    config.env.service, config.env.tls_ca_file = "127.0.0.1:1", str(tmp_path / "missing.pem")
    with pytest.raises(build.ConfigError, match="no such file"):
        build.validate_config(config)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(auth.AuthError, match="holds no PEM certificate"):
        auth.client_ssl_context(str(tmp_path / "junk.pem"))
    with pytest.raises(auth.AuthError, match="needs both a certificate and its key"):
        auth.check_tls_pair(tls_files["cert"], "")
    done = subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", "env-server", "--port", "0", "--tls_cert_file",
                           tls_files["cert"], "--tls_key_file", tls_files["ca"]], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "cannot load the TLS certificate" in done.stderr


def test_hanging_steps_hold_only_their_own_threads():
    """Eight steps hanging on eight workers (more than asyncio's default executor has threads on
    2 cores) leave other requests answered at once."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "envs"), os.environ.get("PYTHONPATH", "")]))
    process, port = _server("--workers", "8", "--step_timeout_s", "60", "--import", "sleepy_envs", env=env)
    try:
        connections = [_connect(port) for _ in range(8)]
        import dataclasses

        task = dataclasses.replace(envs.make("calculator").sample_task(0, 1), env="sleepy").to_dict()
        episodes = [_request(c, "reset", env="sleepy", task=task)["result"]["episode_id"] for c in connections]
        for connection, episode in zip(connections, episodes):
            connection[0].sendall((json.dumps({"id": 2, "method": "step", "params": {
                "episode_id": episode, "action": "answer: 1"}, "token": TOKEN}) + "\n").encode())
        time.sleep(1.0)  # the eight steps are now sleeping in their workers
        started = time.monotonic()
        assert _request(_connect(port), "num_workers")["result"] == 8
        assert time.monotonic() - started < 5.0
    finally:
        process.kill()
        process.wait()


def test_workers_do_not_outlive_a_killed_server():
    """SIGKILL of the env server, with a step hanging in its worker: the worker exits within seconds
    instead of living on as an orphan."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "envs"), os.environ.get("PYTHONPATH", "")]))
    process, port = _server("--workers", "1", "--step_timeout_s", "60", "--import", "sleepy_envs", env=env)
    connection = _connect(port)
    (worker,) = _request(connection, "worker_pids")["result"]
    import dataclasses

    task = dataclasses.replace(envs.make("calculator").sample_task(0, 1), env="sleepy").to_dict()
    episode = _request(connection, "reset", env="sleepy", task=task)["result"]["episode_id"]
    connection[0].sendall((json.dumps({"id": 2, "method": "step", "params": {"episode_id": episode, "action": "x"},
                                       "token": TOKEN}) + "\n").encode())
    time.sleep(0.5)
    process.kill()
    process.wait()
    assert pool_lib.wait_for(lambda: not os.path.exists(f"/proc/{worker}") or
                             open(f"/proc/{worker}/stat").read().split()[2] == "Z", timeout=5.0)


def test_a_fleet_balances_episodes_and_a_lost_server_ends_only_its_own_as_env_crash():
    """Two env servers as one service (`env.service='host:port,host:port'`): new episodes alternate
    between them; SIGKILL of one ends its episodes' next step as 'env_crash' through the rollout's
    ServiceEnv (the others step on), and new episodes fail over to the server that is left."""
    from jaxrl_agent.rollout.episode import ServiceEnv

    (first, first_port), (second, second_port) = _server(), _server()
    fleet = remote.RemoteEnvServices([("127.0.0.1", first_port), ("127.0.0.1", second_port)], timeout_s=10.0)
    try:
        env = envs.make("calculator")
        episodes = [ServiceEnv(fleet, "calculator") for _ in range(4)]
        for i, episode in enumerate(episodes):
            asyncio.run(episode.reset(env.sample_task(i, 1), i))
        assert [e.episode_id.split(":")[0] for e in episodes] == ["0", "1", "0", "1"]  # balanced by episode
        second.kill()
        second.wait()
        steps = [asyncio.run(e.step("<answer>1</answer>")) for e in episodes]
        reasons = [s.info.get("finish_reason") for s in steps]
        assert reasons[1] == reasons[3] == "env_crash"  # the lost server's episodes, recorded
        assert "env_crash" not in (reasons[0], reasons[2]) and steps[0].done  # the others answered
        assert "EnvServiceError" in steps[1].info["error"]
        failovers = fleet.failovers
        later = [ServiceEnv(fleet, "calculator") for _ in range(2)]
        for i, episode in enumerate(later):
            asyncio.run(episode.reset(env.sample_task(10 + i, 1), i))
        assert [e.episode_id.split(":")[0] for e in later] == ["0", "0"]  # the live server takes them all
        assert fleet.failovers == failovers + 1 and fleet.stats["unreachable_servers"] == 1
    finally:
        fleet.close()
        for process in (first, second):
            process.kill()
            process.wait()
