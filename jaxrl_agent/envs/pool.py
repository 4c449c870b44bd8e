"""The environment service: environments in worker processes, isolated from the trainer and each other.

`EnvPool(num_workers)` runs episodes in worker processes (`python -m jaxrl_agent.envs.worker`; no
JAX in them). Each call has
a timeout. When a worker hangs (timeout), crashes (dies, or runs out of memory under its address
space limit) the pool kills it and starts a replacement: the episode whose call was in flight ends
with `finish_reason="env_timeout"` or `"env_crash"`, and the other episodes the worker held are
rebuilt on the replacement by replaying their actions — environments are deterministic in
(task, seed, actions) — so no other episode is affected. An exception raised by an environment's
own code ends that episode with `"env_error"` and leaves the worker running.

`EnvService` is the interface the trainer uses; `EnvPool` (local) and `RemoteEnvPool`
(`jaxrl_agent.envs.remote`, over TCP to `launch/env_server.py`) both implement it.
"""

from __future__ import annotations

import asyncio
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


# Bytes read from a worker's stdout at a time.
_READ_CHUNK = 1 << 16
# Requests up to this size are written from the event loop (`_Worker.acall`): at most one request is
# in a worker's stdin pipe at a time, and a pipe holds at least one page, so such a write never
# blocks; longer ones are written on a thread.
_LOOP_WRITE_LIMIT = 4096


class _Worker:
    """One `python -m jaxrl_agent.envs.worker` process, spoken to in JSON lines over its stdin/stdout.

    A plain subprocess (not multiprocessing): nothing of the parent — JAX threads, the caller's
    `__main__` — is inherited or re-imported. One call at a time (the pool's slot lock): a request
    is written, then its reply read, from a blocking thread (`call`) or the event loop (`acall`)."""

    def __init__(self, memory_mb, imports):
        args = [sys.executable, "-m", "jaxrl_agent.envs.worker", "--parent_pid", str(os.getpid())]
        if memory_mb:
            args += ["--memory_mb", str(memory_mb)]
        for module in imports:
            args += ["--import", module]
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                        env=_worker_env())
        self._buffer = bytearray()  # bytes of the reply being read

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

    async def acall(self, request: dict, timeout: float) -> dict:
        """`call` on the running event loop: the request written and the reply read as the worker's
        stdout becomes readable (`loop.add_reader`), no thread in between. A call cancelled while
        its request is out leaves the worker's replies out of step with its requests, so the
        worker is killed (the pool replaces it and replays its other episodes)."""
        data = (json.dumps(request) + "\n").encode()
        if len(data) > _LOOP_WRITE_LIMIT:  # may not fit the pipe at once: a blocking write, on a thread
            try:
                return await asyncio.to_thread(self.call, request, timeout)
            except asyncio.CancelledError:
                self.kill()  # the thread's call goes on without the slot: end it
                raise
        loop = asyncio.get_running_loop()
        replied = loop.create_future()
        out = self.process.stdout.fileno()

        def readable() -> None:
            if replied.done():
                return
            try:
                self._read_some()
            except (_WorkerDied, OSError, ValueError):
                replied.set_exception(_WorkerDied("env_crash"))
                return
            if b"\n" in self._buffer:
                replied.set_result(None)

        try:
            os.write(self.process.stdin.fileno(), data)
        except (OSError, ValueError):
            raise _WorkerDied("env_crash") from None
        loop.add_reader(out, readable)
        expiry = loop.call_later(timeout, _expire, replied)
        try:
            await replied
        except asyncio.CancelledError:
            self.kill()
            raise
        finally:
            expiry.cancel()
            loop.remove_reader(out)
        return json.loads(self._take_line())

    def kill(self):
        if self.alive():
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


@dataclasses.dataclass(frozen=True)
class _Finished:
    value: Any  # what the pool's operation returned


def _resume(operation: Generator, outcome):
    """Resumes one of the pool's operations with the last call's outcome (its reply, the
    _WorkerDied it raised — thrown in —, or None to start it): what it yields next (a slot, or a
    request), or _Finished with what it returned."""
    try:
        return operation.throw(outcome) if isinstance(outcome, _WorkerDied) else operation.send(outcome)
    except StopIteration as stop:
        return _Finished(stop.value)


