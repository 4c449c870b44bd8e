"""Builds the pieces a run needs from an ml-collections config: tokenizer, model, mesh.

The config stops here: everything below takes plain typed arguments. Importable from a notebook.
"""

from __future__ import annotations

import math
import os
import time
import zlib

import jax
import numpy as np

from jaxrl_agent import models, run_schedule, sharding, tokenizer as tokenizer_lib


def tokenizer_path(config) -> str:
    """The run's Hugging Face tokenizer: `tokenizer.path` (a tokenizer.json or its folder), else the
    checkpoint folder `checkpoint.hf_path`; '' for the built-in character tokenizer."""
    if config.tokenizer.kind != "hf":
        return ""
    return config.tokenizer.path or config.checkpoint.hf_path


def tokenizer_folder(config) -> str:
    """The folder of `tokenizer_path` (where tokenizer_config.json, the chat template and
    generation_config.json lie); '' for the built-in character tokenizer."""
    path = tokenizer_path(config)
    return path if not path or os.path.isdir(path) else os.path.dirname(path)


def build_tokenizer(config) -> tokenizer_lib.Tokenizer:
    return tokenizer_lib.make_tokenizer(config.tokenizer.kind, tokenizer_path(config) or None)


def build_template(config):
    """The turn template of `tokenizer.template`: a built-in one ('chatml', 'llama3'), or 'model':
    the tokenizer folder's own Jinja chat template (`chat_template.ChatTemplate`), with
    `rollout.enable_thinking` passed as the template's switch."""
    name = config.tokenizer.template
    if name != "model":
        return tokenizer_lib.make_template(name)
    from jaxrl_agent import chat_template

    try:
        return chat_template.ChatTemplate.from_folder(
            tokenizer_folder(config), options=(("enable_thinking", bool(config.rollout.enable_thinking)),))
    except chat_template.ChatTemplateError as err:
        raise ConfigError(f"tokenizer.template='model': {err}") from None


def episode_settings(config, temperature: float):
    """How episodes are sampled and shown to the policy (`rollout.EpisodeSettings`): at
    `temperature` (0 = greedy, for evaluation) with `rollout.top_k` / `rollout.top_p` (the sampler
    records log-probs of the truncated distribution it drew from, so the learner's correction sees
    the truncation), the context and turn limits, the tool format and the think budget."""
    from jaxrl_agent import rollout
    from jaxrl_agent.sampling.types import SamplingParams

    c = config.rollout
    return rollout.EpisodeSettings(
        sampling=SamplingParams(temperature=temperature, max_tokens=c.max_tokens_per_turn, top_k=c.top_k,
                                top_p=c.top_p),
        max_context=c.max_context, include_system_prompt=c.include_system_prompt, max_turns=c.max_turns,
        tool_format=config.tokenizer.tool_format, max_think_tokens=c.max_think_tokens, history=c.history,
        context=context_settings(config))


def context_settings(config):
    """`rollout.ContextSettings` from `rollout.context*` (raises ValueError on a bad value)."""
    from jaxrl_agent.rollout import context as context_lib

    c = config.rollout
    return context_lib.ContextSettings(strategy=c.context, keep_turns=c.context_keep_turns, trigger=c.context_trigger,
                                       max_edits=c.context_max_edits, note=c.context_note,
                                       summary_request=c.context_summary_request,
                                       summary_prefix=c.context_summary_prefix, tool=c.context_tool)


def template_history(config, template) -> tuple[dict, str | None]:
    """(start-record fields, console line or None) on how the chat template treats earlier turns:
    nothing when it only appends; where it rewrites them (Qwen3 with thinking off drops earlier
    replies' empty think blocks), `template_rewrites_history` and what the run does about it —
    re-render each turn and train one learner sequence per rewrite (rollout.history='template'), or
    keep append-only episodes whose later contexts differ from a deployment's ('append', a warning)."""
    rewritten = template.rewritten_history() if hasattr(template, "rewritten_history") else None
    if not rewritten:
        return {}, None
    fields = {"template_rewrites_history": rewritten, "history": config.rollout.history}
    if config.rollout.history == "template":
        return fields, (f"chat template {template.name} rewrites earlier turns ({rewritten}): each turn's context is "
                        "re-rendered as a deployment shows it, and an episode is one learner sequence per rewrite")
    return fields, (f"warning: chat template {template.name} rewrites earlier turns ({rewritten}): with "
                    "rollout.history='append' episodes train on what the sampler saw, but a deployment that "
                    "re-renders the history shows the model a different context")


def build_mesh(config) -> jax.sharding.Mesh:
    return sharding.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)


def build_model(config, mesh: jax.sharding.Mesh | None = None) -> tuple[models.ModelConfig, dict]:
    """(ModelConfig, params): loaded from `config.checkpoint.hf_path` or randomly initialised, then
    replaced by the newest checkpoint's of the run in `checkpoint.init_from` when it is set.

    With a mesh, parameters are placed in their sharded layout.
    """
    path = config.checkpoint.hf_path
    if path:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"config.checkpoint.hf_path={path!r} is not a folder")
        model_config, host_params = models.load_hf(
            path, dtype=config.checkpoint.param_dtype, compute_dtype=config.checkpoint.compute_dtype)
        params = sharding.place_params(host_params, mesh)
        if config.checkpoint.init_from:
            params = params_from_run(config, config.checkpoint.init_from, params)
        return model_config, params
    model_config = models.ModelConfig.from_config_dict(config.model)
    init = jax.jit(models.init_params, static_argnums=0)
    if mesh is not None:
        shapes = jax.eval_shape(init, model_config, jax.random.PRNGKey(0))
        init = jax.jit(models.init_params, static_argnums=0, out_shardings=sharding.param_shardings(shapes, mesh))
    params = init(model_config, jax.random.PRNGKey(config.seed))
    if config.checkpoint.init_from:
        params = params_from_run(config, config.checkpoint.init_from, params)
    return model_config, params


def params_from_run(config, workdir: str, params):
    """The parameters of the newest checkpoint of the run in `workdir`, in `params`' dtypes and
    shardings (`checkpoint.init_from`: a stage starts from the previous stage's final policy)."""
    from jaxrl_agent import checkpoint

    target = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    try:
        restored, _, _ = checkpoint.restore_policy(os.path.join(workdir, "checkpoints"), params,
                                                   keep=config.checkpoint.keep)
    except FileNotFoundError as err:
        raise ConfigError(f"checkpoint.init_from={workdir!r}: {err}") from None
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"checkpoint.init_from={workdir!r}: its parameters do not restore into the policy's "
                          f"shapes {jax.tree.map(lambda t: t.shape, target)} ({err})") from None
    return jax.tree.map(lambda r, p: jax.device_put(r, p.sharding), restored, params)


def stop_token_ids(config, tok: tokenizer_lib.Tokenizer) -> tuple[int, ...]:
    """Ids that end a sample: the turn template's end marker (when it is one token), the
    tokenizer's eos, and the checkpoint's `generation_config.json` `eos_token_id` (an id or a
    list; Qwen3 lists <|im_end|> and <|endoftext|>) from the tokenizer's folder."""
    import json

    ids = []
    end = build_template(config).end_ids(tok)
    if len(end) == 1:
        ids.append(end[0])
    ids.append(tok.eos_id)
    folder = tokenizer_folder(config)
    generation_file = os.path.join(folder, "generation_config.json") if folder else ""
    if generation_file and os.path.exists(generation_file):
        with open(generation_file) as f:
            eos = json.load(f).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def build_engine(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, *, version: int = 0,
                 slots: int | None = None, cache_entries: int | None = None, seed: int | None = None,
                 decode_choice=None, shape_reuse: dict | None = None):
    """The JetStream engine for the sampler section of the config, with the decode options chosen
    for this host (`sampler.decode_options`; `engine.decode_choice` says which and how). `slots`,
    `cache_entries` and `seed` replace the config's (`build_engines` splits them between engines);
    `decode_choice`, one already made (`host_tuning.DecodeChoice`), is applied instead of choosing;
    `shape_reuse`, the programs' compiled shapes shared with other engines (None = the engine's
    own, `engine_shape_reuse`)."""
    from jaxrl_agent.sampling import host_tuning
    from jaxrl_agent.sampling.engine import AgentEngine

    engine = AgentEngine(
        model_config, params, tok, stop_token_ids=stop_token_ids(config, tok),
        max_concurrent_decodes=config.sampler.max_concurrent_decodes if slots is None else slots,
        max_prefill_length=config.sampler.max_prefill_length,
        max_cache_length=config.sampler.max_cache_length,
        steps_per_call=config.sampler.steps_per_call, max_steps_per_call=config.sampler.max_steps_per_call,
        prefix_cache_entries=config.sampler.prefix_cache_entries if cache_entries is None else cache_entries,
        version=version, seed=config.seed if seed is None else seed,
        shape_reuse=engine_shape_reuse(config) if shape_reuse is None else shape_reuse,
    )
    if decode_choice is not None:
        engine.set_decode_compiler_options(*decode_choice.options)
        engine.decode_choice = decode_choice
        return engine
    host_tuning.tune_engine(engine, config.sampler.decode_options,
                            cache_path=host_tuning.host_choices_path(config.get("compilation_cache_dir", "")))
    return engine


