"""Memory plans: bytes per device of a learner step and of the in-process sampler, from shapes alone.

    plan = memory_plan.learner_memory(model, rows=8, row_length=1024, targets=256, logits_chunk=128,
                                      master_dtype="float32")
    plan.total, plan.as_dict()

The learner's peak is its state (exact: parameters, float32 master copy, the two AdamW moments, a
frozen reference when a KL term needs one, the batch) plus the step's temporaries. With
`model.remat` on, the backward pass keeps only each block's input (`carry`: L x rows x T x H in
the compute dtype) and rebuilds one block at a time, so the temporaries are one block's working
set and the chunked log-softmax's:

    temporaries = c_S * rows*N*T^2*4        (attention scores, probabilities, their cotangents; f32)
                + c_M * rows*T^2*4          (the additive causal/segment mask)
                + c_I * rows*T*I*4          (SwiGLU gate, up, their product and cotangents)
                + c_Q * rows*T*(N+2K)*D*4   (queries, keys, values)
                + c_H * rows*T*H*4          (residual stream, norms)
                + c_C * L*rows*T*H*bytes    (the saved block inputs)
                + c_V * rows*chunk*V*4      (one chunk of logits)
                + c_X * rows*targets*H*4    (hidden states gathered at trained positions)
                + (c_E * V*H + c_P * (P - V*H) + c_B * (P - V*H) / L) * 4
                                            (gradient accumulator, one block's gradient, update temporaries)

The counts c are not guessed: they are the number of arrays of each size XLA's buffer assignment
keeps live at the step's peak, fitted (the smallest largest relative error, a linear program) over
36 float32 and 31 bfloat16 compiled tiny configurations (`jax.jit(...).lower(...).compile().memory_analysis()`,
jax 0.10, XLA:CPU) and checked on other shapes in `benchmarks/memory_plan.py` and its test (within
10% of the compiled peak). They differ by compute dtype because XLA:CPU computes bfloat16
elementwise math in float32. On a GPU or TPU, fusion differs: `benchmarks/accelerator_check.py`
compares the plan with the device's measured peak (`memory_stats()['peak_bytes_in_use']`).

Sharding (`shards`): parameters, master copy and moments are split over the mesh's fsdp x tensor
devices, the batch rows over data x fsdp (`batch_shards`); every device gathers one block's
parameters at a time (`gathered`).

The sampler: its own copy of the parameters (the learner donates its state each step), the
key/value cache of every slot, and the prefix cache's entries.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_agent.models import ModelConfig
from jaxrl_agent.models.config import dtype_from_name

# Live-array counts at the learner step's peak per compute dtype (remat on), from XLA's buffer
# assignment (see the module docstring; `benchmarks/memory_plan.py --fit` re-derives them). float32
# refitted (`--fit 36 --dtype float32`) when the attention softmax's derivative stopped keeping the
# exp, sum and division intermediates: fewer [rows, N, T, T] arrays live (scores 2.71 -> 1.69).
TEMPORARY_COUNTS = {
    "float32": dict(scores=1.69, mask=2.02, mlp=3.24, qkv=4.16, residual=0.0, carry=2.03, logits=0.0, gathered=0.0,
                    embedding_grads=2.33, layer_grads=1.82, block_grads=0.0),
    "bfloat16": dict(scores=3.93, mask=0.28, mlp=1.97, qkv=1.06, residual=4.6, carry=3.0, logits=1.78, gathered=0.0,
                     embedding_grads=1.62, layer_grads=2.7, block_grads=0.0),
}
GIB = 2**30
ACTIVATION_PARTS = ("block_working_set", "saved_block_inputs", "logits", "gathered_block")


def parameter_count(model: ModelConfig) -> tuple[int, int]:
    """(embedding and output parameters, block and final-norm parameters) of a dense decoder."""
    h, n, k, d, i = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size
    embedding = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    block = h * (n + 2 * k) * d + n * d * h + 3 * h * i + 2 * h
    if model.attention_bias:
        block += (n + 2 * k) * d
    if model.qk_norm:
        block += 2 * d
    return embedding, model.num_layers * block + h


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, by part."""

    parts: dict

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    @property
    def activations(self) -> int:
        """The temporaries that scale with the batch rows (and the gathered block's parameters)."""
        return int(sum(self.parts.get(p, 0) for p in ACTIVATION_PARTS))

    def as_dict(self) -> dict:
        return {**{k: int(v) for k, v in self.parts.items()}, "total": self.total}

    def gib(self, part: str | None = None) -> float:
        return (self.total if part is None else self.parts[part]) / GIB


