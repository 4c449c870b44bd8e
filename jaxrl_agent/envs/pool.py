"""The environment service: environments in worker processes, isolated from the trainer and each other.

`EnvPool(num_workers)` runs episodes in worker processes (`python -m jaxrl_agent.envs.worker`; no
JAX in them). Each call has
a timeout. When a worker hangs (timeout), crashes (dies, or runs out of memory under its address
space limit) the pool kills it and starts a replacement: the episode whose call was in flight ends
with `finish_reason="env_timeout"` or `"env_crash"`, and the other episodes the worker held are
rebuilt on the replacement by replaying their actions — environments are deterministic in
(task, seed, actions) — so no other episode is affected. An exception raised by an environment's
own code ends that episode with `"env_error"` and leaves the worker running.

On an event loop (`areset` / `astep` / `aclose_episode`, what the rollout awaits) the requests of
the loop's coroutines for one worker go out in batches: those that arrive while a batch is out are
written together as the next one, and its replies come back in order — one pipe write, one wakeup
of the worker and a few of the loop for many calls. Each request still has its own timeout
(counted from the previous reply). A worker that dies or hangs mid-batch ends only the episode whose
request it was serving; the requests after it never ran and are sent again to its replacement.

`EnvService` is the interface the trainer uses; `EnvPool` (local) and `RemoteEnvPool`
(`jaxrl_agent.envs.remote`, over TCP to `launch/env_server.py`) both implement it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Generator, Mapping, Protocol, Sequence

from jaxrl_agent.envs import api


class EnvService(Protocol):
    """What the rollout layer needs from an environment service (local or remote). A service may
    also offer `areset` / `astep` / `aclose_episode`, the same calls as coroutines for an event
    loop (`EnvPool` does: no thread per call); `rollout.ServiceEnv` uses them where they exist."""

    def reset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str, api.Observation]: ...

    def step(self, episode_id: str, action: str) -> api.Step: ...

    def close_episode(self, episode_id: str) -> None: ...

    def close(self) -> None: ...


class EnvServiceError(RuntimeError):
    """A request the service cannot serve (unknown episode, bad environment name, closed pool)."""


# ------------------------------------------------------------------------------------ parent side
@dataclasses.dataclass
class _Episode:
    env: str
    env_kwargs: dict
    task: api.Task
    seed: int
    imports: tuple[str, ...]
    worker: int
    actions: list[str] = dataclasses.field(default_factory=list)
    needs_replay: bool = False


class _WorkerDied(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Requeue(Exception):
    """A request of a batch that its worker never served (it died or hung on an earlier one, or was
    found dead before the batch went out): the call sends it again, to the replacement."""


# Bytes read from a worker's stdout at a time.
_READ_CHUNK = 1 << 16
# A batch written from the event loop goes into the worker's empty stdin pipe (it has read every
# earlier request: it replied to them) in one write of at most the pipe's capacity, so the write never
# blocks; a request longer than that goes alone, written on a thread. Linux reports the capacity
# (F_GETPIPE_SZ); elsewhere a pipe holds at least one page.
_MIN_PIPE_CAPACITY = 4096
_F_GETPIPE_SZ = 1032


class _Worker:
    """One `python -m jaxrl_agent.envs.worker` process, spoken to in JSON lines over its stdin/stdout.

    A plain subprocess (not multiprocessing): nothing of the parent — JAX threads, the caller's
    `__main__` — is inherited or re-imported. One caller at a time (the pool's slot lock): a thread's
    request is written and its reply read (`call`), or an event loop's batch (`_Batches`)."""

    def __init__(self, memory_mb, imports):
        args = [sys.executable, "-m", "jaxrl_agent.envs.worker", "--parent_pid", str(os.getpid())]
        if memory_mb:
            args += ["--memory_mb", str(memory_mb)]
        for module in imports:
            args += ["--import", module]
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                        env=_worker_env())
        self._buffer = bytearray()  # bytes of the reply being read
        self.pipe_capacity = _MIN_PIPE_CAPACITY
        try:
            import fcntl

            self.pipe_capacity = max(_MIN_PIPE_CAPACITY, fcntl.fcntl(self.process.stdin.fileno(), _F_GETPIPE_SZ))
        except (ImportError, OSError):
            pass

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def _take_line(self) -> bytes | None:
        end = self._buffer.find(b"\n")
        if end < 0:
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        return line

    def _read_some(self) -> None:
        """One read of what the worker wrote; raises _WorkerDied('env_crash') at its end."""
        chunk = os.read(self.process.stdout.fileno(), _READ_CHUNK)
        if not chunk:
            raise _WorkerDied("env_crash")
        self._buffer += chunk

    def call(self, request: dict, timeout: float) -> dict:
        """Sends a request and waits; raises _WorkerDied('env_timeout' | 'env_crash')."""
        data = (json.dumps(request) + "\n").encode()
        deadline = time.monotonic() + timeout
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.process.stdin.fileno(), view):]
            while (line := self._take_line()) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self.process.stdout], [], [], remaining)[0]:
                    raise _WorkerDied("env_timeout")
                self._read_some()
        except (OSError, ValueError):
            raise _WorkerDied("env_crash") from None
        return json.loads(line)

    def kill(self, close_stdout: bool = True):
        """Ends the process and closes its pipes; `close_stdout=False` leaves its stdout to a caller
        still reading it (it reads the end of the stream, then replaces the worker)."""
        if self.alive():
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdin, self.process.stdout) if close_stdout else (self.process.stdin,):
            try:
                stream.close()
            except OSError:
                pass


