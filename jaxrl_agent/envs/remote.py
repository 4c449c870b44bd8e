"""The environment service over the network: `serve(pool, host, port)` and `RemoteEnvPool`.

One JSON object per line over TCP (no pickle: nothing a peer sends is executed). The server runs an
`EnvPool` (`launch/env_server.py`); `RemoteEnvPool` implements the same `EnvService` interface, so
the trainer talks to local and remote environments alike. Each request runs in a thread on the
server, so requests from many connections proceed in parallel, as they do on a local pool.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from typing import Any, Mapping

from jaxrl_agent.envs import api
from jaxrl_agent.envs.pool import EnvPool, EnvServiceError

_METHODS = ("reset", "step", "close_episode", "worker_pids", "episode_worker_pid", "stats", "num_workers",
            "ensure_workers")


def _dispatch(pool: EnvPool, method: str, params: Mapping[str, Any]):
    if method == "reset":
        episode_id, observation = pool.reset(params["env"], api.Task.from_dict(params["task"]),
                                             params.get("seed", 0), params.get("env_kwargs"))
        return {"episode_id": episode_id, "observation": observation.to_dict()}
    if method == "step":
        return pool.step(params["episode_id"], params["action"]).to_dict()
    if method == "close_episode":
        return pool.close_episode(params["episode_id"])
    if method == "worker_pids":
        return pool.worker_pids()
    if method == "episode_worker_pid":
        return pool.episode_worker_pid(params["episode_id"])
    if method == "stats":
        return dict(pool.stats)
    if method == "num_workers":
        return pool.num_workers
    if method == "ensure_workers":
        return pool.ensure_workers()
    raise EnvServiceError(f"unknown method {method!r}; expected one of {_METHODS}")


async def _handle_connection(pool: EnvPool, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    try:
        while line := await reader.readline():
            try:
                request = json.loads(line)
                result = await asyncio.to_thread(_dispatch, pool, request["method"], request.get("params", {}))
                reply = {"id": request.get("id"), "result": result}
            except Exception as err:  # noqa: BLE001 - a bad request gets an error reply, not a dead server
                reply = {"id": None, "error": f"{type(err).__name__}: {err}"}
            writer.write((json.dumps(reply, default=str) + "\n").encode())
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(pool: EnvPool, host: str = "127.0.0.1", port: int = 0, ready=None) -> None:
    """Serves `pool` until cancelled; `ready(port)` is called once listening (port 0 = any free)."""
    server = await asyncio.start_server(lambda r, w: _handle_connection(pool, r, w), host, port, limit=2**24)
    bound = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    async with server:
        await server.serve_forever()


class RemoteEnvPool:
    """Client of `launch/env_server.py`; thread-safe (a small pool of connections)."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 120.0):
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = 0
        self._lock = threading.Lock()

    def _connection(self):
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            try:
                sock = socket.create_connection(self.address, timeout=self.timeout_s)
            except OSError as err:
                raise EnvServiceError(f"cannot reach env server at {self.address}: {err}") from None
            return sock, sock.makefile("rb")

    def _call(self, method: str, **params):
        with self._lock:
            self._ids += 1
            request_id = self._ids
        sock, reader = self._connection()
        try:
            sock.sendall((json.dumps({"id": request_id, "method": method, "params": params}) + "\n").encode())
            line = reader.readline()
        except OSError as err:
            sock.close()
            raise EnvServiceError(f"env server {self.address} failed during {method}: {err}") from None
        if not line:
            sock.close()
            raise EnvServiceError(f"env server {self.address} closed the connection during {method}")
        self._idle.put((sock, reader))
        reply = json.loads(line)
        if "error" in reply:
            raise EnvServiceError(f"env server: {reply['error']}")
        return reply["result"]

    def reset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str, api.Observation]:
        result = self._call("reset", env=env, task=task.to_dict(), seed=seed, env_kwargs=dict(env_kwargs or {}))
        return result["episode_id"], api.Observation.from_dict(result["observation"])

    def step(self, episode_id: str, action: str) -> api.Step:
        return api.Step.from_dict(self._call("step", episode_id=episode_id, action=action))

    def close_episode(self, episode_id: str) -> None:
        self._call("close_episode", episode_id=episode_id)

    def worker_pids(self) -> list[int]:
        return self._call("worker_pids")

    def episode_worker_pid(self, episode_id: str) -> int:
        return self._call("episode_worker_pid", episode_id=episode_id)

    @property
    def stats(self) -> dict:
        return self._call("stats")

    @property
    def num_workers(self) -> int:
        return self._call("num_workers")

    def ensure_workers(self) -> None:
        self._call("ensure_workers")

    def close(self) -> None:
        while True:
            try:
                sock, _ = self._idle.get_nowait()
            except queue.Empty:
                return
            sock.close()


class RemoteEnvServices:
    """Several env servers as one `EnvService`: each new episode goes to the next server in turn
    (load-balanced by episode); a server that cannot start it is skipped for the next one (failover),
    and the reset fails only when every server did. An episode stays on its server: if that server
    dies, the episode's next step raises `EnvServiceError` (the rollout records it as 'env_crash')."""

    def __init__(self, addresses, *, timeout_s: float = 120.0):
        addresses = [tuple(a) for a in addresses]
        if not addresses:
            raise ValueError("RemoteEnvServices needs at least one (host, port)")
        self.servers = [RemoteEnvPool(host, int(port), timeout_s=timeout_s) for host, port in addresses]
        self._next = 0
        self._lock = threading.Lock()
        self.failovers = 0

    def _route(self, episode_id: str) -> tuple[RemoteEnvPool, str]:
        index, sep, inner = episode_id.partition(":")
        if not sep or not index.isdigit() or int(index) >= len(self.servers):
            raise EnvServiceError(f"episode id {episode_id!r} names no server of this service")
        return self.servers[int(index)], inner

    def reset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str, api.Observation]:
        with self._lock:
            first = self._next
            self._next = (self._next + 1) % len(self.servers)
        errors = []
        for k in range(len(self.servers)):
            index = (first + k) % len(self.servers)
            try:
                episode_id, observation = self.servers[index].reset(env, task, seed, env_kwargs)
                return f"{index}:{episode_id}", observation
            except EnvServiceError as err:
                errors.append(f"{self.servers[index].address}: {err}")
                with self._lock:
                    self.failovers += 1
        raise EnvServiceError(f"no env server could start {task.id!r}: {errors}")

    @property
    def stats(self) -> dict:
        """The servers' pool counters summed over the servers that answer, plus failovers."""
        total: dict = {"failovers": self.failovers}
        for server in self.servers:
            try:
                for key, value in server.stats.items():
                    total[key] = total.get(key, 0) + value
            except EnvServiceError:
                total["unreachable_servers"] = total.get("unreachable_servers", 0) + 1
        return total

    def step(self, episode_id: str, action: str) -> api.Step:
        server, inner = self._route(episode_id)
        return server.step(inner, action)

    def close_episode(self, episode_id: str) -> None:
        server, inner = self._route(episode_id)
        server.close_episode(inner)

    def close(self) -> None:
        for server in self.servers:
            server.close()
