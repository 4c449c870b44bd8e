"""The environment service over the network: `serve(pool, host, port, token=...)` and `RemoteEnvPool`.

One JSON object per line over TCP (no pickle: nothing a peer sends is executed). The server runs an
`EnvPool` (`jaxrl-agent env-server`); `RemoteEnvPool` implements the same `EnvService` interface,
so the trainer talks to local and remote environments alike. Each request runs in a thread on the
server, so requests from many connections proceed in parallel, as they do on a local pool.

Rules the server enforces:
  * every request carries the shared token (`jaxrl_agent.auth`); one without it gets an error
    reply and the connection is closed;
  * episode ids are random 128-bit strings scoped to the connection that opened the episode: another
    connection cannot step or close it, and a connection's episodes are closed when it closes;
  * at most `max_connections` connections; one idle for `idle_timeout_s` is closed; a request
    running longer than `request_timeout_s` gets an error reply; requests run on the server's own
    `request_threads` threads, so hanging steps hold only their own;
  * a line over `MAX_LINE_BYTES` or one that is not a JSON request gets an error reply and the
    connection goes on (an over-long line is read through its newline and dropped, up to
    `MAX_DISCARD_BYTES`; past that the connection is closed);
  * given an `ssl_context` (`jaxrl-agent env-server --tls_cert_file/--tls_key_file`), TLS only;
    trainers then connect with `env.tls_ca_file`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import socket
import threading
from typing import Any, Mapping

from jaxrl_agent import auth
from jaxrl_agent.envs import api
from jaxrl_agent.envs.pool import EnvPool, EnvServiceError

_METHODS = ("reset", "step", "close_episode", "worker_pids", "episode_worker_pid", "stats", "num_workers",
            "ensure_workers")
MAX_LINE_BYTES = 16 * 2**20
# An over-long request line is read through to its newline and dropped, so that the error reply
# reaches the client (closing a socket with unread bytes sends a reset, which loses the reply) and
# the connection stays in step. A line still going past this many bytes closes the connection.
MAX_DISCARD_BYTES = 256 * 2**20


class _OverlongLine(Exception):
    """A request line over the reader's limit; `dropped`: its bytes, read and thrown away;
    `complete`: whether its newline was reached (the connection is still in step)."""

    def __init__(self, dropped: int, complete: bool):
        super().__init__(dropped, complete)
        self.dropped, self.complete = dropped, complete


async def _read_line(reader: asyncio.StreamReader, max_discard: int = MAX_DISCARD_BYTES) -> bytes:
    """The next line (b'' at end of stream; a last line without a newline as it is). A line over the
    reader's limit raises `_OverlongLine` after it has been read through its newline and dropped, or
    after `max_discard` bytes of it or the end of the stream (then `complete` is False)."""
    dropped = 0  # bytes of an over-long line read and thrown away so far
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as err:  # the end of the stream
            if not dropped:
                return err.partial
            raise _OverlongLine(dropped + len(err.partial), complete=False) from None
        except asyncio.LimitOverrunError as err:  # err.consumed bytes of the line are in the buffer
            dropped += len(await reader.readexactly(err.consumed))
            if dropped > max_discard:
                raise _OverlongLine(dropped, complete=False) from None
            continue
        if not dropped:
            return line
        raise _OverlongLine(dropped + len(line), complete=True)


class _Connection:
    """One client connection's episodes: public id -> the pool's id."""

    def __init__(self):
        self.episodes: dict[str, str] = {}

    def pool_id(self, params: Mapping[str, Any]) -> str:
        public = params.get("episode_id")
        if not isinstance(public, str) or public not in self.episodes:
            raise EnvServiceError(f"unknown episode {public!r} on this connection (an episode belongs to the "
                                  "connection that opened it)")
        return self.episodes[public]


def _dispatch(pool: EnvPool, connection: _Connection, method: str, params: Mapping[str, Any]):
    if not isinstance(params, Mapping):
        raise EnvServiceError(f"params must be a JSON object, got {type(params).__name__}")
    if method == "reset":
        pool_id, observation = pool.reset(params["env"], api.Task.from_dict(params["task"]),
                                          params.get("seed", 0), params.get("env_kwargs"))
        public = secrets.token_hex(16)
        connection.episodes[public] = pool_id
        return {"episode_id": public, "observation": observation.to_dict()}
    if method == "step":
        return pool.step(connection.pool_id(params), params["action"]).to_dict()
    if method == "close_episode":
        pool_id = connection.pool_id(params)
        del connection.episodes[params["episode_id"]]
        return pool.close_episode(pool_id)
    if method == "worker_pids":
        return pool.worker_pids()
    if method == "episode_worker_pid":
        return pool.episode_worker_pid(connection.pool_id(params))
    if method == "stats":
        return dict(pool.stats)
    if method == "num_workers":
        return pool.num_workers
    if method == "ensure_workers":
        return pool.ensure_workers()
    raise EnvServiceError(f"unknown method {method!r}; expected one of {_METHODS}")


class _Server:
    def __init__(self, pool: EnvPool, token: str, *, max_connections: int, idle_timeout_s: float,
                 request_timeout_s: float, request_threads: int):
        import concurrent.futures

        self.pool, self.token = pool, token
        # Requests run here, not in asyncio's default executor (min(32, cores + 4) threads): a few
        # hanging steps must not hold every thread while other clients' requests wait.
        self.executor = concurrent.futures.ThreadPoolExecutor(request_threads, thread_name_prefix="env-request")
        self.max_connections, self.idle_timeout_s, self.request_timeout_s = (
            max_connections, idle_timeout_s, request_timeout_s)
        self.connections = 0
        self.stats = {"unauthenticated": 0, "refused_connections": 0, "idle_closed": 0, "bad_requests": 0,
                      "oversize": 0, "deadline_exceeded": 0}

    async def _reply(self, writer, request_id, *, result=None, error: str | None = None) -> None:
        reply = {"id": request_id, "error": error} if error is not None else {"id": request_id, "result": result}
        writer.write((json.dumps(reply, default=str) + "\n").encode())
        await writer.drain()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            self.stats["refused_connections"] += 1
            try:
                await self._reply(writer, None, error=f"too many connections (limit {self.max_connections})")
            except ConnectionError:
                pass
            writer.close()
            return
        self.connections += 1
        connection = _Connection()
        try:
            while True:
                try:
                    line = await asyncio.wait_for(_read_line(reader), self.idle_timeout_s)
                except asyncio.TimeoutError:
                    self.stats["idle_closed"] += 1
                    break
                except _OverlongLine as err:  # read through and dropped: the reply reaches the client
                    self.stats["oversize"] += 1
                    await self._reply(writer, None, error=f"request over {MAX_LINE_BYTES} bytes (dropped "
                                                          f"{err.dropped} bytes of it)")
                    if err.complete:
                        continue
                    break
                if not line:
                    break
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict) or not isinstance(request.get("method"), str):
                        raise ValueError("expected a JSON object with a 'method'")
                except ValueError as err:
                    self.stats["bad_requests"] += 1
                    await self._reply(writer, None, error=f"bad request: {err}")
                    continue
                request_id = request.get("id")
                if not auth.matches(request.get("token"), self.token):
                    self.stats["unauthenticated"] += 1
                    await self._reply(writer, request_id, error="unauthenticated: the request's token does not "
                                                                 "match the server's")
                    break
                try:
                    result = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                        self.executor, _dispatch, self.pool, connection, request["method"], request.get("params", {})),
                        self.request_timeout_s)
                except asyncio.TimeoutError:
                    self.stats["deadline_exceeded"] += 1
                    await self._reply(writer, request_id, error=f"deadline exceeded ({self.request_timeout_s} s)")
                    continue
                except Exception as err:  # noqa: BLE001 - a bad request gets an error reply, not a dead server
                    await self._reply(writer, request_id, error=f"{type(err).__name__}: {err}")
                    continue
                await self._reply(writer, request_id, result=result)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections -= 1
            for pool_id in connection.episodes.values():  # the connection's episodes end with it
                try:
                    await asyncio.to_thread(self.pool.close_episode, pool_id)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            writer.close()


async def serve(pool: EnvPool, host: str = "127.0.0.1", port: int = 0, ready=None, *, token: str,
                max_connections: int = 1024, idle_timeout_s: float = 600.0, request_timeout_s: float = 300.0,
                ssl_context=None, request_threads: int = 256) -> None:
    """Serves `pool` until cancelled; `ready(port)` is called once listening (port 0 = any free).
    `ssl_context` (`auth.server_ssl_context`): serve TLS only. `request_threads`: requests that run
    at once (each waits on its episode's worker; the rest queue)."""
    if not token:
        raise auth.AuthError("the env server needs a token (jaxrl_agent.auth)")
    if request_threads < 1:
        raise ValueError(f"request_threads={request_threads}: expected >= 1")
    server = _Server(pool, token, max_connections=max_connections, idle_timeout_s=idle_timeout_s,
                     request_timeout_s=request_timeout_s, request_threads=request_threads)
    listener = await asyncio.start_server(server.handle, host, port, limit=MAX_LINE_BYTES, ssl=ssl_context,
                                          ssl_handshake_timeout=min(60.0, idle_timeout_s) if ssl_context else None)
    bound = listener.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    try:
        async with listener:
            await listener.serve_forever()
    finally:
        server.executor.shutdown(wait=False, cancel_futures=True)


def _close(connection) -> None:
    """Closes a (socket, reader) pair: the descriptor stays open while either holds it."""
    sock, reader = connection
    reader.close()
    sock.close()


class RemoteEnvPool:
    """Client of `jaxrl-agent env-server`; thread-safe. An episode keeps the connection that opened
    it until it is closed (the server scopes episodes to connections); other calls use any idle one.
    `token`: the server's (default: `auth.load_token()`). `tls_ca_file`: connect over TLS, trusting
    only that CA's certificates for `host` ('' or None = plain TCP)."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 120.0, token: str | None = None,
                 tls_ca_file: str | None = None):
        self.address = (host, port)
        self.timeout_s = timeout_s
        self.token = token or auth.load_token()
        self._tls = auth.client_ssl_context(tls_ca_file) if tls_ca_file else None
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._episodes: dict[str, tuple] = {}
        self._ids = 0
        self._lock = threading.Lock()

    def _connection(self):
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            try:
                sock = socket.create_connection(self.address, timeout=self.timeout_s)
                if self._tls is not None:
                    try:
                        sock = self._tls.wrap_socket(sock, server_hostname=self.address[0])
                    except OSError:
                        sock.close()
                        raise
            except OSError as err:
                raise EnvServiceError(f"cannot reach env server at {self.address}: {err}") from None
            return sock, sock.makefile("rb")

    def _call(self, method: str, connection=None, **params):
        with self._lock:
            self._ids += 1
            request_id = self._ids
        own = connection is None
        request = (json.dumps({"id": request_id, "method": method, "params": params, "token": self.token})
                   + "\n").encode()
        if len(request) > MAX_LINE_BYTES:
            raise EnvServiceError(f"{method} request of {len(request)} bytes: the env server takes requests of at "
                                  f"most {MAX_LINE_BYTES} bytes")
        sock, reader = connection or self._connection()
        try:
            sock.sendall(request)
            line = reader.readline()
        except OSError as err:
            _close((sock, reader))
            raise EnvServiceError(f"env server {self.address} failed during {method}: {err}") from None
        if not line:
            _close((sock, reader))
            raise EnvServiceError(f"env server {self.address} closed the connection during {method}")
        if own:
            self._idle.put((sock, reader))
        reply = json.loads(line)
        if reply.get("error") is not None:
            raise EnvServiceError(f"env server: {reply['error']}")
        return reply["result"]

    def reset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str, api.Observation]:
        connection = self._connection()
        try:
            result = self._call("reset", connection, env=env, task=task.to_dict(), seed=seed,
                                env_kwargs=dict(env_kwargs or {}))
        except EnvServiceError:
            _close(connection)
            raise
        with self._lock:
            self._episodes[result["episode_id"]] = connection
        return result["episode_id"], api.Observation.from_dict(result["observation"])

    def _episode_connection(self, episode_id: str):
        with self._lock:
            connection = self._episodes.get(episode_id)
        if connection is None:
            raise EnvServiceError(f"unknown episode {episode_id!r} (not opened by this client, or closed)")
        return connection

    def step(self, episode_id: str, action: str) -> api.Step:
        return api.Step.from_dict(self._call("step", self._episode_connection(episode_id), episode_id=episode_id,
                                             action=action))

    def close_episode(self, episode_id: str) -> None:
        connection = self._episode_connection(episode_id)
        try:
            self._call("close_episode", connection, episode_id=episode_id)
        finally:
            with self._lock:
                self._episodes.pop(episode_id, None)
        self._idle.put(connection)

    def worker_pids(self) -> list[int]:
        return self._call("worker_pids")

    def episode_worker_pid(self, episode_id: str) -> int:
        return self._call("episode_worker_pid", self._episode_connection(episode_id), episode_id=episode_id)

    @property
    def stats(self) -> dict:
        return self._call("stats")

    @property
    def num_workers(self) -> int:
        return self._call("num_workers")

    def ensure_workers(self) -> None:
        self._call("ensure_workers")

    def close(self) -> None:
        with self._lock:
            held, self._episodes = list(self._episodes.values()), {}
        for connection in held:  # the server closes these connections' episodes
            _close(connection)
        while True:
            try:
                _close(self._idle.get_nowait())
            except queue.Empty:
                return


class RemoteEnvServices:
    """Several env servers as one `EnvService`: each new episode goes to the next server in turn
    (load-balanced by episode); a server that cannot start it is skipped for the next one (failover),
    and the reset fails only when every server did. An episode stays on its server: if that server
    dies, the episode's next step raises `EnvServiceError` (the rollout records it as 'env_crash')."""

    def __init__(self, addresses, *, timeout_s: float = 120.0, tls_ca_file: str | None = None):
        addresses = [tuple(a) for a in addresses]
        if not addresses:
            raise ValueError("RemoteEnvServices needs at least one (host, port)")
        self.servers = [RemoteEnvPool(host, int(port), timeout_s=timeout_s, tls_ca_file=tls_ca_file)
                        for host, port in addresses]
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
