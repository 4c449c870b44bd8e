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
        model_config, host_params = models.load_hf(
            path, dtype=config.checkpoint.param_dtype, compute_dtype=config.checkpoint.compute_dtype)
        return model_config, sharding.place_params(host_params, mesh)
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
        prefix_cache_entries=config.sampler.prefix_cache_entries,
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


class SamplerServers:
    """`n` JetStream sampler server processes (`launch/sampler_server.py`) on this host, serving the
    run's exact config, and a client over all of them.

    The config (with its command-line overrides) is written to `<workdir>/sampler_config.py`, a
    config file that rebuilds it from JSON, and each server loads it. Servers start from the same
    random init as the trainer; the trainer pushes its weights before the first sample.
    """

    def __init__(self, config, n: int, workdir: str, startup_timeout_s: float = 300.0):
        import json
        import subprocess
        import sys

        from jaxrl_agent.sampling.client import BackgroundSamplerClient

        os.makedirs(workdir, exist_ok=True)
        config_path = os.path.join(os.path.abspath(workdir), "sampler_config.py")
        with open(config_path, "w") as f:
            f.write('"""Written by the trainer: the run\'s config for its sampler servers."""\n'
                    "import json\n\nimport ml_collections\n\n\ndef get_config():\n"
                    f"    return ml_collections.ConfigDict(json.loads({json.dumps(config.to_json())}))\n")
        launcher = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                                "sampler_server.py")
        env = dict(os.environ)
        if jax.default_backend() == "cpu":
            # One CPU device per server (not a simulated mesh a test may have asked this process
            # for); other XLA flags are kept, since they are part of the persistent cache's key.
            flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
            env.pop("XLA_FLAGS", None)
            if flags:
                env["XLA_FLAGS"] = " ".join(flags)
            env["JAX_PLATFORMS"] = "cpu"
        self.processes = [subprocess.Popen([sys.executable, launcher, "--config", config_path, "--port", "0"],
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                          for _ in range(n)]
        addresses = []
        deadline = time.monotonic() + startup_timeout_s
        for process in self.processes:
            for line in process.stdout:
                if line.startswith("sampler server listening on "):
                    addresses.append(line.split()[-1])
                    break
                if time.monotonic() > deadline:
                    break
            else:
                self.close()
                raise RuntimeError(f"sampler server {process.args} exited with {process.poll()} before serving")
        if len(addresses) != n:
            self.close()
            raise RuntimeError(f"only {len(addresses)} of {n} sampler servers started within {startup_timeout_s}s")
        self.addresses = addresses
        self.client = BackgroundSamplerClient(addresses)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a stuck server is killed
                process.kill()