def _bytes(dtype: str) -> int:
    return np.dtype(dtype_from_name(dtype)).itemsize


def learner_memory(model: ModelConfig, *, rows: int, row_length: int, targets: int = 0, logits_chunk: int = 0,
                   master_dtype: str = "", reference: bool = False, shards: int = 1, batch_shards: int = 1
                   ) -> MemoryPlan:
    """The learner step's peak bytes per device, for `rows` packed rows of `row_length` tokens per
    microbatch (`targets` trained positions per row, 0 = every position), with block remat on.

    Raises ValueError for a model without remat (the counts describe the rematerialised step) or
    for shapes that cannot be split over the devices given."""
    if not model.remat:
        raise ValueError("learner_memory plans the rematerialised step: expected model.remat=True "
                         f"(got remat={model.remat}); a step without remat keeps every block's activations")
    if model.dtype not in TEMPORARY_COUNTS:
        raise ValueError(f"model.dtype={model.dtype!r}: expected one of {sorted(TEMPORARY_COUNTS)}")
    if rows % batch_shards:
        raise ValueError(f"rows={rows} do not split over batch_shards={batch_shards}")
    counts = TEMPORARY_COUNTS[model.dtype]
    embedding, layers = parameter_count(model)
    params = embedding + layers
    p_bytes, a_bytes = _bytes(model.param_dtype), _bytes(model.dtype)
    master = bool(master_dtype) and master_dtype != model.param_dtype  # init_state keeps none otherwise
    m_bytes = _bytes(master_dtype) if master else p_bytes
    r, t = rows // batch_shards, row_length
    h, n, k, d, i, v, l = (model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                           model.intermediate_size, model.vocab_size, model.num_layers)
    positions = targets or t
    chunk = logits_chunk if 0 < logits_chunk < positions else positions
    batch_arrays = 8 * r * t * 4 + (r * targets * 4 if targets else 0)
    block = (counts["scores"] * r * n * t * t * 4 + counts["mask"] * r * t * t * 4 + counts["mlp"] * r * t * i * 4
             + counts["qkv"] * r * t * (n + 2 * k) * d * 4 + counts["residual"] * r * t * h * 4)
    logits = counts["logits"] * r * chunk * v * 4 + counts["gathered"] * r * positions * h * 4
    gradients = (counts["embedding_grads"] * embedding + counts["layer_grads"] * layers
                 + counts["block_grads"] * layers / l) * m_bytes / shards
    parts = dict(
        parameters=params * p_bytes / shards,
        master=(params * m_bytes / shards) if master else 0,
        optimizer=2 * params * m_bytes / shards,
        reference=(params * p_bytes / shards) if reference else 0,
        batch=batch_arrays,
        block_working_set=block,  # one block rebuilt for its backward pass (remat)
        saved_block_inputs=counts["carry"] * l * r * t * h * a_bytes,
        logits=logits,
        gathered_block=2 * (layers / l) * p_bytes if shards > 1 else 0,  # one block's parameters, all-gathered
        gradients=gradients,
    )
    return MemoryPlan(parts)


def sampler_memory(model: ModelConfig, *, slots: int, cache_length: int, prefix_cache_entries: int = 0,
                   cache_dtype: str | None = None, engines: int = 1) -> MemoryPlan:
    """The in-process sampler's bytes on its device: a parameter copy per engine
    (`sampler.local_engines`), the key/value cache of every slot (L x 2 x K x D x cache_length each)
    and the prefix cache's entries (one slot's cache each); `slots` and `prefix_cache_entries` are
    all engines' together."""
    embedding, layers = parameter_count(model)
    per_slot = model.num_layers * 2 * model.num_kv_heads * model.head_dim * cache_length * _bytes(
        cache_dtype or model.dtype)
    return MemoryPlan(dict(parameters=engines * (embedding + layers) * _bytes(model.param_dtype), kv_cache=slots * per_slot,
                           prefix_cache=prefix_cache_entries * per_slot))
