"""What the rest of the system knows of a sampler: the protocol, sampling parameters, completions.

No JetStream and no JAX here: `rollout/`, `rewards/` and `agent` code import this module, and any
sampler — the in-process `LocalSampler`, the JetStream `SamplerClient`, a test's scripted one —
implements `Sampler`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

FINISH_REASONS = ("stop", "length", "context_limit")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "SamplingParams":
        return cls(**dict(d))


class PromptTooLongError(ValueError):
    """A prompt that does not fit the sampler; never truncated."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the sampler produced for one request, token by token.

    token_ids: the generated ids (a final stop token included); logprobs: log q of each under the
    distribution it was sampled from; versions: the policy version that sampled each;
    finish_reason: 'stop' (stop token), 'length' (max_tokens) or 'context_limit' (cache full).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str

    def to_dict(self) -> dict:
        return {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                "versions": list(self.versions), "finish_reason": self.finish_reason}

    @classmethod
    def from_dict(cls, d) -> "Completion":
        return cls(tuple(int(t) for t in d["token_ids"]), tuple(float(x) for x in d["logprobs"]),
                   tuple(int(v) for v in d["versions"]), d["finish_reason"])


class Sampler(Protocol):
    """What rollouts and the trainer need from a sampler, local or remote.

    generate: one request's completion (raises PromptTooLongError for a prompt that cannot fit).
    update_weights: new parameters, tagged with the policy version that every later token carries.
    sampler_stats: cumulative counters (idle_seconds, prefill_tokens, reused_tokens,
      generate_calls, decode_seconds, admit_seconds, live_slots, decoded_slots).
    close: stops the sampler's threads or connections.
    """

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion: ...

    def update_weights(self, params, version: int) -> None: ...

    def sampler_stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