@dataclasses.dataclass(frozen=True)
class _Finished:
    value: Any  # what the pool's operation returned


def _resume(operation: Generator, outcome):
    """Resumes one of the pool's operations with the last call's outcome (its reply, the
    _WorkerDied or _Requeue it raised — thrown in —, or None to start it): what it yields next (a
    slot, or a request), or _Finished with what it returned."""
    try:
        return operation.throw(outcome) if isinstance(outcome, (_WorkerDied, _Requeue)) else operation.send(outcome)
    except StopIteration as stop:
        return _Finished(stop.value)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Batches:
    """One event loop's requests for one worker slot of a pool, written in batches.

    `submit(request)` queues a request and returns a future of its reply line. While a batch is out,
    new requests wait; when its last reply is in, they go out together as the next batch (one write,
    at most the pipe's capacity; the slot's thread lock held meanwhile, so threads calling the same
    worker take turns with whole batches). Replies come back in order and each resolves its future
    as it is read. A request has `timeout` seconds from the previous reply (or the write). When the
    worker dies or overruns a timeout, the pool replaces it (its episodes to be replayed); the request
    it was serving gets the _WorkerDied, the ones after it _Requeue. A worker found dead before a
    batch is written is replaced the same way and the whole batch gets _Requeue. Every request is
    written even when its caller has gone (cancelled): the caller's operation undoes what it must."""

    def __init__(self, pool: "EnvPool", index: int):
        self.pool, self.index = pool, index
        self.queue: collections.deque = collections.deque()  # (line, future), not yet written
        self.running = False

    def submit(self, request: dict) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.append(((json.dumps(request) + "\n").encode(), future))
        if not self.running:
            self.running = True
            loop.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        try:
            while self.queue:
                await self._next_batch()
        except BaseException as err:  # noqa: BLE001 - no caller may wait forever
            _fail_all(self.queue, EnvServiceError(f"env pool: batch failed: {err!r}"))
            if not isinstance(err, Exception):
                raise
        finally:
            self.running = False

    async def _next_batch(self) -> None:
        pool, index = self.pool, self.index
        lock = pool._slot_locks[index]
        if not lock.acquire(blocking=False):
            taken = asyncio.ensure_future(asyncio.to_thread(lock.acquire))
            try:
                await asyncio.shield(taken)
            except asyncio.CancelledError:
                taken.add_done_callback(lambda _: lock.release())  # taken for no one: give it back
                raise
        try:
            if pool._closed:
                _fail_all(self.queue, EnvServiceError("the pool is closed"))
                return
            worker = pool._workers[index]
            batch, data, size = [], [], 0
            while self.queue and (not batch or size + len(self.queue[0][0]) <= worker.pipe_capacity):
                line, future = self.queue.popleft()
                batch.append(future)
                data.append(line)
                size += len(line)
            try:
                if not worker.alive():  # died while idle: nothing of this batch ran
                    pool._replace(index, "env_crash")
                    _fail(batch, None)
                    return
                await self._exchange(worker, b"".join(data), collections.deque(batch))
            except BaseException as err:  # noqa: BLE001 - no caller of the batch may wait forever
                for future in batch:
                    if not future.done():
                        future.set_exception(EnvServiceError(f"env pool: batch failed: {err!r}"))
                raise
        finally:
            lock.release()

    async def _exchange(self, worker: _Worker, data: bytes, in_flight: collections.deque) -> None:
        """Writes the batch and resolves its futures from the replies, in order."""
        pool, loop, timeout = self.pool, asyncio.get_running_loop(), self.pool.step_timeout_s
        try:
            if len(data) > worker.pipe_capacity:  # one long request: a blocking write, on a thread
                await asyncio.to_thread(_write_all, worker.process.stdin.fileno(), data)
            else:
                os.write(worker.process.stdin.fileno(), data)
        except (OSError, ValueError):  # gone before reading any of it: nothing ran
            pool._replace(self.index, "env_crash")
            _fail(in_flight, None)
            return
        died = await self._replies(worker, in_flight, loop, timeout)
        if died is not None:
            pool._replace(self.index, died.reason)
            _fail(in_flight, died)

    @staticmethod
    async def _replies(worker: _Worker, in_flight: collections.deque, loop, timeout: float) -> _WorkerDied | None:
        finished = loop.create_future()
        deadline = time.monotonic() + timeout
        out = worker.process.stdout.fileno()

        def readable() -> None:
            nonlocal deadline
            if finished.done():
                return
            try:
                worker._read_some()
            except (_WorkerDied, OSError, ValueError):
                finished.set_result(_WorkerDied("env_crash"))
                return
            while in_flight and (line := worker._take_line()) is not None:
                future = in_flight.popleft()
                if not future.done():  # a cancelled caller's reply is dropped
                    future.set_result(line)
                deadline = time.monotonic() + timeout
            if not in_flight:
                finished.set_result(None)

        def check() -> None:
            nonlocal timer
            if finished.done():
                return
            remaining = deadline - time.monotonic()
            if remaining > 0:
                timer = loop.call_later(remaining, check)
            else:
                finished.set_result(_WorkerDied("env_timeout"))

        loop.add_reader(out, readable)
        timer = loop.call_later(timeout, check)
        try:
            return await finished
        finally:
            timer.cancel()
            loop.remove_reader(out)