def engine_shape_reuse(config) -> dict:
    """An engine's programs' `ShapeReuse`s: the batched admissions' (`sampler.shape_reuse_calls`)
    and the decode loop's (`sampler.decode_shape_reuse_calls`); a program whose value is 0 has none."""
    from jaxrl_agent.shape_reuse import ShapeReuse

    calls = {"prefill": config.sampler.shape_reuse_calls, "extend": config.sampler.shape_reuse_calls,
             "decode": config.sampler.decode_shape_reuse_calls}
    return {program: ShapeReuse(float(c)) for program, c in calls.items() if c > 0}


# Engine i > 0 of an in-process sampler samples with seed config.seed + i * LANE_SEED_STRIDE (engine 0
# with config.seed itself, as a one-engine sampler does).
LANE_SEED_STRIDE = 1_000_003


def local_engine_count(config) -> int:
    """`sampler.local_engines`, with 0 (auto) resolved on this host: 2 where JAX runs on the CPU
    with at least 2 usable cores and the slots and cache entries split evenly, else 1 (one
    accelerator gains nothing from a second engine, which holds a weight copy of its own)."""
    n = int(config.sampler.get("local_engines", 1))
    if n:
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    even = config.sampler.max_concurrent_decodes % 2 == 0 and config.sampler.prefix_cache_entries % 2 == 0
    return 2 if jax.default_backend() == "cpu" and cores >= 2 and even else 1


def build_engines(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, *,
                  version: int = 0) -> list:
    """`sampler.local_engines` engines for the in-process sampler, the slots
    (`sampler.max_concurrent_decodes`) and prefix-cache entries split evenly between them, each
    with its own random stream; the decode options are chosen once (on the first) for all."""
    n = local_engine_count(config)
    engines, shapes = [], engine_shape_reuse(config)  # the engines share their programs and shapes
    for i in range(n):
        engines.append(build_engine(config, model_config, params, tok, version=version,
                                    slots=config.sampler.max_concurrent_decodes // n,
                                    cache_entries=config.sampler.prefix_cache_entries // n,
                                    seed=config.seed + i * LANE_SEED_STRIDE,
                                    decode_choice=engines[0].decode_choice if engines else None,
                                    shape_reuse=shapes))
    return engines


def build_local_sampler(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, *,
                        version: int = 0):
    """The in-process sampler: a `LocalSampler` over `build_engines`' engines (one decode thread each)."""
    from jaxrl_agent.sampling import LocalSampler

    return LocalSampler(build_engines(config, model_config, params, tok, version=version))


def decode_options_record(sampler) -> dict[str, str]:
    """The in-process sampler's engine count and decode options for the run's start record ({} for
    sampler servers, which print their own)."""
    choice = getattr(getattr(sampler, "engine", None), "decode_choice", None)
    if choice is None:
        return {}
    engines = getattr(sampler, "engines", (sampler.engine,))
    return {"sampler_engines": str(len(engines)), "decode_options": choice.describe()}


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


def server_devices(config, n: int) -> list[str]:
    """`sampler.server_devices` ('0,1;2,3': server i's GPUs, ';' between servers) as one
    CUDA_VISIBLE_DEVICES value per server ('' each when unset: every server sees every device)."""
    value = config.sampler.server_devices
    if not value:
        return [""] * n
    parts = [p.strip() for p in value.split(";")]
    if len(parts) != n or any(not p or not all(d.strip().isdigit() for d in p.split(",")) for p in parts):
        raise ConfigError(f"sampler.server_devices={value!r}: expected {n} groups of device indices separated by "
                          f"';' (one per sampler.num_servers={n}), e.g. '0,1;2,3'")
    return [",".join(d.strip() for d in p.split(",")) for p in parts]


def write_config_file(config, path: str) -> str:
    """A config file (`--config path`) that rebuilds `config` exactly, overrides included: what the
    run's sampler servers load, here or on other hosts (`sampler.addresses`). Returns the path."""
    import json

    with open(path, "w") as f:
        f.write('"""Written by the trainer: the run\'s config for its sampler servers."""\n'
                "import json\n\nimport ml_collections\n\n\ndef get_config():\n"
                f"    return ml_collections.ConfigDict(json.loads({json.dumps(config.to_json())}))\n")
    return path