def _expire(replied: asyncio.Future) -> None:
    if not replied.done():
        replied.set_exception(_WorkerDied("env_timeout"))


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
        # Coroutines of one event loop queue for a slot on an asyncio lock, then take its thread lock.
        self._loop_slot_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
        """Kills worker `index`, starts a new one, and marks its other episodes for replay."""
        self._workers[index].kill()
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
    # request for that slot's worker, receiving the reply (or the _WorkerDied the call raised,
    # thrown in), and returns the call's result. `_run` drives it with blocking calls on the
    # caller's thread, `_arun` on the event loop; the slot's lock is held between the two.
    def _run(self, operation: Generator):
        index = _resume(operation, None)
        if isinstance(index, _Finished):
            return index.value
        with self._slot_locks[index]:
            outcome = None
            while not isinstance(request := _resume(operation, outcome), _Finished):
                try:
                    outcome = self._workers[index].call(request, self.step_timeout_s)
                except _WorkerDied as died:
                    outcome = died
            return request.value

    async def _arun(self, operation: Generator):
        index = _resume(operation, None)
        if isinstance(index, _Finished):
            return index.value
        # The slot's lock for a coroutine: in turn with the loop's other coroutines (an asyncio
        # lock), then the thread lock (taken at once when no thread holds it).
        queue = self._loop_slot_locks.setdefault(asyncio.get_running_loop(), {}).setdefault(index, asyncio.Lock())
        async with queue:
            lock = self._slot_locks[index]
            if not lock.acquire(blocking=False):
                taken = asyncio.ensure_future(asyncio.to_thread(lock.acquire))
                try:
                    await asyncio.shield(taken)
                except asyncio.CancelledError:
                    taken.add_done_callback(lambda _: lock.release())  # taken for no one: give it back
                    raise
            try:
                outcome = None
                while not isinstance(request := _resume(operation, outcome), _Finished):
                    try:
                        outcome = await self._workers[index].acall(request, self.step_timeout_s)
                    except _WorkerDied as died:
                        outcome = died
                return request.value
            finally:
                lock.release()

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
        if not self._workers[index].alive():
            self._replace(index, "env_crash")
        try:
            reply = yield self._reset_request(episode_id, ep)
        except _WorkerDied as died:
            self._replace(index, died.reason)
            with self._lock:
                self._episodes.pop(episode_id, None)
            raise EnvServiceError(f"reset of {task.id!r} on {env!r} failed: {died.reason}") from None
        if "error" in reply:
            with self._lock:
                self._episodes.pop(episode_id, None)
            raise EnvServiceError(f"reset of {task.id!r} on {env!r} failed: {reply['error']}")
        return episode_id, api.Observation.from_dict(reply["ok"])

    def _step_op(self, episode_id: str, action: str):
        self._check_open()
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise EnvServiceError(f"unknown or finished episode {episode_id!r}")
        index = ep.worker
        yield index
        if not self._workers[index].alive():
            # Died while idle (nothing in flight): replace it; this episode is simply replayed.
            self._replace(index, "env_crash")
        try:
            if ep.needs_replay:
                self.stats["replays"] += 1
                reply = yield self._reset_request(episode_id, ep, ep.actions)
                if "error" in reply:
                    self.stats["env_crash"] += 1
                    return self._failed_step(episode_id, "env_crash", f"replay failed: {reply['error']}")
                ep.needs_replay = False
            reply = yield {"op": "step", "episode": episode_id, "action": action}
        except _WorkerDied as died:
            self._replace(index, died.reason)
            return self._failed_step(episode_id, died.reason, f"worker {died.reason} during step")
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
        except _WorkerDied as died:
            self._replace(ep.worker, died.reason)

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
        for worker in self._workers:
            try:
                worker.process.stdin.close()  # the worker exits at end of input
                worker.process.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            worker.kill()

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
