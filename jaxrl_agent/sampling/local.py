"""The in-process sampler: the same engine, driven by one thread, no gRPC.

`LocalSampler(engine)` does continuous batching itself — admit waiting requests into free slots
(prefill + insert), run `generate` (several decode steps per call), hand finished completions back
— and exposes the same `await generate(prompt_ids, sampling) -> Completion` and
`update_weights(params, version)` as the remote `SamplerClient`. Used by tests, notebooks and the
CPU default, where a server hop would only cost time.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import heapq
import logging
import threading
import time
from typing import Sequence

import numpy as np

from jaxrl_agent.sampling.engine import AgentEngine, decode_result_lists, prefill_rows
from jaxrl_agent.sampling.types import FINISH_REASONS, Completion, PromptTooLongError, Sampler, SamplingParams  # noqa: F401 - re-exported
from jaxrl_agent.sampling.prefix_cache import PrefixIndex

class CompletionBuilder:
    """Accumulates one request's tokens from engine result rows and decides when it is finished."""

    def __init__(self, max_tokens: int, stop_ids):
        self.max_tokens = max_tokens
        self.stop_ids = set(stop_ids)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def add_row(self, row: dict) -> tuple[list[int], list[float], list[int]]:
        """Consumes one slot row; returns the newly accepted (tokens, logprobs, versions)."""
        start = len(self.tokens)
        for token, valid, logprob, version in zip(row["tokens"], row["valid"], row["logprobs"], row["versions"]):
            if self.finish_reason is not None:
                break
            if not valid:
                self.finish_reason = "context_limit"  # the engine stopped the slot: its cache is full
                break
            self.tokens.append(int(token))
            self.logprobs.append(float(logprob))
            self.versions.append(int(version))
            if int(token) in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
        return self.tokens[start:], self.logprobs[start:], self.versions[start:]

    def completion(self) -> Completion:
        return Completion(tuple(self.tokens), tuple(self.logprobs), tuple(self.versions), self.finish_reason)