class SamplerServers:
    """`n` JetStream sampler server processes (`jaxrl-agent sampler-server`) on this host, serving the
    run's exact config, a client over all of them, and a supervisor.

    The config (with its command-line overrides) is written to `<workdir>/sampler_config.py`, a
    config file that rebuilds it from JSON, and each server loads it. Servers start from the same
    random init as the trainer; the trainer pushes its weights before the first sample. A server
    that dies is restarted on its port and re-sent the latest weights (`restarts` counts them);
    meanwhile the client sends its requests to the others, or waits for it when it is the only one.
    """

    def __init__(self, config, n: int, workdir: str, startup_timeout_s: float = 300.0, *, supervise: bool = True,
                 startup_attempts: int = 3):
        import json
        import sys
        import threading

        from jaxrl_agent import auth
        from jaxrl_agent.sampling.client import BackgroundSamplerClient

        os.makedirs(workdir, exist_ok=True)
        self.config_path = write_config_file(config, os.path.join(os.path.abspath(workdir), "sampler_config.py"))
        # The servers' shared token: the user's, or a fresh one, handed over in their environment.
        token = auth.load_token(required=False) or auth.new_token()
        env = {**os.environ, auth.TOKEN_ENV: token, "JAXRL_AGENT_PARENT_PID": str(os.getpid())}
        env.pop(auth.TOKEN_FILE_ENV, None)
        if jax.default_backend() == "cpu":
            # One CPU device per server (not a simulated mesh a test may have asked this process
            # for); other XLA flags are kept, since they are part of the persistent cache's key.
            flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
            env.pop("XLA_FLAGS", None)
            if flags:
                env["XLA_FLAGS"] = " ".join(flags)
            env["JAX_PLATFORMS"] = "cpu"
        self._env, self._python = env, sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self.devices = server_devices(config, n)  # each server's own accelerators ('' = all visible)
        self.processes = [self._spawn(0, i) for i in range(n)]
        self.addresses = []
        try:
            for index in range(n):
                # A server that dies while starting (killed, out of memory) is started again, up to
                # `startup_attempts` times, before the run gives up.
                for attempt in range(1, startup_attempts + 1):
                    try:
                        self.addresses.append(self._wait_ready(self.processes[index]))
                        break
                    except RuntimeError as err:
                        if attempt == startup_attempts:
                            raise
                        print(f"warning: {err}; starting it again ({attempt}/{startup_attempts - 1})", flush=True)
                        self.processes[index].kill()
                        self.processes[index] = self._spawn(0, index)
        except RuntimeError:
            self.close()
            raise
        with open(os.path.join(os.path.abspath(workdir), "sampler_servers.json"), "w") as f:
            json.dump({"addresses": self.addresses, "pids": [p.pid for p in self.processes]}, f)  # for operators
        self.client = BackgroundSamplerClient(self.addresses, token=token, supervised=supervise,
                                              weight_chunk_bytes=int(config.sampler.weight_chunk_mb * 2**20))
        self._closing = threading.Event()
        self._monitor = None
        if supervise:
            self._monitor = threading.Thread(target=self._supervise, name="sampler-supervisor", daemon=True)
            self._monitor.start()

    def _spawn(self, port: int, index: int):
        import subprocess

        env = self._env
        if self.devices[index]:  # pinned: the server sees only its own GPUs
            env = {**env, "CUDA_VISIBLE_DEVICES": self.devices[index]}
        # --await_weights: a (re)started server samples nothing before the trainer's weights arrive.
        return subprocess.Popen([self._python, "-m", "jaxrl_agent.cli", "sampler-server", "--config", self.config_path,
                                 "--port", str(port), "--await_weights"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def _wait_ready(self, process) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        for line in process.stdout:
            if line.startswith("sampler server listening on "):
                return line.split()[-1]
            if time.monotonic() > deadline:
                break
        try:
            code = process.wait(timeout=5)
        except Exception:  # noqa: BLE001 - still running: it did not start in time
            code = None
        raise RuntimeError(f"sampler server {' '.join(process.args[2:5])} exited with {code} (or did not start within "
                           f"{self.startup_timeout_s} s)")

    def _supervise(self) -> None:
        while not self._closing.wait(1.0):
            for index, process in enumerate(self.processes):
                if process.poll() is None or self._closing.is_set():
                    continue
                port = int(self.addresses[index].rsplit(":", 1)[1])
                try:
                    replacement = self._spawn(port, index)
                    self.processes[index] = replacement
                    self._wait_ready(replacement)
                    self.client.resync(index)
                    self.restarts += 1
                except Exception as err:  # noqa: BLE001 - try again on the next round
                    print(f"warning: sampler server {self.addresses[index]} could not be restarted: {err}", flush=True)

    def close(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
        if getattr(self, "_monitor", None) is not None:
            self._monitor.join(timeout=30)
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


# ------------------------------------------------------------------------------ config -> parts
OBJECTIVES = ("mirror_descent", "ppo", "gspo", "cispo", "reinforce")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "ploo")
CORRECTIONS = ("none", "tis", "icepop", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3")
ENV_SERVICES = ("auto", "inprocess", "pool")  # or 'host:port[,host:port...]'


class ConfigError(ValueError):
    """A config value the run cannot use; the message names the key, the value and what was expected."""


def import_object(spec: str, key: str):
    """`package.module:name` -> the object (`key` names the config field in errors)."""
    import importlib

    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{key}={spec!r}: expected 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is a config error naming the key
        raise ConfigError(f"{key}={spec!r}: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no {name!r}") from None


def distill_envs(config) -> frozenset[str]:
    """`rl.distill_envs` as a set of environment names (empty: distillation covers every episode)."""
    return frozenset(split_list(config.rl.get("distill_envs", "")))


def split_list(value) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c'] (a list or tuple is taken as it is)."""
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [part.strip() for part in str(value or "").split(",") if part.strip()]


def import_env_modules(config) -> list[str]:
    """Imports `env.imports` (where user environments register themselves); returns the names."""
    import importlib

    modules = split_list(config.env.imports)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(f"env.imports: cannot import {module!r}: {type(err).__name__}: {err}") from None
    return modules


def env_kwargs(config) -> dict:
    """`env.kwargs` (a JSON object) as a dict."""
    import json

    text = config.env.kwargs or ""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"env.kwargs={text!r}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"env.kwargs={text!r}: expected a JSON object of keyword arguments")
    return value


def env_mixture(config) -> dict[str, float]:
    """{environment: sampling weight}, normalised: `env.mixture`, or {env.name: 1}."""
    text = config.env.mixture or ""
    if not text.strip():
        return {config.env.name: 1.0}
    weights: dict[str, float] = {}
    for part in split_list(text):
        name, sep, weight = part.partition(":")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"env.mixture={text!r}: weight {weight!r} of {name!r} is not a number") from None
        if value <= 0 or name.strip() in weights:
            raise ConfigError(f"env.mixture={text!r}: expected distinct 'name:weight' entries with weights > 0")
        weights[name.strip()] = value
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def reward_weights(config) -> dict[str, float]:
    """`reward.weights` ('name:weight,...') as a dict ({} = the environment's own reward)."""
    weights: dict[str, float] = {}
    for part in split_list(config.reward.weights):
        name, sep, weight = part.partition(":")
        try:
            weights[name.strip()] = float(weight)
        except ValueError:
            raise ConfigError(f"reward.weights={config.reward.weights!r}: expected 'name:weight,...' with "
                              f"numeric weights (got {part!r})") from None
        if not sep or not name.strip():
            raise ConfigError(f"reward.weights={config.reward.weights!r}: expected 'name:weight,...' (got {part!r})")
    return weights


def build_reward_shaping(config, reward_fn=None):
    """`reward.*` as a `rollout.RewardShaping` (reward_fn, when given, wins over `reward.fn`)."""
    from jaxrl_agent import rollout

    c = config.reward
    if reward_fn is None and c.fn:
        reward_fn = import_object(c.fn, "reward.fn")
    return rollout.RewardShaping(weights=reward_weights(config), overlong_factor=c.overlong_factor,
                                 overlong_buffer=c.overlong_buffer, max_context=config.rollout.max_context,
                                 toggle_period=c.toggle_period, reward_fn=reward_fn)


def invariant_settings(config):
    """`invariants.Settings` of `invariants.*`: the alarms (a threshold of 0 turns one off), the
    responses' knobs as the config sets them and their bounds, and the exploration guards' floors."""
    from jaxrl_agent.invariants import AlarmSpec, Controls, ResponseBounds, Settings

    c = config.invariants
    timing = dict(fire_after=c.fire_after, release_after=c.release_after)
    specs = []
    if c.entropy_floor > 0:
        specs.append(AlarmSpec("entropy", "exploration", "invariants/exploration/entropy_min", "low",
                               threshold=c.entropy_floor, release=c.entropy_release, **timing))
    if c.signal_floor > 0:
        specs.append(AlarmSpec("signal", "signal", "invariants/signal/nonzero_share", "low",
                               threshold=c.signal_floor, release=c.signal_release, **timing))
    if c.serve_gap_ceiling > 0:
        specs.append(AlarmSpec("serve_gap", "drift", "invariants/drift/serve_gap_p99", "high",
                               threshold=c.serve_gap_ceiling, release=c.serve_gap_release, **timing))
    if c.lag_ceiling > 0:
        specs.append(AlarmSpec("lag", "drift", "invariants/drift/lag_max", "high", threshold=float(c.lag_ceiling),
                               release=float(c.lag_release), **timing))
    base = Controls(entropy_coef=0.0, dynamic_sampling=bool(config.allocation.dynamic_sampling), dropped_levels=0,
                    max_staleness=int(config.rollout.max_staleness), icepop=False)
    bounds = ResponseBounds(entropy_coef_step=c.entropy_coef_step, entropy_coef_max=c.entropy_coef_max,
                            max_dropped_levels=c.max_dropped_levels, staleness_min=c.staleness_min)
    return Settings(specs=tuple(specs), base=base, bounds=bounds, respond=bool(c.respond),
                    entropy_floor=c.entropy_floor, distinct_solutions_floor=c.distinct_solutions_floor)


def host_ports(value, key: str) -> list[tuple[str, int]]:
    """'host:port,host:port' -> [(host, port)]; a ConfigError naming `key` for anything else."""
    addresses = []
    for part in split_list(value):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{key}={value!r}: {part!r} is not 'host:port' (expected 'host:port[,host:port...]')")
        addresses.append((host, int(port)))
    if not addresses:
        raise ConfigError(f"{key}={value!r}: expected 'host:port[,host:port...]'")
    return addresses


def env_service(config) -> str:
    """Where the run's environments run: `env.service`, with 'auto' resolved to 'inprocess' when
    every environment of the run is one the library declares safe in process
    (`envs.api.in_process_safe`: its pure built-in environments, unless a module registered the name
    again), else 'pool' (worker processes: step timeouts and crash isolation for any other one)."""
    service = config.env.service
    if service != "auto":
        return service
    from jaxrl_agent import envs

    return "inprocess" if all(envs.api.in_process_safe(name) for name in env_mixture(config)) else "pool"


def env_service_addresses(config) -> list[tuple[str, int]]:
    """The remote env servers of `env.service='host:port,...'` ([] for 'auto', 'inprocess' and 'pool')."""
    service = config.env.service
    if service in ENV_SERVICES:
        return []
    try:
        return host_ports(service, "env.service")
    except ConfigError:
        raise ConfigError(f"env.service={service!r}: expected one of {ENV_SERVICES} or "
                          "'host:port[,host:port...]'") from None


def sampler_addresses(config) -> list[str]:
    """The sampler servers run elsewhere (`sampler.addresses`), as 'host:port'; [] when unset."""
    if not config.sampler.addresses:
        return []
    return [f"{host}:{port}" for host, port in host_ports(config.sampler.addresses, "sampler.addresses")]


def build_remote_sampler(config, params):
    """A client over the sampler servers of `sampler.addresses`, holding `params` as version 0
    (the first push must reach at least one server, or the run stops here, naming them), then
    watching for servers that return and need the current weights."""
    from jaxrl_agent import auth
    from jaxrl_agent.sampling.client import BackgroundSamplerClient, SamplerUnavailableError

    addresses = sampler_addresses(config)
    client = BackgroundSamplerClient(addresses, token=auth.load_token(),
                                     tls_ca_file=os.path.expanduser(config.sampler.tls_ca_file) or None,
                                     weight_chunk_bytes=int(config.sampler.weight_chunk_mb * 2**20))
    try:
        client.update_weights(params, 0)
    except SamplerUnavailableError as err:
        client.close()
        raise ConfigError(f"sampler.addresses={config.sampler.addresses!r}: no server took the initial weights "
                          f"({err}); start them with `jaxrl-agent sampler-server --config <this config> --port P "
                          "--await_weights` and the run's token") from None
    client.supervised = True  # from here on a server may be down for a while: its pushes wait for its return
    client.watch(config.sampler.rejoin_check_s)
    return client


def build_sampler(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, workdir: str):
    """The run's sampler, holding `params` as version 0, and its server processes (None unless this
    run starts them): `sampler.num_servers` > 0 starts that many JetStream server processes (the
    learner pushes weights to them over gRPC); `sampler.addresses` uses servers run elsewhere;
    otherwise the in-process engine (`LocalSampler`)."""
    if config.sampler.num_servers > 0:
        servers = SamplerServers(config, config.sampler.num_servers, workdir)
        servers.client.update_weights(params, 0)
        return servers.client, servers
    if config.sampler.addresses:
        return build_remote_sampler(config, params), None
    return build_local_sampler(config, model_config, params, tok), None


def validate_config(config, *, reward_fn_given: bool = False) -> None:
    """Checks every choice of the config before anything is built; raises ConfigError naming the
    key, the value and what was expected. Imports `env.imports` (user environments register there)
    and resolves `rl.objective_fn`, but builds no model. `reward_fn_given`: a reward function comes
    from Python (it may add component names that reward.weights uses)."""
    from jaxrl_agent import envs

    def need(ok: bool, message: str):
        if not ok:
            raise ConfigError(message)

    def one_of(key: str, value, options):
        need(value in options, f"{key}={value!r}: expected one of {options}")

    from jaxrl_agent import heap

    one_of("host_allocator", config.get("host_allocator", "system"), heap.HOST_ALLOCATORS)
    r, rl, learner_c = config.rollout, config.rl, config.learner
    need(r.max_context <= learner_c.row_length,
         f"rollout.max_context={r.max_context} exceeds learner.row_length={learner_c.row_length}: "
         "episodes that long could never be trained on")
    # A turn's prompt is a whole learner sequence so far (up to max_context - 1 tokens, and the
    # whole sequence again after a context edit): a sampler that refused it would end the episode.
    need(config.sampler.max_prefill_length >= r.max_context - 1,
         f"sampler.max_prefill_length={config.sampler.max_prefill_length} is below rollout.max_context="
         f"{r.max_context} - 1: a turn's prompt can be that long (use a power of two >= {r.max_context - 1})")
    need(config.sampler.max_cache_length >= r.max_context,
         f"sampler.max_cache_length={config.sampler.max_cache_length} is below rollout.max_context={r.max_context}: "
         "a sampler slot holds a turn's prompt and its reply")
    need(learner_c.summary_weight >= 0, f"learner.summary_weight={learner_c.summary_weight}: expected >= 0 "
                                         "(the summary tokens' weight against action tokens; 1 = the same)")
    need(learner_c.logits_chunk >= 0, f"learner.logits_chunk={learner_c.logits_chunk}: expected >= 0 (0 = whole rows)")
    need(learner_c.target_multiple >= 0, f"learner.target_multiple={learner_c.target_multiple}: expected >= 0 "
         "(0 = logits at every position)")
    for name in ("eval.every", "checkpoint.every", "sft.eval_every", "sft.log_every"):
        section, field = name.split(".")
        need(config[section][field] >= 0, f"{name}={config[section][field]}: expected >= 0 (0 = only at the end)")
    try:
        run_schedule.initial_eval_setting(config.eval.get("initial", "auto"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    lanes = config.sampler.get("local_engines", 1)
    need(isinstance(lanes, int) and (lanes == 0 or (lanes >= 1 and config.sampler.max_concurrent_decodes % lanes == 0
                                                     and config.sampler.prefix_cache_entries % lanes == 0)),
         f"sampler.local_engines={lanes!r}: expected 0 (auto) or an integer >= 1 that divides "
         f"sampler.max_concurrent_decodes={config.sampler.max_concurrent_decodes} and "
         f"sampler.prefix_cache_entries={config.sampler.prefix_cache_entries} (each engine takes an equal share of "
         "both)")
    fewest, most = config.sampler.steps_per_call, config.sampler.get("max_steps_per_call", 0)
    need(fewest >= 1, f"sampler.steps_per_call={fewest}: expected >= 1 (decode steps a generate call runs)")
    need(most == 0 or most >= fewest, f"sampler.max_steps_per_call={most}: expected 0 (= steps_per_call) or "
         f">= sampler.steps_per_call={fewest} (the most steps a call runs while none of its requests finishes)")
    need(config.sampler.pipeline_depth >= 1, f"sampler.pipeline_depth={config.sampler.pipeline_depth}: expected "
         ">= 1 (generate calls a sampler server dispatches ahead of its detokenize thread)")
    need(config.invariants.drift_every >= 0,
         f"invariants.drift_every={config.invariants.drift_every}: expected >= 0 (0 = never)")
    try:
        invariant_settings(config)
    except ValueError as err:
        raise ConfigError(f"invariants: {err}") from None
    need(rl.time_budget_minutes >= 0, f"rl.time_budget_minutes={rl.time_budget_minutes}: expected >= 0 (0 = no limit)")
    need(r.group_size >= 1 and r.prompts_per_iteration >= 1,
         f"rollout.group_size={r.group_size}, rollout.prompts_per_iteration={r.prompts_per_iteration}: expected >= 1")
    a = config.allocation
    if a.task_pool <= 0:
        need(a.strategy == "uniform", f"allocation.strategy={a.strategy!r} needs a revisited task pool: set "
             f"allocation.task_pool > 0 (got {a.task_pool})")
    need(not (a.strategy == "until_mixed" and (r.schedule != "sync" or r.token_budget > 0)),
         "allocation.strategy='until_mixed' samples in rounds within an iteration: it needs rollout.schedule='sync' "
         f"and rollout.token_budget=0 (got {r.schedule!r}, {r.token_budget})")
    # The objective.
    one_of("rl.advantage", rl.advantage, ADVANTAGES)
    need(math.isfinite(rl.negative_advantage_weight) and rl.negative_advantage_weight >= 0,
         f"rl.negative_advantage_weight={rl.negative_advantage_weight}: expected a finite weight >= 0 "
         "(1 = the estimator's advantages; 0 = only the positive ones)")
    from jaxrl_agent import tool_formats

    tk = config.tokenizer
    one_of("tokenizer.template", tk.template, (*sorted(tokenizer_lib.TEMPLATES), "model"))
    one_of("tokenizer.tool_format", tk.tool_format, tuple(sorted(tool_formats.FORMATS)))
    need(tk.template != "model" or tk.kind == "hf",
         f"tokenizer.template='model' reads the tokenizer folder's chat_template: it needs tokenizer.kind='hf', "
         f"not {tk.kind!r}")
    one_of("learner.master_dtype", config.learner.master_dtype, ("", "float32"))
    remote_samplers = sampler_addresses(config)
    need(not (remote_samplers and config.sampler.num_servers > 0),
         f"sampler.addresses={config.sampler.addresses!r} and sampler.num_servers={config.sampler.num_servers}: "
         "expected one of them (servers run elsewhere, or started here)")
    if config.sampler.server_devices:
        server_devices(config, config.sampler.num_servers)
    need(config.sampler.rejoin_check_s > 0, f"sampler.rejoin_check_s={config.sampler.rejoin_check_s}: expected > 0")
    if config.sampler.tls_ca_file:
        need(bool(remote_samplers), f"sampler.tls_ca_file={config.sampler.tls_ca_file!r} is for sampler.addresses")
        need(os.path.isfile(os.path.expanduser(config.sampler.tls_ca_file)),
             f"sampler.tls_ca_file={config.sampler.tls_ca_file!r}: no such file (expected the PEM CA certificate "
             "that signed the sampler servers' certificates)")
    from jaxrl_agent.sampling import host_tuning

    try:
        host_tuning.parse_setting(config.sampler.decode_options)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    need(config.sampler.weight_chunk_mb > 0,
         f"sampler.weight_chunk_mb={config.sampler.weight_chunk_mb}: expected > 0 (MiB of a parameter per message)")
    need(config.rollout.top_k >= 0, f"rollout.top_k={config.rollout.top_k}: expected >= 0 (0 = off)")
    need(0.0 < config.rollout.top_p <= 1.0, f"rollout.top_p={config.rollout.top_p}: expected in (0, 1] (1 = off)")
    from jaxrl_agent.rollout import episode as episode_lib

    one_of("rollout.history", config.rollout.history, episode_lib.HISTORY_MODES)
    try:
        context_settings(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    need(config.rollout.max_think_tokens >= 0,
         f"rollout.max_think_tokens={config.rollout.max_think_tokens}: expected >= 0 (0 = no budget)")
    need(tk.template == "model" or tk.kind == "char",
         f"tokenizer.template={tk.template!r} is a built-in template for the character tokenizer; a Hugging Face "
         "tokenizer renders turns with its model's own chat template: set tokenizer.template='model' (its "
         "tokenizer_config.json needs a chat_template)")
    need(tk.tool_format == "env" or tk.template == "model",
         f"tokenizer.tool_format={tk.tool_format!r} is a model's own format: it needs tokenizer.template='model' "
         f"(the built-in {tk.template!r} template renders no tool schemas)")
    if rl.advantage == "rloo" or rl.advantage == "ploo":
        need(r.group_size >= 2, f"rl.advantage={rl.advantage!r} needs rollout.group_size >= 2 (got {r.group_size})")
    if rl.objective_fn:
        import_object(rl.objective_fn, "rl.objective_fn")
    else:
        one_of("rl.objective", rl.objective, OBJECTIVES)
    one_of("rl.level", rl.level, ("token", "sequence"))
    one_of("rl.correction", rl.correction, CORRECTIONS)
    one_of("rl.kl_estimator", rl.kl_estimator, KL_ESTIMATORS)
    need(rl.kl_coef >= 0 and rl.entropy_coef >= 0,
         f"rl.kl_coef={rl.kl_coef}, rl.entropy_coef={rl.entropy_coef}: expected >= 0")
    need(rl.tau > 0, f"rl.tau={rl.tau}: expected > 0")
    need(rl.dual_clip == 0 or rl.dual_clip > 1, f"rl.dual_clip={rl.dual_clip}: expected 0 (off) or > 1")
    need(rl.distill_coef >= 0, f"rl.distill_coef={rl.distill_coef}: expected >= 0 (0 = no distillation)")
    need(rl.teacher == "initial" or os.path.isdir(rl.teacher),
         f"rl.teacher={rl.teacher!r}: expected 'initial' or a Hugging Face model folder")
    if rl.reference not in ("initial", "sft"):
        need(os.path.isdir(rl.reference), f"rl.reference={rl.reference!r}: expected 'initial', 'sft' or a "
             "Hugging Face model folder")
    # Environments.
    import_env_modules(config)
    env_kwargs(config)
    mixture = env_mixture(config)
    for name in mixture:
        need(name in envs.registered(), f"env.{'mixture' if config.env.mixture else 'name'}: environment "
             f"{name!r} is not registered (registered: {envs.registered()}; add its module to env.imports)")
    distilled = distill_envs(config)
    if distilled:
        need(distilled <= set(mixture), f"rl.distill_envs={config.rl.distill_envs!r}: expected environments of "
             f"the mixture {sorted(mixture)} (not in it: {sorted(distilled - set(mixture))})")
        need(set(mixture) - distilled, f"rl.distill_envs={config.rl.distill_envs!r} covers every environment of "
             f"the mixture {sorted(mixture)}: expected at least one trained by its rewards")
    remote_envs = env_service_addresses(config)
    if config.env.tls_ca_file:
        need(bool(remote_envs), f"env.tls_ca_file={config.env.tls_ca_file!r} is for remote env servers: expected "
             f"env.service='host:port,...' (got {config.env.service!r})")
        need(os.path.isfile(os.path.expanduser(config.env.tls_ca_file)),
             f"env.tls_ca_file={config.env.tls_ca_file!r}: no such file (expected the PEM CA certificate that "
             "signed the env servers' certificates)")
    weights = reward_weights(config)
    # Components a weight may name: the library's, and each environment's (tool environments
    # declare theirs); a reward.fn may add any names, and other environments are not known here.
    known = {"correctness", "format", "overlong", "turns", "wall_time", "success", "judge", "judge_failed",
             "custom", "reward_fn_error"}
    if weights and not config.reward.fn and not reward_fn_given and all(issubclass(type(envs.make(n, **env_kwargs(config))),
                                                           envs.ToolEnvironment) for n in mixture):
        from jaxrl_agent.envs.api import DEFAULT_REWARD_WEIGHTS

        unknown = sorted(set(weights) - known - set(DEFAULT_REWARD_WEIGHTS))
        need(not unknown, f"reward.weights={config.reward.weights!r}: no component named {unknown}; known: "
             f"{sorted(known | set(DEFAULT_REWARD_WEIGHTS))} (or add them with reward.fn)")
    if config.reward.fn:
        need(callable(import_object(config.reward.fn, "reward.fn")), f"reward.fn={config.reward.fn!r}: not a function")
    judge = config.reward.judge
    need(judge in ("", "policy") or os.path.isdir(judge),
         f"reward.judge={judge!r}: expected '' (none), 'policy' or a Hugging Face model folder")
    need(config.reward.judge_max_tokens >= 1, f"reward.judge_max_tokens={config.reward.judge_max_tokens}: expected >= 1")
    delegate = config.rollout.delegate
    need(delegate in ("", "initial") or os.path.isdir(os.path.expanduser(delegate)),
         f"rollout.delegate={delegate!r}: expected '' (no sub-agents), 'initial' or a Hugging Face model folder")
    for key in ("delegate_max_depth", "delegate_max_subagents", "delegate_token_budget"):
        need(config.rollout[key] >= 1, f"rollout.{key}={config.rollout[key]}: expected >= 1")
    sub_temperature = config.rollout.get("delegate_temperature", -1.0)
    need(sub_temperature == -1.0 or sub_temperature >= 0.0,
         f"rollout.delegate_temperature={sub_temperature}: expected -1 (the orchestrator's) or >= 0 (0 = greedy)")
    need(config.env.tool_latency_s <= 0 or env_service(config) == "inprocess",
         f"env.tool_latency_s={config.env.tool_latency_s} simulates latency on in-process environments only: "
         f"set env.service='inprocess' (got {config.env.service!r})")
    need(config.env.step_timeout_s > 0, f"env.step_timeout_s={config.env.step_timeout_s}: expected > 0")
    need(config.env.pool_workers >= 1, f"env.pool_workers={config.env.pool_workers}: expected >= 1")
    for key in ("shape_reuse_calls", "decode_shape_reuse_calls"):
        need(config.sampler[key] >= 0, f"sampler.{key}={config.sampler[key]}: expected >= 0 (0 = compile every shape)")
    need(config.learner.shape_reuse_calls >= 0,
         f"learner.shape_reuse_calls={config.learner.shape_reuse_calls}: expected >= 0 (0 = compile every shape)")
    need(config.learner.max_consecutive_skips >= 0,
         f"learner.max_consecutive_skips={config.learner.max_consecutive_skips}: expected >= 0 (0 = never stop)")
    one_of("metrics.progress", config.metrics.progress, ("auto", "on", "off"))
    from jaxrl_agent.envs import sandbox

    one_of("sandbox.isolation", config.sandbox.isolation, sandbox.ISOLATIONS)
    sandboxed = [name for name in mixture if envs.api.uses_sandbox(name)]
    if sandboxed and env_service(config) in ("inprocess", "pool"):
        try:
            sandbox.check_isolation(config.sandbox.isolation)
        except sandbox.SandboxUnavailableError as err:
            raise ConfigError(f"environments {sandboxed} run policy code in the sandbox "
                              f"(sandbox.isolation={config.sandbox.isolation!r}): {err}") from None
    if config.metrics.wandb_project:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None,
             f"metrics.wandb_project={config.metrics.wandb_project!r} needs wandb: pip install \"jaxrl_agent[wandb]\" "
             "(or set metrics.wandb_project='')")
    from jaxrl_agent import data

    try:
        kind = data.task_source_kind(config.data.tasks)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    need(kind in ("procedural", "tfds") or os.path.isfile(config.data.tasks),
         f"data.tasks={config.data.tasks!r}: no such file")
    demonstrations = config.data.demonstrations
    need(not demonstrations or os.path.isfile(demonstrations), f"data.demonstrations={demonstrations!r}: no such file")
    is_count = lambda value, least: isinstance(value, int) and not isinstance(value, bool) and value >= least
    need(is_count(config.learner.microbatches, 1),
         f"learner.microbatches={config.learner.microbatches!r}: expected an integer >= 1")
    need(is_count(config.sft.microbatches, 0),
         f"sft.microbatches={config.sft.microbatches!r}: expected an integer >= 0 (0 = learner.microbatches)")
    rows = config.sft.rows_per_update
    sft_multiple = math.lcm(config.learner.row_multiple, sft_microbatches(config))
    need(rows == -1 or (rows >= 0 and rows % sft_multiple == 0),
         f"sft.rows_per_update={rows}: expected -1 (the rows sft.batch_size demonstrations "
         f"pack into), 0 (exactly sft.batch_size demonstrations per update) or a multiple of "
         f"{sft_multiple} (learner.row_multiple={config.learner.row_multiple} and the SFT microbatches, "
         f"{sft_microbatches(config)})")
    need(0.0 <= config.sft.delegate_share <= 1.0,
         f"sft.delegate_share={config.sft.delegate_share}: expected a share in [0, 1] (of demonstrations from "
         "an environment's delegating expert when rollout.delegate is set; the rest inline)")
    if config.sft.steps > 0 and not demonstrations:
        for name in mixture:
            try:
                envs.expert_policy(name)
            except ValueError:
                raise ConfigError(f"sft.steps={config.sft.steps}: environment {name!r} has no scripted expert; "
                                  "give data.demonstrations (a JSONL of chat records) or set sft.steps=0") from None


def build_judge(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer, template):
    """The `reward.judge` RubricJudge on a sampler of its own (never updated: a frozen judge), or None.

    'policy' judges with `params` (a frozen copy of the weights RL starts from); a folder with that
    checkpoint (`params` unused). The
    judge's engine holds prompts of up to a power of two below the model's context less the reply;
    its decode options are chosen for this host as the policy engine's are (`sampler.decode_options`,
    for its own decode shape).
    """
    from jaxrl_agent import rewards
    from jaxrl_agent.sampling import LocalSampler, host_tuning
    from jaxrl_agent.sampling.engine import AgentEngine

    c = config.reward
    if not c.judge:
        return None
    if c.judge != "policy":
        model_config, params = _load_frozen_hf(config, c.judge, tok, "reward.judge")
    cache = min(model_config.max_position_embeddings, 4096)
    prefill = 1 << (cache - c.judge_max_tokens).bit_length() - 1
    engine = AgentEngine(model_config, params, tok, max_concurrent_decodes=config.sampler.max_concurrent_decodes,
                         max_prefill_length=prefill, max_cache_length=prefill + c.judge_max_tokens,
                         steps_per_call=config.sampler.steps_per_call,
                         max_steps_per_call=config.sampler.max_steps_per_call, prefix_cache_entries=0,
                         seed=config.seed + 7)
    host_tuning.tune_engine(engine, config.sampler.decode_options,
                            cache_path=host_tuning.host_choices_path(config.get("compilation_cache_dir", "")))
    rubric = tuple(item.strip() for item in c.judge_rubric.split(";") if item.strip()) or rewards.judge.DEFAULT_RUBRIC
    return rewards.RubricJudge(LocalSampler(engine), tok, template, rubric=rubric, max_tokens=c.judge_max_tokens)


def _load_frozen_hf(config, folder: str, tok: tokenizer_lib.Tokenizer, key: str):
    """(model config, params on this host's default device) of a frozen policy's Hugging Face
    folder, whose vocabulary must cover the run's tokenizer."""
    model_config, host = models.load_hf(folder, dtype=config.checkpoint.param_dtype,
                                        compute_dtype=config.checkpoint.compute_dtype)
    if tok.vocab_size > model_config.vocab_size:
        raise ConfigError(f"{key}={folder!r}: its vocabulary ({model_config.vocab_size}) is smaller than "
                          f"the tokenizer's ({tok.vocab_size})")
    return model_config, sharding.place_params(host, None)


def delegation_limits(config):
    """`rollout.DelegationLimits` of `rollout.delegate_*` (raises ValueError below 1)."""
    from jaxrl_agent.rollout import delegation

    c = config.rollout
    return delegation.DelegationLimits(max_depth=c.delegate_max_depth, max_subagents=c.delegate_max_subagents,
                                       token_budget=c.delegate_token_budget)


def build_subagent_sampler(config, model_config: models.ModelConfig, params, tok: tokenizer_lib.Tokenizer):
    """The frozen sub-agents' in-process sampler of `rollout.delegate` (the learner never updates
    it): 'initial' samples from `params` (a copy of the weights RL starts from, which the caller
    keeps and checkpoints), a folder from that Hugging Face checkpoint; None without delegation."""
    source = config.rollout.delegate
    if not source:
        return None
    if source != "initial":
        model_config, params = _load_frozen_hf(config, os.path.expanduser(source), tok, "rollout.delegate")
    return build_local_sampler(config, model_config, params, tok)


def subagent_temperature(config, temperature: float) -> float:
    """The sub-agents' sampling temperature beside an orchestrator sampling at `temperature`:
    `rollout.delegate_temperature` (-1: the orchestrator's), never above the orchestrator's (so
    a greedy evaluation has greedy sub-agents)."""
    own = config.rollout.get("delegate_temperature", -1.0)
    return temperature if own < 0 else min(own, temperature)


def build_subagents(config, sampler, make_env, tok: tokenizer_lib.Tokenizer, template, temperature: float):
    """What `delegate` calls run on (`rollout.SubAgents`): `sampler` (`build_subagent_sampler`),
    sub-tasks from the orchestrator's environment's `subtask(parent, text)`, each in the episode
    environment `make_env(task)` gives (a run's: `Environments.make_env`, on its service), sampled
    at `subagent_temperature(config, temperature)` (`temperature`: the orchestrator's, greedy in
    evaluation) with the run's episode settings; limits from `rollout.delegate_*`."""
    from jaxrl_agent import envs
    from jaxrl_agent.rollout import delegation

    kwargs = env_kwargs(config)

    def make_task(text: str, parent):
        task = envs.make(parent.env, **kwargs).subtask(parent, text)
        return task, make_env(task)

    return delegation.SubAgents(sampler=sampler, make_task=make_task,
                                settings=episode_settings(config, subagent_temperature(config, temperature)),
                                tokenizer=tok, template=template, limits=delegation_limits(config))


def build_task_stream(config, environments: "Environments", levels: dict, *, seed: int):
    """The RL task stream of `data.tasks`: procedural (seeded generators over the mixture) or
    records from a dataset, sharded by `jax.process_index()`."""
    from jaxrl_agent import data, rollout

    if config.data.tasks == "procedural":
        return rollout.source.ProceduralTasks(environments.environments, environments.weights, levels, seed=seed,
                                              shard_index=jax.process_index(), shard_count=jax.process_count())
    return data.DatasetTasks(config.data.tasks, default_env=config.env.name, known_envs=list(environments.environments),
                             seed=seed, shuffle=config.data.shuffle, shard_index=jax.process_index(),
                             shard_count=jax.process_count(), tfds_data_dir=config.data.tfds_data_dir)


def build_advantage_fn(config):
    """`rl.advantage` as a function rewards [G, N] -> advantages [G, N], its negative values scaled by
    `rl.negative_advantage_weight` (`losses.weight_negative_advantages`)."""
    from jaxrl_agent import losses

    from jaxrl_agent.rollout.postprocess import dr_grpo_advantages

    name, tau, weight = config.rl.advantage, config.rl.tau, config.rl.negative_advantage_weight
    estimator = {"grpo": lambda r: losses.group_advantages(r, normalize_std=True),
                 "dr_grpo": dr_grpo_advantages,
                 "rloo": losses.rloo_advantages,
                 "ploo": lambda r: losses.ploo_advantages(r, tau=tau)}[name]
    if weight == 1:
        return estimator
    return lambda r: losses.weight_negative_advantages(estimator(r), weight)


def build_objective(config):
    """The RL objective the config names: `rl.objective_fn`, or `rl.objective` with its correction,
    entropy bonus and reference KL. Returns a `losses.Objective`."""
    from jaxrl_agent import losses

    rl = config.rl
    if rl.objective_fn:
        found = import_object(rl.objective_fn, "rl.objective_fn")
        return _as_objective(found, rl)
    if rl.objective == "mirror_descent":
        policy = losses.PolicyTerm("mirror_descent", tau=rl.tau, level=rl.level,
                                   **({"clip_eps_low": rl.clip_eps_low, "clip_eps_high": rl.clip_eps_high}
                                      if rl.level == "token" else {}),
                                   reduction="token_mean" if rl.level == "token" else "sequence_mean")
    elif rl.objective == "ppo":
        policy = losses.PolicyTerm("ppo_clip", eps_low=rl.clip_eps_low, eps_high=rl.clip_eps_high,
                                   dual_clip=rl.dual_clip or None)
    elif rl.objective == "gspo":
        policy = losses.PolicyTerm("gspo", eps_low=rl.gspo_eps_low, eps_high=rl.gspo_eps_high,
                                   reduction="sequence_mean")
    elif rl.objective == "cispo":
        policy = losses.PolicyTerm("cispo", eps_low=rl.clip_eps_low, eps_high=rl.clip_eps_high)
    else:
        policy = losses.PolicyTerm("reinforce")
    terms = [policy]
    if rl.kl_coef > 0:
        terms.append(losses.KLTerm(rl.kl_estimator, coef=rl.kl_coef))
    if rl.entropy_coef > 0:
        terms.append(losses.EntropyTerm(coef=rl.entropy_coef))
    if rl.distill_coef > 0:
        terms.append(losses.DistillTerm(coef=rl.distill_coef))
    corrections = {"none": (), "tis": (losses.TIS(cap=rl.tis_cap),),
                   "icepop": (losses.IcePop(low=rl.icepop_low, high=rl.icepop_high),),
                   "decoupled": (losses.Decoupled(cap=rl.tis_cap),)}[rl.correction]
    return losses.make_objective(losses.ObjectiveSpec(terms=tuple(terms), corrections=corrections),
                                 name=rl.objective)


def _as_objective(found, rl):
    """An Objective, a factory of one (called with the rl section as a dict), or a pure loss with
    the six-argument signature of docs/contracts.md."""
    import inspect

    from jaxrl_agent import losses

    if isinstance(found, losses.Objective):
        return found
    if not callable(found):
        raise ConfigError(f"rl.objective_fn={rl.objective_fn!r}: {type(found).__name__} is neither an "
                          "Objective nor a function")
    try:
        required = [p for p in inspect.signature(found).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    if len(required) == 6:
        return losses.objective_from_loss(found, rl.to_dict(), needs_reference=rl.kl_coef > 0,
                                          name=getattr(found, "__name__", "custom"))
    made = found(rl.to_dict()) if len(required) == 1 else found()
    if not isinstance(made, losses.Objective):
        raise ConfigError(f"rl.objective_fn={rl.objective_fn!r} returned {type(made).__name__}, expected a "
                          "losses.Objective (build one with losses.make_objective)")
    return made


class Environments:
    """The run's environments (`env.*`): one instance of each for generating tasks, and
    `make_env(task)` — the episode's environment on the configured service: in process (the
    library's pure environments stepped on the event loop, any other on threads with a watchdog), a
    pool of worker processes, or remote env servers."""

    def __init__(self, config):
        import concurrent.futures

        from jaxrl_agent import envs

        from jaxrl_agent.envs import sandbox

        # The code sandbox's isolation, for this process and the env workers it starts.
        os.environ[sandbox.ISOLATION_ENV] = config.sandbox.isolation
        self.imports = import_env_modules(config)
        self.kwargs = env_kwargs(config)
        self.weights = env_mixture(config)
        self.environments = {name: envs.make(name, **self.kwargs) for name in self.weights}
        self.step_timeout_s = float(config.env.step_timeout_s)
        self.tool_latency = (config.env.tool_latency_s, config.env.tool_latency_alpha)
        self.service_name = env_service(config)
        self.service = None
        self._threads = None
        if self.service_name == "inprocess":
            # Environment steps run on these threads (a slow tool must not stall the event loop).
            self._threads = concurrent.futures.ThreadPoolExecutor(config.env.step_threads, "env-step")
        elif self.service_name == "pool":
            from jaxrl_agent.envs.pool import EnvPool

            self.service = EnvPool(config.env.pool_workers, step_timeout_s=self.step_timeout_s,
                                   worker_memory_mb=config.env.worker_memory_mb or None, imports=self.imports)
        else:
            from jaxrl_agent.envs.remote import RemoteEnvServices

            self.service = RemoteEnvServices(env_service_addresses(config), timeout_s=max(120.0, self.step_timeout_s),
                                             tls_ca_file=os.path.expanduser(config.env.tls_ca_file) or None)

    def make_env(self, task):
        from jaxrl_agent import envs, rollout

        if self.service is not None:
            return rollout.ServiceEnv(self.service, task.env, self.kwargs)
        env = envs.make(task.env, **self.kwargs)
        if self.tool_latency[0] > 0:
            from jaxrl_agent.envs.testing import ToolLatency

            env = ToolLatency(env, self.tool_latency[0], alpha=self.tool_latency[1])
        elif envs.api.in_process_safe(task.env):
            return rollout.InProcessEnv(env)  # bounded pure Python: stepped on the event loop
        return rollout.InProcessEnv(env, executor=self._threads, step_timeout_s=self.step_timeout_s)

    def stats(self) -> dict[str, float]:
        """The service's failure counters (worker restarts, timeouts, crashes), when it has them."""
        if self.service is None:
            return {}
        try:
            stats = dict(self.service.stats)
        except Exception:  # noqa: BLE001 - metrics must not stop the run (a server may be down)
            return {}
        return {f"env_service/{k}": float(v) for k, v in stats.items()}

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self.service is not None:
            self.service.close()


def build_learner(config, model_config: models.ModelConfig, mesh: jax.sharding.Mesh, params, *, sft: bool = False,
                  objective=None, ref_params=None, teacher_params=None, token_logprobs: bool = False):
    """(train state, jitted train step) for SFT (`config.sft`) or RL (`config.rl`, with `objective`
    and the frozen `ref_params` / `teacher_params` when it needs them). `token_logprobs`: the step
    also returns the batch's log-probs under its starting parameters (`make_train_step`)."""
    from jaxrl_agent import learner

    c = config.sft if sft else config.rl
    total = c.steps if sft else c.iterations * c.minibatches
    optimizer = learner.make_optimizer(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps, total_steps=total,
                                       grad_clip_norm=config.learner.grad_clip_norm)
    def make_state(params, ref_params, teacher_params):
        return learner.init_state(params, optimizer, ref_params=ref_params, seed=config.seed,
                                  master_dtype=config.learner.master_dtype or None, teacher_params=teacher_params)

    step_fn, shardings = learner.jit_train_step(
        learner.make_train_step(model_config, optimizer, objective=objective, sft=sft,
                                microbatches=sft_microbatches(config) if sft else config.learner.microbatches,
                                temperature=1.0 if sft else config.rollout.temperature,
                                logits_chunk=config.learner.logits_chunk, mesh=mesh, token_logprobs=token_logprobs),
        jax.eval_shape(make_state, params, ref_params, teacher_params), mesh)
    # Made on the mesh, every leaf in its sharding (the optimizer's counters too): a checkpoint
    # before the first update holds global arrays, as several processes need.
    return jax.jit(make_state, out_shardings=shardings)(params, ref_params, teacher_params), step_fn


def sft_microbatches(config) -> int:
    """Gradient accumulation steps of an SFT update: `sft.microbatches`, 0 = `learner.microbatches`."""
    return int(config.sft.microbatches) or int(config.learner.microbatches)


def build_reference(config, mesh: jax.sharding.Mesh, params):
    """The frozen reference of `rl.reference`: a copy of the weights RL starts from (`params`), or
    a Hugging Face folder whose parameters must have the policy's shapes."""
    return _frozen_policy(config, mesh, params, "rl.reference", config.rl.reference)


def build_teacher(config, mesh: jax.sharding.Mesh, params):
    """The frozen distillation teacher of `rl.teacher`: a copy of the weights RL starts from
    (`params`; in a stage list, the previous stage's final policy), or a Hugging Face folder whose
    parameters must have the policy's shapes."""
    return _frozen_policy(config, mesh, params, "rl.teacher", config.rl.teacher)


def _frozen_policy(config, mesh, params, name: str, source: str):
    import jax.numpy as jnp

    if source in ("initial", "sft"):
        return jax.tree.map(jnp.copy, params)
    loaded_config, host = models.load_hf(source, dtype=config.checkpoint.param_dtype)
    placed = sharding.place_params(host, mesh)
    if jax.tree.structure(placed) != jax.tree.structure(params) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params))):
        raise ConfigError(f"{name}={source!r}: its parameters ({loaded_config.architecture}) do not match "
                          "the policy's shapes")
    return jax.tree.map(lambda p, t: p.astype(t.dtype), placed, params)


def build_demonstrations(config, environments: "Environments", levels: dict, tok, template, *, first_seed: int):
    """SFT data: `data.demonstrations` (a chat JSONL), else the environments' scripted experts on
    their own task seeds from `first_seed` (`sft.num_demonstrations` of them, or fresh ones)."""
    from jaxrl_agent import data, envs, rollout

    path = config.data.demonstrations
    if path:
        pool, skipped = data.read_demonstrations(path, tok, template, env=config.env.name)
        if not pool:
            raise ConfigError(f"data.demonstrations={path!r}: no usable records (skipped: {skipped})")
        return data.Demonstrations(pool, info={"demonstrations": path, "demonstration_records": len(pool),
                                               "skipped_records": skipped})
    tasks = rollout.source.ProceduralTasks(environments.environments, environments.weights, levels,
                                           seed=config.seed + 2)
    tasks.next_seed = first_seed
    # With sub-agents (`rollout.delegate`) the demonstrations advertise `delegate`, and an
    # environment's delegating expert (`expert.delegate`, where it has one) shows its use on a share
    # `sft.delegate_share` of its tasks (chosen by task id), its calls answered by the sub-tasks'
    # scripted experts; the rest show the inline expert, so RL can learn when delegating pays.
    delegate = rollout.delegation.scripted_subagent(lambda name: envs.make(name, **environments.kwargs)) \
        if config.rollout.delegate else None
    share = float(config.sft.delegate_share)

    def expert_for(task):
        expert = envs.expert_policy(task.env)
        if delegate is None or zlib.crc32(task.id.encode()) / 2**32 >= share:
            return expert
        return getattr(expert, "delegate", expert)

    def demonstrate(n):
        return [rollout.expert_trajectory(environments.environments[t.env], t, expert_for(t), tok,
                                          template, include_system_prompt=config.rollout.include_system_prompt,
                                          tool_format=config.tokenizer.tool_format, history=config.rollout.history,
                                          context=context_settings(config),
                                          max_context=config.rollout.max_context, delegate=delegate)
                for t in tasks.take(n)]

    return data.Demonstrations(demonstrate(config.sft.num_demonstrations), fresh=demonstrate)


def build_sft_batches(config, demonstrations, rng, row_multiple: int):
    """SFT's updates (`data.DemonstrationBatches`): this process's share of `sft.batch_size`
    demonstrations each, or `sft.rows_per_update` learner rows filled with them (-1: the rows that
    many pack into on average, measured on the first four updates' draws, the most of any process;
    those draws are trained on first)."""
    from jaxrl_agent import data, sharding

    per_update, rows = sharding.process_share(config.sft.batch_size), int(config.sft.rows_per_update)
    if rows == 0:
        return data.DemonstrationBatches(demonstrations, rng, draw=per_update, row_length=config.learner.row_length)
    first = []
    if rows < 0:
        first = [t for _ in range(4) for t in demonstrations.sample(rng, per_update)]
        rows = int(sharding.agree_max([data.rows_for(first, per_update, config.learner.row_length, row_multiple)])[0])
    elif rows % row_multiple:
        raise ConfigError(f"sft.rows_per_update={rows}: expected a multiple of {row_multiple} "
                          "(learner.row_multiple and the mesh's batch axes), 0 or -1")
    return data.DemonstrationBatches(demonstrations, rng, draw=per_update, row_length=config.learner.row_length,
                                     rows=rows, pending=first)


def build_allocator(config, environments: "Environments", levels: dict):
    """The RL task pool and its allocation rule (`config.allocation`); None = a fresh task per group.
    The pool is the first `task_pool` tasks of a stream of its own (seed + 1)."""
    from jaxrl_agent import rollout

    a, r = config.allocation, config.rollout
    if a.task_pool <= 0:
        return None
    pool = build_task_stream(config, environments, levels, seed=config.seed + 1).take(a.task_pool)
    return rollout.TaskAllocator(
        pool, a.strategy, r.group_size, candidates=a.candidates, max_group=a.max_group, decay=a.decay,
        min_group=max(2, r.group_size // 2) if a.strategy == "until_mixed" else None,
        retire_threshold=a.retire_threshold, retire_min_evidence=a.retire_min_evidence,
        revisit_prob=a.revisit_prob, seed=config.seed + 1)


def replay_capacity_tokens(config) -> int:
    """`replay.capacity_tokens`, or its default: 4 x the groups a process keeps open (P, plus the
    non-sync schedules' groups in flight) x group_size x max_context."""
    r = config.rollout
    if config.replay.capacity_tokens < 0:
        raise ValueError(f"replay.capacity_tokens={config.replay.capacity_tokens}: expected >= 0 (0 = the default)")
    if config.replay.capacity_tokens:
        return int(config.replay.capacity_tokens)
    prompts = max(1, sharding.process_share(r.prompts_per_iteration))
    open_groups = prompts + (0 if r.schedule == "sync" else (r.groups_in_flight or prompts))
    return 4 * open_groups * max(r.group_size, config.allocation.max_group) * r.max_context


def build_rollout_source(config, sampler, environments: "Environments", tok, template, settings, levels: dict,
                         buffer=None):
    """The RL rollout source: the schedule of `config.rollout`, a runner for its episodes (its
    groups held in `buffer`, a `replay.ReplayBuffer`), the task stream of `data.tasks` and the
    allocator of `config.allocation`."""
    from jaxrl_agent import rollout

    r = config.rollout
    schedule = rollout.Schedule(mode=r.schedule, window=r.window, max_staleness=r.max_staleness,
                                stale_policy=r.stale_policy, token_budget=r.token_budget,
                                groups_in_flight=r.groups_in_flight)
    runner = rollout.RolloutRunner(sampler, environments.make_env, tok, template, settings, r.group_size,
                                   token_budget=schedule.token_budget, seed=config.seed, buffer=buffer)
    return rollout.source.RolloutSource(
        build_task_stream(config, environments, levels, seed=config.seed), runner, schedule,
        # The job's prompts per iteration, split over its processes (each samples its own groups).
        prompts_per_iteration=max(1, sharding.process_share(r.prompts_per_iteration)), group_size=r.group_size,
        allocator=build_allocator(config, environments, levels), dynamic_sampling=config.allocation.dynamic_sampling,
        max_group=config.allocation.max_group)
