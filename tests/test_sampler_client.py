"""SamplerClient's fleet bookkeeping, with the servers' RPCs replaced by in-process fakes: a server
that failed an RPC and then receives the latest weights — by a regular push or by the rejoin watcher
— counts as rejoined once; servers that never failed are not counted."""

import asyncio

import grpc
import numpy as np

from jaxrl_agent.sampling.client import SamplerClient
from jaxrl_agent.sampling.server import WeightAssembly


def _unavailable():
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="down")


class _FakeServer:
    """Stands in for one server's RPCs: `up` says whether it answers; pushes land in an assembly."""

    def __init__(self):
        self.up, self.version, self.generated = True, -1, 0

    async def generate(self, request, timeout=None):
        if not self.up:
            raise _unavailable()
        self.generated += 1
        return {"token_ids": [1], "logprobs": [0.0], "versions": [self.version], "finish_reason": "length"}

    async def stream_weights(self, messages, **kwargs):
        if not self.up:
            raise _unavailable()
        assembly = WeightAssembly()
        for message in messages:
            assembly.add(message)
        self.version, _ = assembly.result()
        return {"version": self.version}

    async def info(self, request, timeout=None):
        if not self.up:
            raise _unavailable()
        return {"version": self.version}


def _client_with_fakes(n):
    client = SamplerClient([f"127.0.0.1:{1 + i}" for i in range(n)], token="t", cooldown_s=60.0,
                           weight_chunk_bytes=3)
    fakes = [_FakeServer() for _ in range(n)]
    for server, fake in zip(client._servers, fakes):
        server.generate, server.stream_weights, server.info = fake.generate, fake.stream_weights, fake.info
    return client, fakes


PARAMS = {"w": np.arange(6, dtype=np.float32)}


def test_a_server_lost_on_a_request_rejoins_on_the_next_regular_push():
    async def scenario():
        client, fakes = _client_with_fakes(2)
        await client.update_weights(PARAMS, 1)
        assert client.stats["rejoined"] == 0  # nobody was lost
        fakes[1].up = False
        client._servers[0].in_flight = 1  # busy: the least loaded server 1 is tried first
        for _ in range(4):  # requests fail over to server 0 while server 1 is down
            await client.generate([5, 6, 7])
        client._servers[0].in_flight = 0
        assert fakes[0].generated == 4 and client.stats["retries"] >= 1 and client._servers[1].lost
        assert client._servers[1].down_until > 0  # in its cooldown
        fakes[1].up = True
        await client.update_weights(PARAMS, 2)
        assert client.stats["rejoined"] == 1 and fakes[1].version == 2
        assert client._servers[1].down_until == 0.0 and not client._servers[1].lost  # used again at once
        await client.update_weights(PARAMS, 3)
        assert client.stats["rejoined"] == 1  # counted once
        await client.close()

    asyncio.run(scenario())


def test_a_missed_push_is_delivered_by_the_rejoin_watcher_and_counted_once():
    async def scenario():
        client, fakes = _client_with_fakes(2)
        fakes[0].up = False
        failures = await client.update_weights(PARAMS, 4)
        assert list(failures) == ["127.0.0.1:1"] and client._servers[0].lost
        assert await client.rejoin_lagging() == []  # still down: nothing rejoined, nothing counted
        assert client.stats["rejoined"] == 0
        fakes[0].up = True
        assert await client.rejoin_lagging() == ["127.0.0.1:1"]
        assert fakes[0].version == 4 and client.stats["rejoined"] == 1
        assert await client.rejoin_lagging() == []  # up to date now
        await client.update_weights(PARAMS, 5)
        assert client.stats["rejoined"] == 1
        await client.close()

    asyncio.run(scenario())


def test_a_server_restarted_between_pushes_is_found_by_its_version():
    async def scenario():
        client, fakes = _client_with_fakes(2)
        await client.update_weights(PARAMS, 7)
        fakes[1].version = -1  # came back from a restart on its initial weights, no RPC ever failed
        assert await client.rejoin_lagging() == ["127.0.0.1:2"]
        assert fakes[1].version == 7 and client.stats["rejoined"] == 1
        await client.close()

    asyncio.run(scenario())
