"""Device mesh and parameter partitioning.

The mesh has three named axes:
  * `data`   — pure data parallelism (parameters replicated),
  * `fsdp`   — data parallelism with parameters and optimizer state sharded (ZeRO-3 style),
  * `tensor` — Megatron-style tensor parallelism over heads and the MLP hidden width.
Batches are split over `('data', 'fsdp')`. Parameters get a `PartitionSpec` from ordered
regex rules over their path ('layers/attn/q_proj/kernel'); a mesh axis that does not divide the
dimension it would shard is dropped for that parameter (e.g. 2 KV heads on tensor=4), so any
model runs on any mesh, and `param_shardings` says what actually happened.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (regex over the '/'-joined parameter path, spec). First match wins. Layer-stacked parameters
# have a leading L axis, which is never sharded.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed/embedding$", P("tensor", "fsdp")),                    # [V, H]
    (r"^lm_head$", P("fsdp", "tensor")),                            # [H, V]
    (r"attn/(q|k|v)_proj/kernel$", P(None, "fsdp", "tensor", None)),  # [L, H, heads, D]
    (r"attn/(q|k|v)_proj/bias$", P(None, "tensor", None)),           # [L, heads, D]
    (r"attn/o_proj/kernel$", P(None, "tensor", None, "fsdp")),      # [L, heads, D, H]
    (r"mlp/(gate|up)_proj/kernel$", P(None, "fsdp", "tensor")),      # [L, H, I]
    (r"mlp/down_proj/kernel$", P(None, "tensor", "fsdp")),           # [L, I, H]
    (r"(norm|scale)", P()),                                          # norms: replicated
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh; one size may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise ValueError(
            f"mesh data={data} fsdp={fsdp} tensor={tensor} does not fit {len(devices)} devices"
        )
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def mesh_from_config(cfg) -> Mesh:
    """Builds the mesh from a config section with fields `data`, `fsdp`, `tensor`."""
    return make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor)


def path_name(path) -> str:
    """'layers/attn/q_proj/kernel' for a pytree key path."""
    parts = []
    for entry in path:
        parts.append(str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))))
    return "/".join(parts)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drops mesh axes that do not divide the dimension they would shard."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than shape {shape}")
    fitted = []
    for dim, axis in zip(shape, entries):
        if axis is None:
            fitted.append(None)
            continue
        axes = axis if isinstance(axis, tuple) else (axis,)
        size = int(np.prod([mesh.shape[a] for a in axes]))
        fitted.append(axis if size > 1 and dim % size == 0 else None)
    while fitted and fitted[-1] is None:  # canonical form: P(None, None) == P()
        fitted.pop()
    return P(*fitted)


def param_partition_specs(params, mesh: Mesh, rules=PARAM_RULES):
    """PartitionSpec for every leaf of `params` (shapes may be arrays or ShapeDtypeStructs)."""
    def spec_for(path, leaf):
        name = path_name(path)
        for pattern, spec in rules:
            if re.search(pattern, name):
                return fit_spec(spec, tuple(leaf.shape), mesh)
        raise ValueError(f"no partition rule matches parameter {name!r} with shape {tuple(leaf.shape)}")

    return jax.tree_util.tree_map_with_path(spec_for, params)


def param_shardings(params, mesh: Mesh, rules=PARAM_RULES):
    """NamedSharding for every parameter leaf."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_partition_specs(params, mesh, rules),
        is_leaf=lambda x: isinstance(x, P),
    )


def place_params(params, mesh: Mesh | None, rules=PARAM_RULES):
    """Host (or device) parameters placed on `mesh` with the shardings the rules assign; with no
    mesh, on the default device."""
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, params)
    return jax.tree.map(jax.device_put, params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis over ('data', 'fsdp'); the other axes replicated (any rank)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def constrain_rows(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """`x` [B, ...] inside a jit, its rows over ('data', 'fsdp') like the batch (no-op without a mesh).

    Where activations meet a parameter sharded over 'fsdp' (the output projection [H, V] shards
    H), XLA's propagation may otherwise follow the parameter and shard H instead of the rows: every
    device then computes partial [B, c, V] logits for all rows and reduces them. On 8 simulated CPU
    devices that made a Qwen3-vocabulary learner step hold 15.9 GB and take 11 s; with the rows
    pinned, 3.5 GB and 1.7 s (tests/learner/test_step.py checks the compiled step's memory)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, batch_sharding(mesh))


def gather_output_kernel(kernel: jax.Array, mesh: Mesh | None) -> jax.Array:
    """The output projection [H, V] inside a jit, gathered over ('data', 'fsdp') and kept split over
    V by 'tensor' (as `PARAM_RULES` shard lm_head, and the tied embedding's transpose): ZeRO-3 gathers
    a layer's weights where they are used. No-op without a mesh."""
    if mesh is None:
        return kernel
    return jax.lax.with_sharding_constraint(kernel, NamedSharding(mesh, fit_spec(P(None, "tensor"), kernel.shape, mesh)))


def put_batch(batch, mesh: Mesh):
    """This process's rows of a learner batch (a pytree of [rows, ...] host arrays) as one global
    array per leaf, rows over ('data', 'fsdp'): with several processes (`jax.distributed`) each holds
    its own rows and the global batch is their concatenation in process order
    (`jax.make_array_from_process_local_data`); with one process, the batch itself."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def to_host(x) -> np.ndarray:
    """A global array's whole value on this host (every process gets all of it; one collective when
    the array spans several processes)."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_host_tree(tree):
    """`to_host` of every leaf, with one collective for the whole tree when any leaf spans several
    processes (a parameter tree sharded over a multi-process mesh); leaves already on this host
    are returned as they are."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def process_share(total: int, index: int | None = None, count: int | None = None) -> int:
    """This process's part of a global count split over the processes (the first `total % count`
    take one more): a config's batch sizes are the job's, whatever the number of processes."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    return total // count + (1 if index < total % count else 0)


def gather_objects(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (`[obj]` with one process). Every
    process must call it."""
    import json

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(agree_max([data.size])[0])
    padded = np.zeros(size + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
    padded[8:8 + data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)
    return [json.loads(row[8:8 + int(np.frombuffer(row[:8].tobytes(), np.int64)[0])].tobytes()) for row in rows]


def agree_max(values) -> np.ndarray:
    """The element-wise maximum of `values` (ints) over all processes; `values` itself with one
    process. Every process must call it, with the same length."""
    values = np.asarray(values, np.int64)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1).max(axis=0)


def shard_params(params, mesh: Mesh, rules=PARAM_RULES):
    """Places parameters on the mesh according to the rules."""
    return jax.tree.map(jax.device_put, params, param_shardings(params, mesh, rules))


def sharded_forward(config, mesh: Mesh, params):
    """A jitted `models.forward` with explicit NamedShardings for params, tokens and logits.

    Returns `fn(params, tokens) -> logits [B, T, V]`; tokens' batch dimension must be divisible by
    data * fsdp.
    """
    from jaxrl_agent import models

    in_shardings = (param_shardings(params, mesh), batch_sharding(mesh))
    out_sharding = batch_sharding(mesh)
    return jax.jit(
        lambda p, tokens: models.forward(config, p, tokens),
        in_shardings=in_shardings,
        out_shardings=out_sharding,
    )
