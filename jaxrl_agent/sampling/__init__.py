"""Sampling: our JetStream engine, the in-process sampler, JetStream-served servers and their client.

JetStream is imported only inside this package (through `jetstream_compat`), and only when an
engine, sampler or server is used: the rest of the system sees `sampling.types` — `Sampler`,
`SamplingParams`, `Completion`, `PromptTooLongError` — which imports neither JetStream nor JAX.
"""

import importlib

from jaxrl_agent.sampling.types import Completion, PromptTooLongError, Sampler, SamplingParams

# Imported on first use (they bring in JAX and JetStream).
_LAZY = {"AgentEngine": "engine", "LocalSampler": "local", "filter_logits": "decoding",
         "sample_tokens": "decoding"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"jaxrl_agent.sampling.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxrl_agent.sampling' has no attribute {name!r}")


__all__ = ["AgentEngine", "Completion", "LocalSampler", "PromptTooLongError", "Sampler", "SamplingParams",
           "filter_logits", "sample_tokens"]
