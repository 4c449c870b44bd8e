"""The host-side index of the engine's prefix cache: which token sequences its entries hold.

A multi-turn episode sends its whole history as the next prompt: turn t + 1's prompt is turn t's
prompt, turn t's completion, then the environment's observation. Prefilling that history again
costs more than decoding the turn itself (on the 2-core default, prefill was ~75% of sampling
time). The engine keeps, per entry, the keys and values of a finished request's tokens (prompt +
completion, all of which were run through the model while decoding); a prompt that starts with
such a sequence prefills only its remaining tokens (`AgentEngine.extend_insert_many`). This is
automatic prefix caching (vLLM) restricted to exact continuations of one finished request, which is
what agentic turns are.

Entries are valid for one policy version: keys and values computed by older weights would make
the sampler draw from a mixture of policies while labelling the tokens with the new version. The
index is cleared whenever it is used with a newer version. Eviction takes entries that were just
continued first (their continuation will store a longer sequence that contains them), then the
least recently stored.

Its methods are thread-safe: a `LocalSampler` with several engines asks each engine's index, from
the submitting thread, which one holds a prompt's prefix (`peek`) while that engine's thread looks
up and stores entries.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import numpy as np


class PrefixIndex:
    """Maps token sequences to prefix-cache entries 0..capacity-1 (one policy version)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._lock = threading.RLock()
        self.version: int | None = None
        self._entries: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> entry, evicted first
        self._keys: dict[int, bytes] = {}  # entry -> key
        self._lengths: collections.Counter[int] = collections.Counter()  # stored sequence lengths
        self.stats = {"hits": 0, "misses": 0, "reused_tokens": 0, "stored": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forgets every entry (e.g. when the engine's cache contents are lost)."""
        with self._lock:
            self._entries.clear()
            self._keys.clear()
            self._lengths.clear()

    def _sync_version(self, version: int) -> None:
        if version != self.version:
            self.clear()
            self.version = version

    @staticmethod
    def _key(tokens: np.ndarray) -> bytes:
        return np.ascontiguousarray(tokens, np.int32).tobytes()

    def lookup(self, prompt: Sequence[int] | np.ndarray, version: int) -> tuple[int, int] | None:
        """(entry, start) for the longest stored sequence that `prompt` continues, or None.

        `start` positions of the entry are reused; at least the prompt's last token is left to run
        (its logits sample the next token), so start <= len(prompt) - 1.
        """
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        with self._lock:
            return self._lookup(prompt, version)

    def _lookup(self, prompt: np.ndarray, version: int) -> tuple[int, int] | None:
        self._sync_version(version)
        for length in sorted(self._lengths, reverse=True):
            if length > prompt.size:
                continue
            entry = self._entries.get(self._key(prompt[:length]))
            if entry is not None:
                self._entries.move_to_end(self._keys[entry], last=False)  # consumed: evict first
                start = min(length, prompt.size - 1)
                if start < 1:
                    break
                self.stats["hits"] += 1
                self.stats["reused_tokens"] += start
                return entry, start
        self.stats["misses"] += 1
        return None

    def peek(self, prompt: Sequence[int] | np.ndarray, version: int) -> int:
        """How many of `prompt`'s tokens `lookup` would reuse now (0: none), changing nothing: no
        statistics, no eviction order, and an index of another version counts as empty."""
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        with self._lock:
            if version != self.version:
                return 0
            for length in sorted(self._lengths, reverse=True):
                if length <= prompt.size and self._key(prompt[:length]) in self._entries:
                    start = min(length, prompt.size - 1)
                    return start if start >= 1 else 0
            return 0

    def store(self, tokens: Sequence[int] | np.ndarray, version: int) -> int | None:
        """Reserves the entry that will hold `tokens` (computed at `version`); None when the index
        has no capacity or `version` is not the newest. The caller copies the keys and values in."""
        key = self._key(np.asarray(tokens, np.int32).reshape(-1))
        with self._lock:
            return self._store(key, version)

    def _store(self, key: bytes, version: int) -> int | None:
        if self.capacity == 0 or (self.version is not None and version < self.version):
            return None
        self._sync_version(version)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        if len(self._entries) < self.capacity:
            entry = len(self._entries)  # entries fill 0, 1, ... and are only ever reused by eviction
        else:
            old_key, entry = self._entries.popitem(last=False)
            del self._keys[entry]
            self._lengths[len(old_key) // 4] -= 1
            if not self._lengths[len(old_key) // 4]:
                del self._lengths[len(old_key) // 4]
            self.stats["evicted"] += 1
        self._entries[key] = entry
        self._keys[entry] = key
        self._lengths[len(key) // 4] += 1
        self.stats["stored"] += 1
        return entry
