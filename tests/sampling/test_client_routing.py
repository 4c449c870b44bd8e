"""SamplerClient's choice of server: least loaded, prefix affinity, slack, failures (no servers run)."""

import asyncio

import numpy as np

from jaxrl_agent.sampling.client import SamplerClient


def _choose(client, prompt, exclude=()):
    """What `generate` does before sending: the affine or least-loaded server, remembered."""
    key, preferred = client._affine(np.asarray(prompt, np.int32))
    server = client._pick(set(exclude), preferred)
    index = client._servers.index(server)
    if index != preferred:
        client._remember(key, index)
    return index


def test_a_group_and_its_later_turns_stay_on_one_server_while_new_prompts_balance():
    async def run():
        client = SamplerClient(["127.0.0.1:1", "127.0.0.1:2"], affinity_slack=2)
        a, b = [5, 6, 7, 8], [5, 6, 9]
        first = _choose(client, a)
        client._servers[first].in_flight += 1
        # The group's other episodes (identical prompt) and its next turn (prompt + completion +
        # observation) follow, although the other server is idle.
        assert _choose(client, a) == first
        assert _choose(client, a + [11, 12, 13]) == first
        # A new task's first prompt goes to the least loaded server (a shared leading 5, 6 is not a
        # remembered first prompt).
        other = _choose(client, b)
        assert other != first
        assert _choose(client, b + [1, 2]) == other
        # Past the slack the affine server is skipped, and later turns follow the new choice.
        client._servers[first].in_flight += 3
        assert _choose(client, a + [11, 12, 13, 14]) == other
        assert _choose(client, a + [11]) == other
        # A server in cooldown (failed) is avoided even when affine.
        client._servers[other].down_until = float("inf")
        client._servers[first].in_flight = 0
        assert _choose(client, b) == first
        await client.close()

    asyncio.run(run())


def test_affinity_memory_is_bounded_and_forgets_least_recently_used():
    async def run():
        client = SamplerClient(["127.0.0.1:1", "127.0.0.1:2"], affinity_entries=2)
        for prompt in ([1, 2], [3, 4, 5], [6, 7, 8, 9]):
            _choose(client, prompt)
        assert len(client._routes) == 2 and sorted(client._route_lengths) == [3, 4]
        assert client._affine(np.asarray([1, 2, 0], np.int32))[1] is None  # forgotten
        assert client._affine(np.asarray([6, 7, 8, 9, 0], np.int32))[1] is not None
        await client.close()

    asyncio.run(run())


def _rpc_error(code, details):
    import grpc

    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_weight_push_whose_status_grpc_lost_reports_the_servers_refusal():
    """grpc/grpc#36066: a client-streaming call the server ends early can surface as INTERNAL;
    the Info probe recovers the real reason, and a genuine INTERNAL error (Info fine) stands."""
    import grpc

    async def run(info_error):
        client = SamplerClient(["127.0.0.1:1"])
        server = client._servers[0]

        async def lost_status(messages, **kwargs):
            raise _rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")

        async def info(request, **kwargs):
            if info_error is not None:
                raise info_error
            return {"version": 3}

        server._stream_weights, server.info = lost_status, info
        failures = await client.update_weights({"w": np.zeros(2, np.float32)}, 4)
        await client.close()
        return failures["127.0.0.1:1"]

    refused = asyncio.run(run(_rpc_error(grpc.StatusCode.UNAUTHENTICATED, "bad token")))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and refused.details() == "bad token"
    genuine = asyncio.run(run(None))
    assert genuine.code() == grpc.StatusCode.INTERNAL