def _fail_all(queue: collections.deque, err: Exception) -> None:
    while queue:
        _, future = queue.popleft()
        if not future.done():
            future.set_exception(err)


def _fail(futures, died: _WorkerDied | None) -> None:
    """The first of `futures` gets `died` (None: it too never ran), the rest _Requeue."""
    for k, future in enumerate(futures):
        if not future.done():
            future.set_exception(died if k == 0 and died is not None else _Requeue())


def _worker_env() -> dict:
    env = dict(os.environ)
    # The worker must import this package even when it is not installed (a source checkout).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class EnvPool:
    """Environments in `num_workers` processes with per-call timeouts and crash isolation.

    Thread-safe: calls on episodes held by different workers run in parallel.

    Args:
      num_workers: worker processes; the pool keeps this many alive.
      step_timeout_s: longest a `step` (or `reset`) may take before the worker is replaced.
      worker_memory_mb: address-space limit of each worker (None: no limit).
      imports: modules every worker imports at start (where your `register(...)` calls live).
    """

    def __init__(self, num_workers: int = 2, *, step_timeout_s: float = 30.0, worker_memory_mb: int | None = 4096,
                 imports: Sequence[str] = ()):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.step_timeout_s = step_timeout_s
        self._memory_mb = worker_memory_mb
        self._imports = tuple(imports)
        self._workers = [_Worker(worker_memory_mb, self._imports) for _ in range(num_workers)]
        # One lock per worker slot, not per process: a replacement process keeps its slot's lock, so a
        # thread that waited on the slot while the process was replaced never shares the new one.
        self._slot_locks = [threading.Lock() for _ in range(num_workers)]
        # Each event loop's requests for a slot go out in batches (`_Batches`, one per loop and slot).
        self._loop_batches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self.stats = {"worker_restarts": 0, "env_timeout": 0, "env_crash": 0, "env_error": 0, "replays": 0}

    # -------------------------------------------------------------------------- helpers
    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def episode_worker_pid(self, episode_id: str) -> int:
        """The pid of the worker process holding an episode (for operations and fault tests)."""
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise EnvServiceError(f"unknown or finished episode {episode_id!r}")
        return self._workers[ep.worker].pid

    def _check_open(self):
        if self._closed:
            raise EnvServiceError("the pool is closed")

    def _replace(self, index: int, reason: str) -> None:
        """Kills worker `index`, starts a new one (not once the pool is closed), and marks its
        episodes for replay. Only the holder of the slot's lock calls it."""
        self._workers[index].kill()
        if self._closed:
            return
        self._workers[index] = _Worker(self._memory_mb, self._imports)
        self.stats["worker_restarts"] += 1
        self.stats[reason] += 1
        with self._lock:
            for episode in self._episodes.values():
                if episode.worker == index:
                    episode.needs_replay = True

    def _reset_request(self, episode_id: str, ep: _Episode, replay: Sequence[str] = ()) -> dict:
        return {"op": "reset", "episode": episode_id, "env": ep.env, "env_kwargs": ep.env_kwargs,
                "task": ep.task.to_dict(), "seed": ep.seed, "imports": ep.imports, "replay": list(replay)}

    def _failed_step(self, episode_id: str, reason: str, detail: str) -> api.Step:
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
        info = {"finish_reason": reason, "success": False, "error": detail,
                "turns": len(ep.actions) if ep else 0, "reward_components": {}}
        return api.Step(api.Observation(""), 0.0, True, info)

    # -------------------------------------------------------------------------- the service
    # Each call is written once, as a generator: it yields the worker slot it needs, then each
    # request for that slot's worker, receiving the reply (or, thrown in, the _WorkerDied that ended
    # it — the worker already replaced — or _Requeue: not served, to be sent again), and returns the
    # call's result. `_run` drives it with blocking calls on the caller's thread (the slot's lock
    # held throughout), `_arun` on the event loop (through the slot's `_Batches`); a coroutine that
    # is cancelled closes it (GeneratorExit at its request).
    def _run(self, operation: Generator):
        index = _resume(operation, None)
        if isinstance(index, _Finished):
            return index.value
        with self._slot_locks[index]:
            if not self._workers[index].alive():  # died while idle: its episodes are replayed
                self._replace(index, "env_crash")
            outcome = None
            while not isinstance(request := _resume(operation, outcome), _Finished):
                try:
                    outcome = self._workers[index].call(request, self.step_timeout_s)
                except _WorkerDied as died:
                    self._replace(index, died.reason)
                    outcome = died
            return request.value

    async def _arun(self, operation: Generator):
        index = _resume(operation, None)
        if isinstance(index, _Finished):
            return index.value
        batches = self._loop_batches.setdefault(asyncio.get_running_loop(), {})
        if index not in batches:
            batches[index] = _Batches(self, index)
        outcome = None
        while not isinstance(request := _resume(operation, outcome), _Finished):
            try:
                outcome = json.loads(await batches[index].submit(request))
            except (_WorkerDied, _Requeue) as err:
                outcome = err
            except asyncio.CancelledError:
                operation.close()
                raise
        return request.value

    def _reset_op(self, env: str, task: api.Task, seed: int, env_kwargs: Mapping[str, Any] | None):
        self._check_open()
        factory_module = api.factory_module(env)
        imports = (factory_module,) if factory_module and factory_module != "__main__" else ()
        with self._lock:
            loads = [0] * len(self._workers)
            for episode in self._episodes.values():
                loads[episode.worker] += 1
            index = loads.index(min(loads))
            episode_id = f"ep{next(self._ids)}"
            ep = _Episode(env, dict(env_kwargs or {}), task, seed, imports, index)
            self._episodes[episode_id] = ep
        yield index
        while True:
            try:
                reply = yield self._reset_request(episode_id, ep)
            except _Requeue:
                continue
            except _WorkerDied as died:
                with self._lock:
                    self._episodes.pop(episode_id, None)
                raise EnvServiceError(f"reset of {task.id!r} on {env!r} failed: {died.reason}") from None
            except GeneratorExit:  # cancelled: no one will know the episode (its worker keeps it until replaced)
                with self._lock:
                    self._episodes.pop(episode_id, None)
                raise
            break
        if "error" in reply:
            with self._lock:
                self._episodes.pop(episode_id, None)
            raise EnvServiceError(f"reset of {task.id!r} on {env!r} failed: {reply['error']}")
        ep.needs_replay = False  # the worker holds it now (a replacement meanwhile marked it)
        return episode_id, api.Observation.from_dict(reply["ok"])

    def _step_op(self, episode_id: str, action: str):
        self._check_open()
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise EnvServiceError(f"unknown or finished episode {episode_id!r}")
        yield ep.worker
        while True:
            try:
                if ep.needs_replay:  # its worker was replaced: rebuild it from its actions first
                    self.stats["replays"] += 1
                    reply = yield self._reset_request(episode_id, ep, ep.actions)
                    if "error" in reply:
                        self.stats["env_crash"] += 1
                        return self._failed_step(episode_id, "env_crash", f"replay failed: {reply['error']}")
                    ep.needs_replay = False
                reply = yield {"op": "step", "episode": episode_id, "action": action}
            except _Requeue:
                continue
            except _WorkerDied as died:
                return self._failed_step(episode_id, died.reason, f"worker {died.reason} during step")
            except GeneratorExit:  # cancelled: the worker may apply the action; rebuild from the record
                ep.needs_replay = True
                raise
            break
        if "error" in reply:
            if reply.get("kind") == "env":
                self.stats["env_error"] += 1
                return self._failed_step(episode_id, "env_error", reply["error"])
            raise EnvServiceError(reply["error"])
        ep.actions.append(action)
        step = api.Step.from_dict(reply["ok"])
        if step.done:
            with self._lock:
                self._episodes.pop(episode_id, None)
        return step

    def _close_op(self, episode_id: str):
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
        if ep is None:  # finished (a done step closed it in the worker) or never opened: nothing to send
            return
        yield ep.worker
        try:
            yield {"op": "close", "episode": episode_id}
        except (_Requeue, _WorkerDied):
            pass  # its worker was replaced: the replacement never held it

    def reset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str, api.Observation]:
        """Starts an episode on the least-loaded worker; returns (episode id, first observation)."""
        return self._run(self._reset_op(env, task, seed, env_kwargs))

    def step(self, episode_id: str, action: str) -> api.Step:
        """Applies an action. Never raises for environment failures: they end the episode with a
        `finish_reason` of 'env_timeout', 'env_crash' or 'env_error' in `info`."""
        return self._run(self._step_op(episode_id, action))

    def close_episode(self, episode_id: str) -> None:
        self._run(self._close_op(episode_id))

    async def areset(self, env: str, task: api.Task, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
                     ) -> tuple[str, api.Observation]:
        """`reset` as a coroutine of the running event loop (no thread per call)."""
        return await self._arun(self._reset_op(env, task, seed, env_kwargs))

    async def astep(self, episode_id: str, action: str) -> api.Step:
        """`step` as a coroutine of the running event loop (no thread per call)."""
        return await self._arun(self._step_op(episode_id, action))

    async def aclose_episode(self, episode_id: str) -> None:
        """`close_episode` as a coroutine; for a finished episode it sends nothing."""
        await self._arun(self._close_op(episode_id))

    def ensure_workers(self) -> None:
        """Replaces workers that died while idle (e.g. killed from outside)."""
        for index in range(len(self._workers)):
            if not self._workers[index].alive():
                with self._slot_locks[index]:
                    if not self._workers[index].alive():  # not already replaced by a thread that held the slot
                        self._replace(index, "env_crash")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for index, worker in enumerate(self._workers):
            try:
                worker.process.stdin.close()  # the worker exits at end of input
                worker.process.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            # A call in flight (a thread's, or an event loop's batch, holding the slot) reads the
            # end of the worker's output at once and ends; its stdout is left for it to close.
            idle = self._slot_locks[index].acquire(blocking=False)
            try:
                worker.kill(close_stdout=idle)
            finally:
                if idle:
                    self._slot_locks[index].release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Polls `predicate` until true or `timeout` seconds pass (test and ops helper)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
