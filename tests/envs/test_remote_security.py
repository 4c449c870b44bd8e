"""The env server's rules: a shared token on every request, episodes scoped to their connection
and freed with it, connection limits, idle timeouts, and bad input answered without harm."""

import asyncio
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
