"""Serving the engine with JetStream's orchestrator and gRPC server, plus our own service beside it.

Two services share one `SamplerDriver` (JetStream's `Driver` with our prefill and detokenize
threads) and so the same KV-cache slots:

* JetStream's own `Orchestrator` service: a stock JetStream client calling `Decode` gets the
  generated token ids (JetStream's convention: the stop token is not streamed). Its requests have
  no sampling parameters and are decoded with the server's default sampling.
* `jaxrl_agent.Sampler`, a JSON-over-gRPC service (no generated code needed): `Generate` returns
  token ids with log-probs, policy versions and the finish reason; `StreamWeights` takes new
  parameters as a stream of chunks of each array (`weight_messages`: no gRPC message cap, whatever
  the model's size) or `LoadCheckpoint` an orbax path, tagged with a version; `Info`.

Prompts longer than the engine's max prefill length are rejected (INVALID_ARGUMENT), never
truncated. Our prefill thread never prepends a BOS: prompts arrive as complete id sequences.

Every call on either service must carry the shared token (`jaxrl_agent.auth`) as gRPC metadata
`authorization: Bearer <token>`; others get UNAUTHENTICATED. `LoadCheckpoint` reads only below the
server's `checkpoint_root` (disabled without one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import struct
import threading
import time
from typing import Any

import grpc
import numpy as np

from jaxrl_agent import auth

from jaxrl_agent.sampling.engine import AgentEngine, decode_result_lists
from jaxrl_agent.sampling.types import PromptTooLongError, SamplingParams
from jaxrl_agent.sampling.jetstream_compat import import_jetstream
from jaxrl_agent.sampling.local import CompletionBuilder, admit_requests, check_prompt, prefix_reusable, save_prefixes
from jaxrl_agent.sampling.prefix_cache import PrefixIndex

engine_api, orchestrator, jetstream_pb2, jetstream_pb2_grpc, token_utils = import_jetstream()

SERVICE = "jaxrl_agent.Sampler"
MAX_MESSAGE_BYTES = 2**31 - 1
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
log = logging.getLogger(__name__)


@dataclasses.dataclass
class DetailedRequest(orchestrator.ActiveRequest):
    """A request from our own service: carries sampling parameters and wants per-token details."""

    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    error: str | None = None


def _max_tokens(request) -> int:
    """The most tokens a request may emit: our service's sampling parameters, or stock JetStream's."""
    return request.sampling.max_tokens if isinstance(request, DetailedRequest) else request.max_tokens


@dataclasses.dataclass
class TokenChunk:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None


class SamplerDriver(orchestrator.Driver):
    """JetStream's Driver with our prefill, generate and detokenize threads.

    The prefill thread validates a request (ids, no BOS, no truncation, its sampling params) and
    queues it for admission; the generate thread prefills the requests it admits in batches,
    continuing cached prefixes (as `LocalSampler` does, through `local.admit_requests`), and
    decodes; the detokenize thread turns rows into log-probs, versions and finish reasons, and hands
    finished slots whose keys/values a next turn may reuse back to the generate thread (before the
    slot itself, so that they are saved before the slot is reused). Bad requests fail alone.

    Two departures from JetStream 0.2.2's pipeline, both measured on the RL loop's many short
    turns: validated requests go straight to an unbounded admission queue that the generate thread
    drains in one go (JetStream hands them on one at a time through a transfer thread and two
    queues of size 1 in interleaved mode: a thread wake-up per request before a batch can form),
    and at most `pipeline_depth` generate calls run ahead of the detokenize thread (JetStream lets
    8 run ahead: a slot whose request finished kept decoding for up to 8 calls before the generate
    thread saw it free). The default, 1, dispatches the next call only once the last one's finished
    slots are free: on 2 cores with two servers, 15% fewer generate calls per RL iteration than 2
    and 2% less sampling time (benchmarks/RESULTS.md); a depth of 2 overlaps turning results into
    tokens with the next call, which pays off where the device, not the host, is the bottleneck.
    """

    def __init__(self, engine: AgentEngine, default_sampling: SamplingParams, pipeline_depth: int = 1):
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth={pipeline_depth}: expected >= 1 generate call in flight")
        self.engine = engine
        self.default_sampling = default_sampling
        self._finished_prefixes: queue.Queue = queue.Queue()  # (slot, tokens, version), detokenize -> generate
        self._admission: queue.Queue = queue.Queue()  # validated requests, prefill -> generate
        # Generate calls not yet turned into tokens by the detokenize thread, at most pipeline_depth.
        self._calls_in_flight = threading.Semaphore(pipeline_depth)
        # The counters of `LocalSampler.stats` that the trainer reads, kept by the generate thread
        # (its wall time: idle = waiting with no request at all; admit = batched prefills of
        # admitted requests; decode = dispatching `generate` calls and waiting for a pipeline place,
        # i.e. for an earlier call to be turned into tokens). Reported by `Info` as "sampler".
        # Started with await_weights: sample nothing until weights arrive (a restarted server holds
        # its random init, and a request served before the resync would be off-policy by every version).
        self.awaiting_weights = False
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "prefix_hits": 0, "generate_calls": 0,
                      "idle_seconds": 0.0, "admit_seconds": 0.0, "decode_seconds": 0.0, "live_slots": 0,
                      "decoded_slots": 0}
        super().__init__(prefill_engines=[engine], generate_engines=[engine], prefill_params=[None],
                         generate_params=[None], interleaved_mode=True)

    def _fail(self, request, message: str) -> None:
        if isinstance(request, DetailedRequest):
            request.error = message
        request.return_channel.close()

    def _prefill_thread(self, idx: int):
        engine = self._prefill_engines[idx]
        tokenizer = engine.build_tokenizer(engine.get_tokenizer())
        while self.live:
            request = self._prefill_backlog.get(block=True)
            if request is None:
                break
            try:
                content = request.prefill_content
                ids = tokenizer.encode(content)[0] if isinstance(content, str) else np.asarray(content, np.int32)
                ids = check_prompt(engine, ids)
                sampling = getattr(request, "sampling", None) or dataclasses.replace(
                    self.default_sampling, max_tokens=max(1, request.max_tokens))
                # Prefilled by the generate thread, batched with the other requests it admits.
                request.prompt_ids, request.sampling_params = ids, sampling
            except Exception as err:  # noqa: BLE001 - a bad request must not kill the server
                log.warning("prefill failed: %s", err)
                self._fail(request, f"{type(err).__name__}: {err}")
                continue
            self._admission.put(request)

    def _generate_thread(self, idx: int):
        """Admits waiting requests into free slots (batched prefills), then takes one decode step; repeats.

        Replaces JetStream 0.2.2's loop, which asserts that some slot is busy after its insert
        phase: the detokenize thread can free the last busy slot in between, and the failed
        assertion SIGKILLs the server (seen under load; reproduced with a tiny GIL switch interval).
        Here the free slots are drained once per round and a step over no live request is harmless.
        """
        engine = self._generate_engines[idx]
        slots = self._generate_slots[idx]
        detokenize = self._detokenize_backlogs[idx]
        decode_state = engine.init_decode_state()
        index = PrefixIndex(engine.prefix_cache_entries)
        step = 0
        live: set[int] = set()  # slots holding a request (or finished, not yet handed back)
        # Per live slot, a position its next token cannot pass: the prompt's length, plus the most
        # steps of every call since (a slot advances at most that much per call, whatever the
        # detokenize thread has seen yet): the call's cache window (engine.decode_window).
        reach: dict[int, int] = {}
        # Per live slot, the position at which its request has emitted max_tokens for certain (the
        # prompt's length + max_tokens): calls run on past steps_per_call at most until the
        # nearest of these among the requests not yet past theirs (engine.call_steps).
        limit: dict[int, int] = {}
        while self.live:
            free = []
            while True:
                try:
                    free.append(slots.get(block=False))
                except queue.Empty:
                    break
            live.difference_update(free)
            for slot in free:
                reach.pop(slot, None)
                limit.pop(slot, None)
            # Lowest slots first (popped from the end): live requests stay packed at the front, and
            # a generate call decodes only as many slots as the highest live one needs.
            free.sort(reverse=True)
            finished = []
            while True:  # queued before their slots were: saved before the slots are reused
                try:
                    finished.append(self._finished_prefixes.get(block=False))
                except queue.Empty:
                    break
            if finished:
                decode_state = save_prefixes(engine, index, decode_state, finished)
            idle = len(free) == engine.max_concurrent_decodes
            admitted = []
            while free:
                # Block only when there is nothing to decode, or while the prefill thread is still
                # validating requests that arrived together (so that they are admitted together).
                wait = (idle and not admitted) or not self._prefill_backlog.empty()
                waited = time.perf_counter()
                try:
                    request = self._admission.get(block=wait, timeout=0.5 if wait else None)
                except queue.Empty:
                    if idle and not admitted and self.live:
                        continue  # nothing to decode: keep waiting for work
                    break
                finally:
                    if idle and not admitted:  # waited with no request at all
                        self.stats["idle_seconds"] += time.perf_counter() - waited
                if request is None:
                    return
                admitted.append((free.pop(), request))
            if admitted:
                admit_started = time.perf_counter()
                params_version = engine.current_params()
                decode_state, errors = admit_requests(
                    engine, index, decode_state, [(slot, r.prompt_ids, r.sampling_params) for slot, r in admitted],
                    params_version, self.stats)
                for slot, request in admitted:
                    if slot in errors:
                        log.warning("prefill failed: %s", errors[slot])
                        self._fail(request, f"{type(errors[slot]).__name__}: {errors[slot]}")
                        free.append(slot)
                        continue
                    request.admitted_version = params_version[1]
                    request.generate_timestep_added = step
                    request.complete = np.zeros((engine.samples_per_slot,), np.bool_)
                    detokenize.put((slot, request), block=True)
                    live.add(slot)
                    reach[slot] = len(request.prompt_ids)
                    limit[slot] = len(request.prompt_ids) + max(1, _max_tokens(request))
                    idle = False
                self.stats["admit_seconds"] += time.perf_counter() - admit_started
            for slot in free:
                slots.put(slot, block=False)
            if idle or not self.live:
                continue
            decode_started = time.perf_counter()
            while not self._calls_in_flight.acquire(timeout=0.5):  # released by the detokenize thread
                if not self.live:
                    return
            live_slots = max(live) + 1 if live else None
            live_length = max((reach[s] for s in live), default=None)
            # The fewest tokens a request still running may yet emit (reach bounds what it has);
            # when every live request has run out (finished, its slot not yet handed back), the
            # fewest steps a call runs.
            remaining = min((limit[s] - reach[s] for s in live if limit[s] > reach[s]),
                            default=engine.steps_per_call)
            steps = engine.call_steps(live_length, remaining)
            decode_state, result = engine.generate(None, decode_state, live_slots=live_slots,
                                                   live_length=live_length, max_steps=steps)
            for slot in live:
                reach[slot] += steps
            result.copy_to_host_async()
            self.stats["decode_seconds"] += time.perf_counter() - decode_started
            self.stats["generate_calls"] += 1
            # Slots holding a request (a finished one not yet handed back by the detokenize thread
            # still counts: it is decoded) and the slots the call ran.
            self.stats["live_slots"] += len(live)
            self.stats["decoded_slots"] += engine.decode_rows(live_slots)
            detokenize.put((step, result), block=True)
            step += 1

    def _detokenize_thread(self, idx: int):
        backlog = self._detokenize_backlogs[idx]
        engine = self._generate_engines[idx]
        slots_queue = self._generate_slots[idx]
        tokenizer = engine.build_tokenizer(engine.get_tokenizer())
        stop_ids = set(engine.stop_token_ids)
        live: dict[int, tuple[Any, CompletionBuilder]] = {}
        while self.live:
            item = backlog.get(block=True)
            if item is None:
                break
            if not isinstance(item[1], engine_api.ResultTokens):
                slot, request = item
                live[slot] = (request, CompletionBuilder(max(1, _max_tokens(request)), stop_ids))
                continue
            try:
                columns = decode_result_lists(item[1].data, engine.max_steps_per_call)
                for slot in list(live):
                    request, builder = live[slot]
                    tokens, logprobs, versions = builder.add_row({name: rows[slot] for name, rows in columns.items()})
                    if isinstance(request, DetailedRequest):
                        # Our Generate is unary: the whole completion goes back in one chunk when it
                        # ends (a chunk per call woke the server's event loop for every slot and call).
                        if builder.finish_reason:
                            request.enqueue_samples(TokenChunk(builder.tokens, builder.logprobs, builder.versions,
                                                               builder.finish_reason))
                    else:
                        streamed = [t for t in tokens if t not in stop_ids]  # JetStream does not stream stop tokens
                        if streamed:
                            request.enqueue_samples([token_utils.ReturnSample(
                                text=[tokenizer.decode([t]) for t in streamed], token_ids=streamed)])
                    if builder.finish_reason is not None:
                        request.return_channel.close()
                        del live[slot]
                        if prefix_reusable(engine, request.prompt_ids, builder, request.admitted_version):
                            self._finished_prefixes.put(
                                (slot, np.concatenate([request.prompt_ids, np.asarray(builder.tokens, np.int32)]),
                                 request.admitted_version))
                        slots_queue.put(slot, block=False)
            finally:
                # After the freed slots are back in their queue: the next call can take them.
                self._calls_in_flight.release()


class SamplerOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's servicer, rejecting prompts that do not fit instead of truncating them."""

    def __init__(self, driver: SamplerDriver):
        super().__init__(driver=driver)
        self._engine = driver.engine
        self._driver_ref = driver

    async def Decode(self, request, context=None):  # noqa: N802 - gRPC method name
        if self._driver_ref.awaiting_weights:
            await orchestrator._abort_or_raise(context, grpc.StatusCode.UNAVAILABLE, NO_WEIGHTS)
            return
        content, _ = self._get_prefill_content(request)
        length = len(content) if not isinstance(content, str) else len(self._engine.tokenizer.encode(content))
        if length > self._engine.max_prefill_length or length == 0:
            await orchestrator._abort_or_raise(
                context, grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt of {length} tokens does not fit max_prefill_length={self._engine.max_prefill_length}")
            return
        async for response in super().Decode(request, context):
            yield response


class SamplerService:
    """Our JSON service: Generate, StreamWeights, LoadCheckpoint (below `checkpoint_root` only), Info."""

    checkpoint_root: str | None = None

    def __init__(self, driver: SamplerDriver):
        self.driver = driver
        self.engine = driver.engine

    async def generate(self, request: dict, context) -> dict:
        if self.driver.awaiting_weights:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NO_WEIGHTS)
        try:
            sampling = SamplingParams.from_dict(request.get("sampling", {}))
            ids = check_prompt(self.engine, request["prompt_ids"])
        except (PromptTooLongError, ValueError, KeyError, TypeError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(err).__name__}: {err}")
        from jetstream.core.utils import async_multifuture

        active = DetailedRequest(max_tokens=sampling.max_tokens, return_channel=async_multifuture.AsyncMultifuture(),
                                 prefill_content=[int(i) for i in ids], is_client_side_tokenization=True,
                                 sampling=sampling)
        context.add_done_callback(active.return_channel.cancel)
        self.driver.place_request_on_prefill_queue(active)
        chunks = [chunk async for chunk in active.return_channel]
        if active.error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, active.error)
        return {
            "token_ids": [t for c in chunks for t in c.token_ids],
            "logprobs": [x for c in chunks for x in c.logprobs],
            "versions": [v for c in chunks for v in c.versions],
            "finish_reason": chunks[-1].finish_reason if chunks else "length",
        }

    async def stream_weights(self, messages, context) -> dict:
        """New weights as a stream of chunks (`weight_messages`): assembled in place, checked
        complete, then swapped in; a bad or incomplete stream is refused and the old weights stay."""
        assembly = WeightAssembly()
        try:
            async for message in messages:
                assembly.add(message)
            version, params = assembly.result()
            await asyncio.to_thread(self.engine.update_weights, params, version)
        except (ValueError, TypeError, KeyError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad weights: {err}")
        self.driver.awaiting_weights = False
        return {"version": self.engine.version, "chunks": assembly.messages}

    async def load_checkpoint(self, request: dict, context) -> dict:
        import os

        import orbax.checkpoint as ocp

        root = self.checkpoint_root
        if root is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "LoadCheckpoint is disabled: start the server with --checkpoint_root=DIR")
        path = os.path.realpath(str(request.get("path", "")))
        if not path.startswith(os.path.realpath(root) + os.sep):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"LoadCheckpoint reads only below {root!r}, not {request.get('path')!r}")
        try:
            target = self.engine.param_template()
            params = await asyncio.to_thread(ocp.StandardCheckpointer().restore, request["path"], target)
            await asyncio.to_thread(self.engine.update_weights, params, int(request["version"]))
        except Exception as err:  # noqa: BLE001 - report, keep serving the old weights
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load {request.get('path')!r}: {err}")
        self.driver.awaiting_weights = False
        return {"version": self.engine.version}

    async def info(self, request: dict, context) -> dict:
        return {"version": self.engine.version, "slots": self.engine.max_concurrent_decodes,
                "max_prefill_length": self.engine.max_prefill_length, "live": self.driver.live,
                "sampler": dict(self.driver.stats)}

    def handler(self) -> grpc.GenericRpcHandler:
        as_json = dict(request_deserializer=json.loads, response_serializer=lambda r: json.dumps(r).encode())
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_unary_rpc_method_handler(self.generate, **as_json),
            "LoadCheckpoint": grpc.unary_unary_rpc_method_handler(self.load_checkpoint, **as_json),
            "Info": grpc.unary_unary_rpc_method_handler(self.info, **as_json),
            "StreamWeights": grpc.stream_unary_rpc_method_handler(
                self.stream_weights, request_deserializer=None, response_serializer=lambda r: json.dumps(r).encode()),
        })


