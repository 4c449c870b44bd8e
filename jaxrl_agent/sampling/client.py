"""`SamplerClient`: asyncio client of one or more sampler servers.

`await client.generate(prompt_ids, sampling) -> Completion` goes to the server with the fewest
requests in flight, except that a prompt extending (or equal to) a first prompt sent earlier goes to
the server that got that first prompt (prefix affinity), unless that server has `affinity_slack`
more requests in flight than the least loaded: an episode's later turns then meet their own keys and
values in that server's prefix cache, and a group's G identical first prompts are prefilled there
once. If a server fails (unreachable, died mid-request) the request is retried on
another, and the failed server is avoided for `cooldown_s`. A prompt the server rejects (too long,
bad ids) raises at once, without retries. `update_weights(params, version)` pushes weights to every
server (msgpack over gRPC), `load_checkpoint(path, version)` makes every server load an orbax
checkpoint instead.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Sequence

import numpy as np

import grpc

from jaxrl_agent import auth

from jaxrl_agent.sampling.types import Completion, PromptTooLongError, SamplingParams
from jaxrl_agent.sampling.server import GRPC_OPTIONS, SERVICE, WEIGHT_CHUNK_BYTES, weight_messages

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}


class SamplerUnavailableError(RuntimeError):
    """No server could complete the request."""


class _Server:
    def __init__(self, address: str, token: str, credentials=None):
        import functools

        self.address = address
        self.channel = (grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS) if credentials is not None
                        else grpc.aio.insecure_channel(address, options=GRPC_OPTIONS))
        as_json = dict(request_serializer=lambda r: json.dumps(r).encode(), response_deserializer=json.loads)
        signed = functools.partial(functools.partial, metadata=((auth.METADATA_KEY, f"Bearer {token}"),))
        self.generate = signed(self.channel.unary_unary(f"/{SERVICE}/Generate", **as_json))
        self.info = signed(self.channel.unary_unary(f"/{SERVICE}/Info", **as_json))
        self.load_checkpoint = signed(self.channel.unary_unary(f"/{SERVICE}/LoadCheckpoint", **as_json))
        self._stream_weights = signed(self.channel.stream_unary(f"/{SERVICE}/StreamWeights", request_serializer=None,
                                                                response_deserializer=json.loads))
        self.in_flight = 0
        self.down_until = 0.0
        self.lost = False  # an RPC to it failed since it last received weights: the next push rejoins it

    async def stream_weights(self, messages, **kwargs):
        """StreamWeights, with the server's status recovered where grpc's asyncio client loses it.

        A server that ends the stream before the client has sent it all (a refused token) sends its
        status, but a write still in flight can overwrite it with INTERNAL "Internal error from
        Core" (grpc/grpc#36066). Then an Info call, which carries the same token, tells the real
        reason: its error is raised instead; if Info succeeds the INTERNAL error stands."""
        try:
            return await self._stream_weights(messages, **kwargs)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.INTERNAL:
                raise
            try:
                await self.info({}, timeout=kwargs.get("timeout"))
            except grpc.aio.AioRpcError as probe:
                raise probe from err
            raise


class SamplerClient:
    """Args: addresses of the servers; timeout_s per request; cooldown_s a failed server is avoided;
    max_attempts per request (default 2 per server); affinity_entries first prompts remembered for
    prefix affinity (least recently used dropped; 0 = off); affinity_slack extra requests in flight
    tolerated on the affine server before the least loaded one is used instead; token the servers'
    shared token (default: `auth.load_token()`); tls_ca_file the PEM CA that signed the servers' TLS
    certificates (servers started with --tls_cert_file; None = plain gRPC, for loopback servers);
    weight_chunk_bytes the most bytes of a parameter one StreamWeights message carries."""

    def __init__(self, addresses: Sequence[str], *, timeout_s: float = 300.0, cooldown_s: float = 5.0,
                 max_attempts: int | None = None, affinity_entries: int = 4096, affinity_slack: int = 32,
                 token: str | None = None, tls_ca_file: str | None = None,
                 weight_chunk_bytes: int = WEIGHT_CHUNK_BYTES):
        if weight_chunk_bytes < 1:
            raise ValueError(f"weight_chunk_bytes={weight_chunk_bytes}: expected >= 1")
        if not addresses:
            raise ValueError("SamplerClient needs at least one server address")
        token = token or auth.load_token()
        credentials = auth.grpc_channel_credentials(tls_ca_file) if tls_ca_file else None
        self._servers = [_Server(a, token, credentials) for a in addresses]
        self.timeout_s = timeout_s
        self.weight_chunk_bytes = weight_chunk_bytes
        self.cooldown_s = cooldown_s
        self.max_attempts = max_attempts or 2 * len(addresses)
        self.affinity_entries = affinity_entries
        self.affinity_slack = affinity_slack
        self._routes: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # first prompt -> server
        self._route_lengths: collections.Counter[int] = collections.Counter()
        # rejoined: servers that were lost (an RPC failed, or a restart came back on other weights)
        # and then received the latest weights, by a regular push, a resync or `rejoin_lagging`.
        self.stats = {"retries": 0, "affinity_hits": 0, "rejoined": 0}
        self._push_lock = asyncio.Lock()  # one weight push at a time (updates, resyncs, rejoins)

    def _affine(self, prompt: np.ndarray) -> tuple[bytes, int | None]:
        """(key, server index) of the longest remembered first prompt that `prompt` starts with; for
        a prompt that starts with none, (its own key, None)."""
        for length in sorted(self._route_lengths, reverse=True):
            if length <= prompt.size:
                key = prompt[:length].tobytes()
                if key in self._routes:
                    self._routes.move_to_end(key)
                    return key, self._routes[key]
        return prompt.tobytes(), None

    def _remember(self, key: bytes, index: int) -> None:
        if self.affinity_entries <= 0:
            return
        if key not in self._routes:
            self._route_lengths[len(key) // 4] += 1
        self._routes[key] = index
        self._routes.move_to_end(key)
        while len(self._routes) > self.affinity_entries:
            old, _ = self._routes.popitem(last=False)
            self._route_lengths[len(old) // 4] -= 1
            if not self._route_lengths[len(old) // 4]:
                del self._route_lengths[len(old) // 4]

    def _pick(self, exclude: set[str], preferred: int | None = None) -> _Server | None:
        now = time.monotonic()
        candidates = [s for s in self._servers if s.address not in exclude]
        healthy = [s for s in candidates if s.down_until <= now] or candidates
        if not healthy:
            return None
        least = min(healthy, key=lambda s: s.in_flight)
        if preferred is not None:
            affine = self._servers[preferred]
            if affine in healthy and affine.in_flight <= least.in_flight + self.affinity_slack:
                return affine
        return least

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> Completion:
        request = {"prompt_ids": [int(i) for i in prompt_ids], "sampling": sampling.to_dict()}
        key, preferred = self._affine(np.asarray(request["prompt_ids"], np.int32))
        tried: set[str] = set()
        errors = []
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while attempt < self.max_attempts or time.monotonic() < deadline:
            attempt += 1
            if attempt > self.max_attempts:  # every server failed: wait for one to come back (a restart)
                await asyncio.sleep(min(self.cooldown_s, 1.0))
            server = self._pick(tried if len(tried) < len(self._servers) else set(), preferred)
            if server is None:
                continue
            index = self._servers.index(server)
            self.stats["affinity_hits"] += int(index == preferred)
            if index != preferred:  # a first prompt, or its server was unusable: later turns follow this one
                self._remember(key, index)
                preferred = index
            server.in_flight += 1
            try:
                reply = await server.generate(request, timeout=self.timeout_s)
                return Completion.from_dict(reply)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    message = err.details() or ""
                    raise (PromptTooLongError if "max_prefill_length" in message else ValueError)(message) from None
                if err.code() not in _RETRYABLE:
                    raise
                server.down_until = time.monotonic() + self.cooldown_s
                server.lost = True
                tried.add(server.address)
                errors.append(f"{server.address}: {err.code().name}")
                self.stats["retries"] += 1
            finally:
                server.in_flight -= 1
        raise SamplerUnavailableError(f"no sampler server completed the request: {errors}")

    async def _each(self, call):
        results = await asyncio.gather(*(call(s) for s in self._servers), return_exceptions=True)
        failures = {s.address: r for s, r in zip(self._servers, results) if isinstance(r, Exception)}
        return results, failures

    async def update_weights(self, params, version: int) -> dict[str, Exception]:
        """Streams weights to every server in chunks of `weight_chunk_bytes`; returns {address:
        error} for servers that failed. A host copy is kept for `resync` (a restarted server gets
        the latest weights)."""
        import jax

        host = jax.device_get(params)
        async with self._push_lock:
            self._latest_weights = (host, int(version))
            _, failures = await self._each(lambda s: s.stream_weights(
                weight_messages(host, version, self.weight_chunk_bytes), timeout=self.timeout_s))
            for server in self._servers:
                if server.address in failures:
                    server.lost = True
                else:
                    self._received_weights(server)
        return failures

    def _received_weights(self, server: _Server, restarted: bool = False) -> None:
        """Marks `server` as holding the latest weights; one that was lost (or restarted) rejoined."""
        if server.lost or restarted:
            self.stats["rejoined"] += 1
        server.lost = False
        server.down_until = 0.0

    async def resync(self, index: int) -> None:
        """Sends the latest weights again to server `index` (after a restart) and clears its cooldown."""
        server = self._servers[index]
        async with self._push_lock:
            latest = getattr(self, "_latest_weights", None)
            if latest is not None:  # waits for the channel to reconnect (it backs off after refusals)
                host, version = latest
                await server.stream_weights(weight_messages(host, version, self.weight_chunk_bytes),
                                            timeout=self.timeout_s, wait_for_ready=True)
                self._received_weights(server, restarted=True)
        server.down_until = 0.0

    async def rejoin_lagging(self, timeout_s: float = 5.0) -> list[str]:
        """Servers started elsewhere (`sampler.addresses`) come and go on their own: each one that
        answers Info with another version than the latest push — restarted, so on its initial
        weights, or back after missing pushes — is sent the latest weights. Returns their addresses."""
        rejoined = []
        async with self._push_lock:
            latest = getattr(self, "_latest_weights", None)
            if latest is None:
                return rejoined
            host, version = latest
            for server in self._servers:
                try:
                    info = await server.info({}, timeout=timeout_s)
                    if int(info.get("version", -1)) == version:
                        continue
                    await server.stream_weights(weight_messages(host, version, self.weight_chunk_bytes),
                                                timeout=self.timeout_s)
                except grpc.aio.AioRpcError:
                    server.lost = True
                    continue  # still down: tried again on the next round
                self._received_weights(server, restarted=True)
                rejoined.append(server.address)
        return rejoined

    async def load_checkpoint(self, path: str, version: int) -> dict[str, Exception]:
        _, failures = await self._each(
            lambda s: s.load_checkpoint({"path": path, "version": int(version)}, timeout=self.timeout_s))
        return failures

    async def info(self) -> list:
        results, _ = await self._each(lambda s: s.info({}, timeout=self.timeout_s))
        return results

    async def sampler_stats(self) -> dict[str, float]:
        """The servers' sampler counters (`Info`'s "sampler": the keys of `LocalSampler.stats`),
        summed over the servers that answer: seconds are server-seconds, so with several servers
        they can exceed the wall time."""
        total: dict[str, float] = {}
        for result in (await self.info()):
            if isinstance(result, Exception):
                continue
            for key, value in result.get("sampler", {}).items():
                total[key] = total.get(key, 0) + value
        return total

    async def close(self) -> None:
        for server in self._servers:
            await server.channel.close()


class BackgroundSamplerClient:
    """A `SamplerClient` on its own event-loop thread, usable from any thread or event loop.

    gRPC's asyncio channels belong to the loop that created them; the trainer samples from the
    rollout runner's loop and evaluates from others, so the client lives on a loop of its own and
    every call is handed to it. Same interface as `LocalSampler`: `await generate(...)`,
    `update_weights(params, version)` (blocking until every server has the new weights), `close()`.
    """

    def __init__(self, addresses: Sequence[str], *, supervised: bool = False, **kwargs):
        import threading

        self.supervised = supervised  # a push no server took is re-sent when a server is restarted

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sampler-client", daemon=True)
        self._thread.start()

        async def make():
            return SamplerClient(addresses, **kwargs)

        self.client = self._run(make())
        self.stats = self.client.stats

    def _run(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> Completion:
        future = asyncio.run_coroutine_threadsafe(self.client.generate(prompt_ids, sampling), self.loop)
        return await asyncio.wrap_future(future)

    def update_weights(self, params, version: int) -> None:
        failures = self._run(self.client.update_weights(params, version))
        if len(failures) == len(self.client._servers) and not self.supervised:
            raise SamplerUnavailableError(f"no sampler server took weights version {version}: {failures}")

    def resync(self, index: int) -> None:
        """The latest weights to server `index` again (after its restart)."""
        self._run(self.client.resync(index), timeout=self.client.timeout_s)

    def watch(self, every_s: float) -> None:
        """Every `every_s` seconds, sends the latest weights to any server that lacks them
        (`SamplerClient.rejoin_lagging`): servers run elsewhere rejoin on their own when they return."""
        async def loop():
            while True:
                await asyncio.sleep(every_s)
                try:
                    await self.client.rejoin_lagging()
                except Exception as err:  # noqa: BLE001 - the watch goes on; the next round retries
                    print(f"warning: sampler rejoin check failed: {type(err).__name__}: {err}", flush=True)

        self._watch = asyncio.run_coroutine_threadsafe(loop(), self.loop)

    def sampler_stats(self) -> dict[str, float]:
        return self._run(self.client.sampler_stats(), timeout=self.client.timeout_s)

    def close(self) -> None:
        if getattr(self, "_watch", None) is not None:
            self._watch.cancel()
        try:
            self._run(self.client.close(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
