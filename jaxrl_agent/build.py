"""Builds the pieces a run needs from an ml-collections config: tokenizer, model, mesh.

The config stops here: everything below takes plain typed arguments. Importable from a notebook.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from jaxrl_agent import models, sharding, tokenizer as tokenizer_lib


def build_tokenizer(config) -> tokenizer_lib.Tokenizer:
    kind = config.tokenizer.kind
    path = config.tokenizer.path or (config.checkpoint.hf_path if kind == "hf" else "")
    return tokenizer_lib.make_tokenizer(kind, path or None)


def build_mesh(config) -> jax.sharding.Mesh:
    return sharding.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)


def build_model(config, mesh: jax.sharding.Mesh | None = None) -> tuple[models.ModelConfig, dict]:
    """(ModelConfig, params): loaded from `config.checkpoint.hf_path` or randomly initialised.

    With a mesh, parameters are placed in their sharded layout.
    """
    path = config.checkpoint.hf_path
    if path:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"config.checkpoint.hf_path={path!r} is not a folder")
        return models.load_hf(
            path, dtype=config.checkpoint.param_dtype, compute_dtype=config.checkpoint.compute_dtype, mesh=mesh
        )
    model_config = models.ModelConfig.from_config_dict(config.model)
    init = jax.jit(models.init_params, static_argnums=0)
    if mesh is not None:
        shapes = jax.eval_shape(init, model_config, jax.random.PRNGKey(0))
        init = jax.jit(models.init_params, static_argnums=0, out_shardings=sharding.param_shardings(shapes, mesh))
    params = init(model_config, jax.random.PRNGKey(config.seed))
    return model_config, params


def build_engine(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, *, version: int = 0):
    """The JetStream engine for the sampler section of the config."""
    from jaxrl_agent.sampling.engine import AgentEngine

    return AgentEngine(
        model_config, params, tok,
        max_concurrent_decodes=config.sampler.max_concurrent_decodes,
        max_prefill_length=config.sampler.max_prefill_length,
        max_cache_length=config.sampler.max_cache_length,
        steps_per_call=config.sampler.steps_per_call,
        version=version, seed=config.seed,
    )


def smoke_forward(config) -> dict:
    """Builds tokenizer, mesh and model and runs one sharded forward pass; returns a summary."""
    mesh = build_mesh(config)
    start = time.perf_counter()
    model_config, params = build_model(config, mesh)
    tok = build_tokenizer(config)
    if tok.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {model_config.vocab_size}"
        )
    rows = tok.encode("Q: 17*23+5=?") * config.smoke.seq_len
    batch = np.tile(np.asarray(rows[: config.smoke.seq_len], np.int32), (config.smoke.batch_size, 1))
    forward = sharding.sharded_forward(model_config, mesh, params)
    logits = forward(params, jax.device_put(batch, sharding.batch_sharding(mesh)))
    logits = np.asarray(jax.device_get(logits))
    if not np.all(np.isfinite(logits)):
        raise FloatingPointError("the forward pass produced non-finite logits")
    return {
        "architecture": model_config.architecture,
        "params": models.count_params(params),
        "mesh": dict(mesh.shape),
        "logits_shape": tuple(logits.shape),
        "mean_next_token_nll": float(
            -np.mean(np.take_along_axis(_log_softmax(logits[:, :-1]), batch[:, 1:, None], -1))
        ),
        "seconds": round(time.perf_counter() - start, 2),
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