WEIGHT_CHUNK_BYTES = 16 * 2**20  # bytes of one parameter per StreamWeights message (benchmarks/weight_sync.py)


def weight_messages(params, version: int, chunk_bytes: int = WEIGHT_CHUNK_BYTES):
    """StreamWeights' request stream for a parameter tree (nested dicts of arrays, on host or device):
    each parameter's bytes in pieces of at most `chunk_bytes`. A message is a little-endian uint32
    header length, the JSON header {version, name, dtype, shape, offset, leaves}, then the piece.
    One array is copied to the host at a time; no message grows with the model."""
    import jax
    from flax import traverse_util

    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: expected >= 1")
    flat = traverse_util.flatten_dict(params, sep="/")
    for name in sorted(flat):
        array = np.ascontiguousarray(jax.device_get(flat[name]))
        data = array.reshape(-1).view(np.uint8)
        for offset in range(0, max(data.size, 1), chunk_bytes):
            header = json.dumps({"version": int(version), "name": name, "dtype": array.dtype.name,
                                 "shape": list(array.shape), "offset": offset, "leaves": len(flat)}).encode()
            yield struct.pack("<I", len(header)) + header + data[offset:offset + chunk_bytes].tobytes()


class WeightAssembly:
    """Receives `weight_messages` into preallocated arrays; `result()` checks that every parameter
    arrived whole, once, under one version."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.received: dict[str, int] = {}
        self.version: int | None = None
        self.leaves: int | None = None
        self.messages = 0

    def add(self, message: bytes) -> None:
        import jax.numpy as jnp

        if len(message) < 4:
            raise ValueError(f"a weight message of {len(message)} bytes has no header")
        (size,) = struct.unpack("<I", message[:4])
        try:
            header = json.loads(message[4:4 + size])
            version, name, offset = int(header["version"]), str(header["name"]), int(header["offset"])
            shape, dtype, leaves = tuple(int(d) for d in header["shape"]), jnp.dtype(header["dtype"]), int(header["leaves"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"unreadable weight message header: {err}") from None
        if self.version is None:
            self.version, self.leaves = version, leaves
        if (version, leaves) != (self.version, self.leaves):
            raise ValueError(f"weight message of version {version} ({leaves} parameters) in a stream of version "
                             f"{self.version} ({self.leaves} parameters)")
        array = self.arrays.get(name)
        if array is None:
            array = self.arrays[name] = np.empty(shape, dtype)
            self.received[name] = 0
        elif array.shape != shape or array.dtype != dtype:
            raise ValueError(f"parameter {name!r} arrived as {shape} {dtype} after {array.shape} {array.dtype}")
        piece = np.frombuffer(message[4 + size:], np.uint8)
        target = array.reshape(-1).view(np.uint8)
        if offset < 0 or offset + piece.size > target.size:
            raise ValueError(f"parameter {name!r}: bytes {offset}..{offset + piece.size} outside its {target.size}")
        target[offset:offset + piece.size] = piece
        self.received[name] += piece.size
        self.messages += 1

    def result(self):
        """(version, nested parameter dict)."""
        from flax import traverse_util

        if self.version is None:
            raise ValueError("an empty weight stream")
        if len(self.arrays) != self.leaves:
            raise ValueError(f"{len(self.arrays)} of {self.leaves} parameters arrived")
        short = {n: (self.received[n], a.nbytes) for n, a in self.arrays.items() if self.received[n] != a.nbytes}
        if short:
            raise ValueError(f"parameters arrived incomplete or twice (bytes received, expected): {short}")
        return self.version, traverse_util.unflatten_dict(self.arrays, sep="/")


NO_WEIGHTS = "no weights yet: this server was started with await_weights and has not been sent any"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` (UNAUTHENTICATED)."""

    def __init__(self, token: str):
        self.token = token
        self.refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(auth.METADATA_KEY, "")
        if handler is None or (presented.startswith("Bearer ")
                               and auth.matches(presented[len("Bearer "):], self.token)):
            return handler
        self.refused += 1
        message = "unauthenticated: the call's token does not match the server's"

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # (unreachable: abort raises)

        kinds = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, **kinds)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse, **kinds)
        return grpc.unary_unary_rpc_method_handler(refuse, **kinds)