def check_prompt(engine: AgentEngine, prompt_ids: Sequence[int]) -> np.ndarray:
    ids = np.asarray(prompt_ids, np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("empty prompt")
    if ids.size > engine.max_prefill_length:
        raise PromptTooLongError(
            f"prompt of {ids.size} tokens exceeds max_prefill_length={engine.max_prefill_length}; "
            "prompts are never truncated")
    if ids.min() < 0 or ids.max() >= engine.config.vocab_size:
        raise ValueError(f"prompt ids must lie in [0, {engine.config.vocab_size}), got [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32)


# The fixed cost of one prefill call, in padded token slots (rows x bucket): dispatch, the
# weights' traffic and the insert, which a merged call pays once.
PREFILL_CALL_SLOTS = 64


def _prefill_slots(rows: int, bucket: int) -> int:
    """Padded token slots of one batched prefill call: its rows (`engine.prefill_rows`), each
    padded to the bucket, plus the call's fixed cost."""
    return prefill_rows(rows) * bucket + PREFILL_CALL_SLOTS


def _by_bucket(engine: AgentEngine, items: list, length) -> list[list]:
    """`items` in prefill calls: grouped by the prefill bucket of `length(item)`, then neighbouring
    buckets merged where one call padded to the longer bucket costs fewer padded token slots
    (`_prefill_slots`) than separate calls — each call pads its rows to at least 8,
    so 8 turns with tool results of 10-40 tokens are one call of 8 x 64, not three of 8 x 16, 8 x 32
    and 8 x 64 — while one long prompt among many short ones keeps a call of its own. The
    partition of the sorted buckets into runs is the cheapest one (dynamic programming over at most
    a few buckets). Prompts that are too long form a group of their own and fail there."""
    groups: dict[int, list] = {}
    for item in items:
        try:
            bucket = engine.bucket_length(length(item))
        except PromptTooLongError:
            bucket = -1
        groups.setdefault(bucket, []).append(item)
    too_long = groups.pop(-1, None)
    buckets = sorted(groups)
    # best[i]: (cost, runs) of the cheapest calls for buckets[:i]; a run buckets[j:i] is one call
    # padded to buckets[i - 1].
    best = [(0, [])]
    for i in range(1, len(buckets) + 1):
        best.append(min(
            (best[j][0] + _prefill_slots(sum(len(groups[b]) for b in buckets[j:i]), buckets[i - 1]),
             best[j][1] + [buckets[j:i]])
            for j in range(i)))
    calls = [[item for b in run for item in groups[b]] for run in best[-1][1]]
    return calls + ([too_long] if too_long else [])


# First-turn prompts a several-engine LocalSampler remembers the engine of (the newest ones).
RECENT_PROMPTS = 1024


@dataclasses.dataclass
class _Request:
    prompt: np.ndarray
    sampling: SamplingParams
    future: concurrent.futures.Future
    builder: CompletionBuilder
    version: int = -1  # the policy version its prompt was prefilled with


class LocalSampler:
    """Continuous batching over one or several AgentEngines, each driven by a thread of its own.

    `LocalSampler(engine)` runs one decode loop; `LocalSampler([e0, e1, ...])` runs one per engine
    (each with its own slots, decode state and prefix cache) and routes each request to the engine
    whose prefix cache holds the most of its prompt (an episode's next turn goes where its history
    is), a prompt sent again to the engine that has it, else to the least loaded. On a CPU host the
    decode loops then run on different cores: the engines' XLA calls release the GIL, and a step of
    a small model at these row counts uses one core however XLA threads it (benchmarks/RESULTS.md,
    "Two decode lanes"). `build.build_sampler`
    makes `sampler.local_engines` engines, splitting the slots and cache entries between them.

    With `engine.prefix_cache_entries > 0`, a prompt that continues a finished request (the next
    turn of an episode) prefills only its new tokens (see `sampling.prefix_cache`).
    """

    def __init__(self, engine: AgentEngine | Sequence[AgentEngine]):
        engines = [engine] if isinstance(engine, AgentEngine) else list(engine)
        if not engines:
            raise ValueError("LocalSampler needs at least one engine")
        self.engines = engines
        self.engine = engines[0]
        self._lanes = [_Lane(e, f"local-sampler-{i}" if len(engines) > 1 else "local-sampler")
                       for i, e in enumerate(engines)]
        self._route_lock = threading.Lock()
        self._recent: collections.OrderedDict[bytes, _Lane] = collections.OrderedDict()  # prompt -> its lane

    @property
    def stats(self) -> dict[str, float]:
        """The lanes' counters, summed (seconds are per lane: with two engines busy for one second
        each, decode_seconds grows by two); see `_Lane.stats`."""
        total: dict[str, float] = {}
        for lane in self._lanes:
            for key, value in lane.stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def _lane_for(self, prompt: np.ndarray) -> "_Lane":
        lanes = self._lanes
        if len(lanes) == 1:
            return lanes[0]
        best, best_reused = None, 0
        for lane in lanes:
            reused = lane.prefix_index.peek(prompt, lane.engine.version) if lane.engine.prefix_cache_entries else 0
            if reused > best_reused:
                best, best_reused = lane, reused
        if best is not None:
            return best
        # A prompt sent again (a group's episodes start from the same task) joins the lane that
        # has it: one batched prefill runs an identical prompt once.
        key = prompt.tobytes()
        with self._route_lock:
            lane = self._recent.get(key)
            if lane is None:
                lane = min(lanes, key=_Lane.load)
                self._recent[key] = lane
                if len(self._recent) > RECENT_PROMPTS:
                    self._recent.popitem(last=False)
            return lane

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> concurrent.futures.Future:
        prompt = check_prompt(self.engine, prompt_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        request = _Request(prompt, sampling, future, CompletionBuilder(sampling.max_tokens, self.engine.stop_token_ids))
        self._lane_for(prompt).push(request)
        return future

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> Completion:
        return await asyncio.wrap_future(self.submit(prompt_ids, sampling))

    def generate_many(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams()
                      ) -> list[Completion]:
        futures = [self.submit(p, sampling) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, params, version: int) -> None:
        for engine in self.engines:
            engine.update_weights(params, version)

    def sampler_stats(self) -> dict[str, float]:
        """A copy of `stats` (the same call on `BackgroundSamplerClient` sums the servers')."""
        return dict(self.stats)

    def is_alive(self) -> bool:
        """Whether every engine's decode thread is running (a request's failure never stops one)."""
        return all(lane.is_alive() for lane in self._lanes)

    def close(self) -> None:
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            lane.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Lane:
    """One engine's decode loop, in a thread of its own: admit waiting requests into free slots
    (prefill + insert), run `generate`, hand finished completions back."""

    def __init__(self, engine: AgentEngine, name: str):
        self.engine = engine
        self._pending: collections.deque[_Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.slots: dict[int, _Request] = {}
        self.prefix_index = PrefixIndex(engine.prefix_cache_entries)
        # idle_seconds: time the decode loop had no request at all (the sampler's idle time);
        # prefill_tokens: prompt tokens run through the model; reused_tokens: not run for this
        # request (taken from the prefix cache, or an identical prompt prefilled in the same batch);
        # decode_seconds / admit_seconds: wall time in `generate` calls / in prefilling admitted
        # requests; live_slots / decoded_slots: summed over generate calls, the requests decoding
        # and the slots the call ran (compact calls run fewer than max_concurrent_decodes);
        # cancelled: requests cancelled while queued, dropped without running.
        self.stats = {"generate_calls": 0, "tokens": 0, "requests": 0, "idle_seconds": 0.0,
                      "prefill_tokens": 0, "reused_tokens": 0, "prefix_hits": 0, "decode_seconds": 0.0,
                      "admit_seconds": 0.0, "live_slots": 0, "decoded_slots": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def load(self) -> int:
        """Requests decoding or waiting here (read without the lock: a routing hint)."""
        return len(self.slots) + len(self._pending)

    def push(self, request: _Request) -> None:
        with self._wake:
            if self._stopped:
                raise RuntimeError("the sampler is closed")
            self._pending.append(request)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def join(self) -> None:
        self._thread.join(timeout=30)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        engine = self.engine
        state = engine.init_decode_state()
        slots = self.slots
        # A heap: the lowest free slot is taken first, so live requests stay packed at the front and
        # `generate` decodes only as many slots as the highest live one needs.
        free = list(range(engine.max_concurrent_decodes))
        while True:
            with self._wake:
                idle_since = time.perf_counter()
                while not self._stopped and not slots and not self._pending:
                    self._wake.wait()
                self.stats["idle_seconds"] += time.perf_counter() - idle_since
                if self._stopped:
                    for request in slots.values():
                        request.future.set_exception(RuntimeError("the sampler was closed"))
                    for request in self._pending:
                        if request.future.set_running_or_notify_cancel():  # False: cancelled while queued
                            request.future.set_exception(RuntimeError("the sampler was closed"))
                    return
                admitted = []
                while free and self._pending:
                    request = self._pending.popleft()
                    # Running from here on: a caller that cancels it now (an asyncio task awaiting
                    # `generate`, cancelled) no longer cancels the future, whose result this thread
                    # sets when the request ends. One cancelled while queued is dropped unrun.
                    if request.future.set_running_or_notify_cancel():
                        admitted.append((heapq.heappop(free), request))
                    else:
                        self.stats["cancelled"] += 1
            if admitted:
                admit_started = time.perf_counter()
                state = self._admit(state, admitted, slots, free)
                self.stats["admit_seconds"] += time.perf_counter() - admit_started
            if not slots:
                continue
            try:
                decode_started = time.perf_counter()
                live = max(slots) + 1
                # The next token of every live request lies below this position (its prompt and
                # the tokens emitted so far): the call attends over a cache window that holds them.
                length = max(len(r.prompt) + len(r.builder.tokens) for r in slots.values())
                # The call may run on until a request finishes: at most until the first one reaches
                # its max_tokens (the device sees stop tokens, not token limits).
                remaining = min(r.builder.max_tokens - len(r.builder.tokens) for r in slots.values())
                state, result = engine.generate(None, state, live_slots=live, live_length=length,
                                                max_steps=remaining)
                data = np.asarray(result.data)
                self.stats["decode_seconds"] += time.perf_counter() - decode_started
                self.stats["live_slots"] += len(slots)
                self.stats["decoded_slots"] += engine.decode_rows(live)
            except Exception as err:  # noqa: BLE001 - fail the in-flight requests, keep serving
                for slot, request in slots.items():
                    request.future.set_exception(err)
                    heapq.heappush(free, slot)
                slots.clear()
                state = engine.init_decode_state()
                self.prefix_index.clear()  # the new state's pool is empty
                continue
            self.stats["generate_calls"] += 1
            finished = []
            columns = decode_result_lists(data[:live], engine.max_steps_per_call)
            for slot in list(slots):
                request = slots[slot]
                tokens, _, _ = request.builder.add_row({name: rows[slot] for name, rows in columns.items()})
                self.stats["tokens"] += len(tokens)
                if request.builder.finish_reason is not None:
                    finished.append(slot)
            if finished:
                state = self._save_prefixes(state, [(slot, slots[slot]) for slot in finished])
                state = engine.free_slots(state, finished)
            for slot in finished:
                request = slots.pop(slot)
                heapq.heappush(free, slot)
                self.stats["requests"] += 1
                request.future.set_result(request.builder.completion())

    def _admit(self, state, admitted: list[tuple[int, _Request]], slots: dict, free: list):
        params_version = self.engine.current_params()
        for _, request in admitted:
            request.version = params_version[1]
        state, errors = admit_requests(self.engine, self.prefix_index, state,
                                       [(slot, r.prompt, r.sampling) for slot, r in admitted], params_version,
                                       self.stats)
        for slot, request in admitted:
            if slot in errors:
                request.future.set_exception(errors[slot])
                heapq.heappush(free, slot)
            else:
                slots[slot] = request
        return state

    def _save_prefixes(self, state, finished: list[tuple[int, _Request]]):
        kept = [(slot, np.concatenate([r.prompt, np.asarray(r.builder.tokens, np.int32)]), r.version)
                for slot, r in finished if prefix_reusable(self.engine, r.prompt, r.builder, r.version)]
        return save_prefixes(self.engine, self.prefix_index, state, kept)


def admit_requests(engine: AgentEngine, index: PrefixIndex, state, items: list[tuple[int, np.ndarray, SamplingParams]],
                   params_version, stats: dict) -> tuple[object, dict[int, Exception]]:
    """Prefills `items` (slot, prompt ids, sampling) into their slots with the weights
    `params_version`; returns the new decode state and {slot: error} for prompts that failed.

    Prompts continuing a cached prefix run only their new tokens (`extend_insert_many`); the rest
    are prefilled whole. Batched calls by length (`_by_bucket`): a batch is padded to its longest
    prompt, and one long prompt (an error message as the observation, say) would otherwise pad
    every row to it. A failing batch is retried one prompt at a time, so a bad prompt fails alone.
    """
    version = params_version[1]
    fresh, continued = [], []
    for item in items:
        hit = index.lookup(item[1], version) if engine.prefix_cache_entries else None
        if hit is None:
            fresh.append(item)
        else:
            continued.append((item, hit))
    for group in _by_bucket(engine, continued, lambda c: c[0][1].size - c[1][1]):
        try:
            state = engine.extend_insert_many(
                [entry for _, (entry, _) in group], [start for _, (_, start) in group],
                [prompt[start:] for (_, prompt, _), (_, start) in group], [sampling for (_, _, sampling), _ in group],
                state, [slot for (slot, _, _), _ in group], params_version=params_version)
            for (_, prompt, _), (_, start) in group:
                stats["prefix_hits"] += 1
                stats["reused_tokens"] += start
                stats["prefill_tokens"] += prompt.size - start
        except Exception:  # noqa: BLE001 - fall back to prefilling the whole prompts
            fresh += [item for item, _ in group]
    failed = []
    for group in _by_bucket(engine, fresh, lambda item: item[1].size):
        try:
            state = engine.prefill_insert_many([prompt for _, prompt, _ in group], [s for _, _, s in group], state,
                                               [slot for slot, _, _ in group], params_version=params_version)
            distinct = {prompt.tobytes(): prompt.size for _, prompt, _ in group}  # run once each (see engine)
            stats["prefill_tokens"] += sum(distinct.values())
            stats["reused_tokens"] += sum(prompt.size for _, prompt, _ in group) - sum(distinct.values())
        except Exception:  # noqa: BLE001 - retry one by one
            failed += group
    errors = {}
    for slot, prompt, sampling in failed:
        try:
            prefix = engine.prefill(padded_tokens=prompt, true_length=len(prompt), sampling=sampling)
            state = engine.insert(prefix, state, slot)
            stats["prefill_tokens"] += prompt.size
        except Exception as err:  # noqa: BLE001 - a bad request fails alone
            errors[slot] = err
    return state, errors


def prefix_reusable(engine: AgentEngine, prompt: np.ndarray, builder: CompletionBuilder, version: int) -> bool:
    """Whether a finished request's keys/values may serve a continuing prompt: it ended normally
    (every token was run through the model), fits the cache with room to continue, and all its
    tokens were sampled by the version its prompt was prefilled with."""
    return (bool(engine.prefix_cache_entries) and builder.finish_reason in ("stop", "length")
            and prompt.size + len(builder.tokens) < engine.max_cache_length
            and all(v == version for v in builder.versions))


def save_prefixes(engine: AgentEngine, index: PrefixIndex, state, finished: list[tuple[int, np.ndarray, int]]):
    """Copies finished slots' keys/values into prefix-cache entries: (slot, its tokens, version)."""
    save_slots, entries, length = [], [], 0
    for slot, tokens, version in finished:
        entry = index.store(tokens, version)
        if entry is not None:
            save_slots.append(slot)
            entries.append(entry)
            length = max(length, len(tokens))
    if not save_slots:
        return state
    try:
        return engine.save_prefixes(state, save_slots, entries, length=length)
    except Exception:  # noqa: BLE001 - a cache that failed to fill is forgotten, never fatal
        logging.getLogger(__name__).warning("prefix cache save failed; cache cleared", exc_info=True)
        index.clear()
        return state
