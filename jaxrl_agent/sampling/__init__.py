"""Sampling: our JetStream engine, the in-process sampler, JetStream-served servers and their client.

JetStream is imported only inside this package (through `jetstream_compat`); the rest of the
system sees `Sampler` (`LocalSampler` or `SamplerClient`), `SamplingParams` and `Completion`.
"""

from jaxrl_agent.sampling.decoding import filter_logits, sample_tokens
from jaxrl_agent.sampling.engine import AgentEngine, PromptTooLongError, SamplingParams
from jaxrl_agent.sampling.local import Completion, LocalSampler, Sampler

__all__ = ["AgentEngine", "Completion", "LocalSampler", "PromptTooLongError", "Sampler", "SamplingParams",
           "filter_logits", "sample_tokens"]