async def serve(engine: AgentEngine, host: str = "127.0.0.1", port: int = 0, *, token: str,
                default_sampling: SamplingParams = SamplingParams(temperature=0.0), ready=None,
                pipeline_depth: int = 1, checkpoint_root: str | None = None, credentials=None,
                await_weights: bool = False) -> None:
    """Runs both services until cancelled. `ready(port)` is called once listening. `credentials`
    (`auth.grpc_server_credentials`): serve TLS only. `await_weights`: sampling requests get
    UNAVAILABLE until the first StreamWeights or LoadCheckpoint (clients retry them)."""
    if not token:
        raise auth.AuthError("the sampler server needs a token (jaxrl_agent.auth)")
    driver = SamplerDriver(engine, default_sampling, pipeline_depth=pipeline_depth)
    driver.awaiting_weights = await_weights
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=(TokenInterceptor(token),))
    jetstream_pb2_grpc.add_OrchestratorServicer_to_server(SamplerOrchestrator(driver), server)
    service = SamplerService(driver)
    service.checkpoint_root = checkpoint_root
    server.add_generic_rpc_handlers((service.handler(),))
    bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
             else server.add_insecure_port(f"{host}:{port}"))
    await server.start()
    if ready is not None:
        ready(bound)
    try:
        await server.wait_for_termination()
    finally:
        driver.stop()
        await server.stop(grace=1)
