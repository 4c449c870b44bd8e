"""A JetStream `Engine` for our transformer: bucketed prefill, KV-cache slots, batched multi-step decode.

The math is `jaxrl_agent.models` (prefill / decode_step) and `sampling.decoding` (temperature,
top-k, top-p); this module arranges it into JetStream's engine API:

  prefill(params=..., padded_tokens, true_length, sampling=...) -> Prefix   (samples the 1st token)
  insert(prefix, decode_state, slot) -> decode_state
  generate(params, decode_state) -> (decode_state, ResultTokens)            (`steps_per_call` tokens)

Each emitted token carries its log-probability under the distribution it was drawn from and the
policy version of the weights that drew it. The engine holds `(params, version)` itself and reads
them at every call, so `update_weights` takes effect at the next step without a restart (JetStream's
Driver reads the params it was given once per thread; we ignore those). A slot stops emitting after
a stop token (which is emitted, with its log-prob) or when its cache is full.

`ResultTokens.data` is int32 [slots, 4k + 1] for k = steps_per_call: k tokens, k valid flags, the
slot's generated length, k float32 log-probs (bit-cast), k versions.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import models, sharding
from jaxrl_agent.sampling import decoding
from jaxrl_agent.sampling.jetstream_compat import import_jetstream
from jaxrl_agent.sampling.types import PromptTooLongError, SamplingParams  # noqa: F401 - re-exported
from jaxrl_agent.shape_reuse import ShapeReuse

engine_api, _, _, _, token_utils = import_jetstream()

# Batched prefills pad their row count to a power of two at least this (fewer compiled shapes).
MIN_PREFILL_ROWS = 8
# ... and run their distinct prompts through the model in this many rows when they fit (`unique_prefill_rows`).
MIN_UNIQUE_ROWS = 2
MIN_PREFILL_BUCKET = 16
# `generate` decodes the first R slots only, R = B/8 or B/4 of the B slots, at least this.
MIN_DECODE_ROWS = 8
# ... and attends over the first W cache positions only, W = S/4 or S/2 of the S positions when
# the live requests' positions stay below it, at least this.
MIN_DECODE_WINDOW = 64
# Prefix-cache copies (a finished request's keys/values saved into the pool, a continued one's
# taken back into a slot) move the first W positions only, W = S/4 or S/2 when the tokens lie below
# it, at least this: below it a full-length copy is small, and each window is one more compiled
# shape of the extend and save calls.
MIN_COPY_WINDOW = 128


def prefill_rows(n: int) -> int:
    """Rows of a batched prefill, extend or save call for n requests: a power of two, at least
    MIN_PREFILL_ROWS (each distinct row count compiles once)."""
    return max(MIN_PREFILL_ROWS, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def unique_prefill_rows(unique: int, rows: int) -> int:
    """Rows of the forward pass of a batched prefill of `rows` (padded) requests holding `unique`
    distinct prompts: MIN_UNIQUE_ROWS when they fit, else a quarter of the rows (a batch of whole
    groups of 4; at least MIN_PREFILL_ROWS) when they fit, else all of them. A group's G episodes
    share a prompt; mid-iteration admissions bring one or two groups' at a time, and an 8-row call
    of one or two distinct prompts then runs 2 prompt rows, not 8 (its forward pass ~2.5x faster).
    Three values per row count: each is one more compiled shape (the default run's 8-row calls had
    1-2 distinct prompts in 2 of 3 calls, 3-4 in most of the rest; 2, 4, 8 ... cost more to compile
    than they saved; benchmarks/RESULTS.md)."""
    quarter = max(MIN_PREFILL_ROWS, rows // 4)
    return min(rows, MIN_UNIQUE_ROWS if unique <= MIN_UNIQUE_ROWS else quarter if unique <= quarter else rows)


def prefill_bucket(length: int) -> int:
    """The padded length of a prefill or extend of `length` tokens: the smallest of 16, 24, 32, 48,
    64, 96, 128, ... (the powers of two from MIN_PREFILL_BUCKET and 3/4 of each) that holds it. A
    call's cost is about linear in its padded tokens (8 rows of a 64-token extend took 10.4 ms, of
    48 tokens 8.2 ms, of 32 6.1 ms; benchmarks/RESULTS.md): powers of two alone padded a 33-token
    turn to 64. Each bucket is one more compiled shape per row count, so the ladder stays geometric."""
    power = max(MIN_PREFILL_BUCKET, 1 << max(0, math.ceil(math.log2(max(length, 1)))))
    if power > MIN_PREFILL_BUCKET and length <= power * 3 // 4:
        return power * 3 // 4
    return power


def _cache_window(cache_length: int, end: int | None, minimum: int) -> int:
    """S/4 or S/2 of the S = cache_length positions, at least `minimum`, when positions below
    `end` fit in it; else S (None = S)."""
    if end is None:
        return cache_length
    for window in (cache_length // 4, cache_length // 2):
        if minimum <= window < cache_length and end <= window:
            return window
    return cache_length


# XLA:CPU options for the decode loop (`generate`). Measured on the benchmark shape (2 layers,
# d = 256, vocabulary 8192; one process, the variants' calls alternated; benchmarks/RESULTS.md):
#  * min / max without NaN propagation, at every size: the row max of the logits vectorises (a
#    NaN-propagating max ran as scalar code, ~70 us of a ~1.3 ms step at 8 rows; 5-6% of the step
#    at 32 and 64 rows). A row holding NaN may then take a non-NaN max, so its token is some valid
#    id; its log-prob is NaN either way, and the replay buffer rejects it.
#  * at most SMALL_DECODE_ROWS rows, also YNNPACK off and single-threaded Eigen: XLA's own emitters
#    and Eigen run these thin products faster (the [8, 256] x [256, 8192] output projection ~110 us
#    against ~330 us) and read the transposed key cache (`models.KVCache`) in place, and handing
#    each ~10-80 us product to a second thread costs more than it saves: 0.87-0.98 of the default
#    step at 8 rows, 0.93-0.99 at 16 (by the machine's state). From 32 rows up the same options are
#    ~20-30% slower than YNNPACK's threaded products.
#  `python benchmarks/sampler_throughput.py --compare_options` measures all three sets.
#  What is fastest differs by CPU: `sampling.host_tuning` measures these sets on the host the
#  first time (`sampler.decode_options='auto'`) and caches its choice; these are the built-in one.
SMALL_DECODE_ROWS = 16
CPU_DECODE_COMPILER_OPTIONS = {"xla_cpu_enable_fast_min_max": True}
CPU_SMALL_DECODE_COMPILER_OPTIONS = {
    **CPU_DECODE_COMPILER_OPTIONS,
    "xla_cpu_experimental_ynn_fusion_type": "",
    "xla_cpu_multi_thread_eigen": False,
}
# The named option sets a host may choose from, for the decode loop at more than SMALL_DECODE_ROWS
# rows ('large') and at most ('small'); `builtin` is (fast_minmax, small_batch).
DECODE_OPTION_SETS = {"xla_defaults": {}, "fast_minmax": CPU_DECODE_COMPILER_OPTIONS,
                      "small_batch": CPU_SMALL_DECODE_COMPILER_OPTIONS}
BUILTIN_DECODE_OPTIONS = ("fast_minmax", "small_batch")


@functools.cache
def _accepted_options(options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The subset of XLA compiler `options` this jaxlib knows (each tried once on a trivial program):
    an older XLA without, say, the YNNPACK flag then decodes with its defaults instead of failing
    to compile (setup.py allows jax >= 0.6)."""
    accepted = {}
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(np.float32(0)).compile()
        except Exception as err:  # noqa: BLE001 - an unknown option or value: leave it out
            logging.getLogger(__name__).warning("XLA option %s=%r not accepted here (%s); decoding without it",
                                                name, value, str(err).splitlines()[0] if str(err) else err)
        else:
            accepted[name] = value
    return accepted


def cpu_compiler_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """`options` as `jax.jit(compiler_options=)` for the engine's decode loop: on CPU, those this
    XLA accepts; elsewhere None (they are XLA:CPU options)."""
    if jax.default_backend() != "cpu":
        return None
    return _accepted_options(tuple(sorted(options.items()))) or None


class Prefix(flax.struct.PyTreeNode):
    k: tuple[jax.Array, ...]  # per layer [1, K, D, P] (keys) / [1, K, P, D] (values): see models.KVCache
    v: tuple[jax.Array, ...]
    true_length: jax.Array  # [] int32
    first_token: jax.Array  # [] int32
    first_logprob: jax.Array  # [] float32
    version: jax.Array  # [] int32
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


class DecodeState(flax.struct.PyTreeNode):
    cache: models.KVCache  # see models.KVCache (S = max_cache_length)
    next_token: jax.Array  # [B] sampled, not yet emitted
    next_logprob: jax.Array  # [B]
    next_version: jax.Array  # [B]
    position: jax.Array  # [B] position next_token occupies
    generated: jax.Array  # [B] tokens emitted so far
    active: jax.Array  # [B] bool
    temperature: jax.Array  # [B]
    top_k: jax.Array  # [B]
    top_p: jax.Array  # [B]
    rng: jax.Array
    # Prefix cache: a models.KVCache of M rows: keys/values of finished requests' token sequences,
    # copied back into a slot when a later prompt continues one (see `extend_insert_many`).
    pool: models.KVCache


def result_columns(steps: int) -> dict[str, tuple[int, int]]:
    """Column ranges of ResultTokens.data [slots, 4 * steps + 2] of a decode loop compiled for at
    most `steps` steps a call; "ran" (the last column, the same in every row) is how many it ran."""
    return {"tokens": (0, steps), "valid": (steps, 2 * steps), "length": (2 * steps, 2 * steps + 1),
            "logprobs": (2 * steps + 1, 3 * steps + 1), "versions": (3 * steps + 1, 4 * steps + 1),
            "ran": (4 * steps + 1, 4 * steps + 2)}


def _result_fields(data: np.ndarray, steps: int) -> dict[str, np.ndarray]:
    """The columns of ResultTokens.data [slots, 4 * steps + 2] by field, every slot at once, for the
    n steps the call ran (its "ran" column): tokens, valid, logprobs (float32, bit-cast back) and
    versions [slots, n]; length [slots]. Steps a call did not run are not rows' tokens."""
    cols = result_columns(steps)
    data = np.asarray(data)
    if data.shape[-1] != cols["ran"][1]:
        raise ValueError(f"expected decode results of {cols['ran'][1]} columns ({steps} steps a call), "
                         f"got {data.shape[-1]}")
    ran = int(data[0, cols["ran"][0]]) if len(data) else steps
    field = lambda name: data[:, cols[name][0]:cols[name][0] + ran]
    return {
        "tokens": field("tokens"),
        "valid": field("valid"),
        "length": data[:, cols["length"][0]],
        "logprobs": np.ascontiguousarray(field("logprobs")).view(np.float32),
        "versions": field("versions"),
    }


def decode_result_row(data: np.ndarray, slot: int, steps: int) -> dict[str, np.ndarray]:
    """Host-side view of one slot's row of ResultTokens.data (numpy arrays, valid as bool)."""
    row = {name: column[slot] for name, column in _result_fields(data, steps).items()}
    return {**row, "valid": row["valid"].astype(bool), "length": int(row["length"])}


def decode_result_lists(data: np.ndarray, steps: int) -> dict[str, list]:
    """Every slot's row of ResultTokens.data at once, as Python lists ([slot][step] for tokens,
    valid (0/1), logprobs and versions; [slot] for length): a few numpy operations a call, where
    reading each slot's row and each of its tokens as numpy scalars (`decode_result_row`) cost
    ~0.1 ms a 4-step call of 8 slots, ~1 ms at 64 — Python time the decode thread spends between
    calls. `{k: v[slot] for k, v in lists.items()}` is a row for `CompletionBuilder.add_row`."""
    return {name: column.tolist() for name, column in _result_fields(data, steps).items()}


class EngineTokenizer:
    """Our Tokenizer seen through JetStream's tokenizer API (ids in, ids out)."""

    def __init__(self, tokenizer, stop_ids: Sequence[int]):
        self._tok = tokenizer
        self._stop = set(int(i) for i in stop_ids)

    def encode(self, s: str, **kwargs):
        ids = np.asarray(self._tok.encode(s), np.int32)
        return ids, len(ids)

    def decode(self, token_ids, **kwargs) -> str:
        return self._tok.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return self._tok.pad_id

    @property
    def eos_id(self) -> int:
        return self._tok.eos_id

    @property
    def bos_id(self) -> int:
        return self._tok.pad_id  # we never prepend a BOS: prompts arrive as complete id sequences

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop)


class AgentEngine(engine_api.Engine):
    """JetStream engine over `models.ModelConfig` + params, with live weight updates.

    Args:
      config: the model architecture.  params: its parameters.
      tokenizer: a `jaxrl_agent.tokenizer.Tokenizer` (for text requests and the stop token).
      max_concurrent_decodes: KV-cache slots B.
      max_prefill_length: longest prompt, a power of two (prompts are padded to `prefill_bucket`s).
      max_cache_length: tokens per slot (prompt + generation); defaults to 2 * max_prefill_length.
      steps_per_call: decode steps per `generate` call (amortises per-call overhead): the fewest a
        call runs.
      max_steps_per_call: the most decode steps a `generate` call runs (0 = steps_per_call: every
        call runs steps_per_call). A call runs on past steps_per_call while no request has finished
        in it (a stop token or a full cache, seen on the device; `generate`'s `max_steps` bounds it
        by the requests' token limits, which the host knows): a decode whose requests all run on
        pays the per-call cost (dispatch, the window copy, the host's turn between calls) once per
        max_steps_per_call tokens, and one whose request finishes returns at once, its slot free.
      stop_token_ids: ids that end a sample (default: the tokenizer's eos).
      version: policy version of `params`.
      prefix_cache_entries: M, finished sequences whose keys/values are kept (in the decode
        state) so that a prompt continuing one prefills only its new tokens; 0 = off.
      shape_reuse: {'prefill' | 'extend' | 'decode': ShapeReuse}: a batched admission or a decode
        call whose shape is not compiled yet may run padded in a compiled larger one
        (`_program_shape`); None = every shape its own.
      decode_compiler_options: XLA:CPU options of the decode loop for every row count (`{}` = XLA's
        defaults), or a pair (options above SMALL_DECODE_ROWS rows, options at most); None = the
        built-in choice per row count (`CPU_DECODE_COMPILER_OPTIONS`,
        `CPU_SMALL_DECODE_COMPILER_OPTIONS`). Ignored off CPU. `set_decode_compiler_options`
        changes them later (`sampling.host_tuning` does, with the host's measured choice).
    """

    def __init__(self, config: models.ModelConfig, params, tokenizer, *, max_concurrent_decodes: int = 8,
                 max_prefill_length: int = 256, max_cache_length: int | None = None, steps_per_call: int = 4,
                 max_steps_per_call: int = 0,
                 stop_token_ids: Sequence[int] | None = None, version: int = 0, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None, prefix_cache_entries: int = 0,
                 decode_compiler_options: dict[str, Any] | None = None,
                 shape_reuse: dict[str, ShapeReuse] | None = None):
        if max_prefill_length < MIN_PREFILL_BUCKET or max_prefill_length & (max_prefill_length - 1):
            raise ValueError(f"max_prefill_length must be a power of two >= {MIN_PREFILL_BUCKET}, got {max_prefill_length}")
        self.config = config
        self.tokenizer = tokenizer
        self._slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self.max_cache_length = max_cache_length or 2 * max_prefill_length
        if self.max_cache_length < max_prefill_length:
            raise ValueError("max_cache_length must be >= max_prefill_length")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        if max_steps_per_call and max_steps_per_call < steps_per_call:
            raise ValueError(f"max_steps_per_call must be 0 or >= steps_per_call={steps_per_call}, "
                             f"got {max_steps_per_call}")
        self.steps_per_call = steps_per_call
        self.max_steps_per_call = max_steps_per_call or steps_per_call
        self.stop_token_ids = tuple(stop_token_ids if stop_token_ids is not None else (tokenizer.eos_id,))
        # This process's first device: with several processes (jax.distributed) each samples on its own.
        self._mesh = mesh or jax.sharding.Mesh(np.asarray(jax.local_devices()[:1]), ("data",))
        self._lock = threading.Lock()
        # With tied embeddings on CPU the decode loop reads the output projection as a materialised
        # [H, V] copy of the embedding's transpose, made once per weight update (see models.extend):
        # the logits product is the largest of a decode step, and ~25% faster in that layout.
        self._output_kernel_fn = (jax.jit(functools.partial(models.output_kernel, config))
                                  if config.tie_word_embeddings and jax.default_backend() == "cpu" else None)
        # The engine holds its weights with the layers unstacked (`models.unstack_layers`), made once
        # per update: sliced out of the stacked arrays inside every `generate` call, every layer's
        # weights were copied per call (~0.6 ms of a 16-step call here; the whole model per call
        # for a 0.6B one). `param_template()` keeps the stacked tree's shapes for checkpoints.
        # The engine's weights live on its own mesh (replicated), whatever mesh the learner's are on.
        local = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
        self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local), params)
        self._params, self._kernel = self._own_copy(params)
        self._version = int(version)
        self._seed = seed
        if prefix_cache_entries < 0:
            raise ValueError(f"prefix_cache_entries must be >= 0, got {prefix_cache_entries}")
        self.prefix_cache_entries = int(prefix_cache_entries)
        # The jitted calls are shared by every engine of the same model and decode shape (module
        # caches): a second engine (`LocalSampler` over several) compiles nothing new. Its seed
        # enters as an argument (`_base_key`), not as a constant of the program.
        self._base_key = jax.random.PRNGKey(seed)
        self._prefill_fn, self._prefill_insert_fn, self._extend_insert_fn = _admission_fns(config)
        self._insert_fn, self._free_fn, self._save_fn = _INSERT_FN, _FREE_FN, _SAVE_FN
        self._sample_insert_fn = _SAMPLE_INSERT_FN
        self._generate_key = (config, steps_per_call, self.max_steps_per_call, self.stop_token_ids)
        if decode_compiler_options is None:
            decode_compiler_options = tuple(DECODE_OPTION_SETS[name] for name in BUILTIN_DECODE_OPTIONS)
        elif isinstance(decode_compiler_options, dict):
            decode_compiler_options = (decode_compiler_options,) * 2
        self.set_decode_compiler_options(*decode_compiler_options)
        self._prefill_count = 0
        # The programs' compiled shapes ('prefill', 'extend', 'decode': `_program_shape`), shared by
        # the engines of one sampler (they share the jitted programs); {} = every shape its own.
        self.shape_reuse = dict(shape_reuse or {})

    def _decode_fn(self, options: dict[str, Any]) -> Callable:
        """The jitted decode loop under XLA:CPU `options` (compiled once per option set and shape)."""
        return _decode_fn(*self._generate_key, tuple(sorted(options.items())))

    def set_decode_compiler_options(self, large: dict[str, Any], small: dict[str, Any]) -> None:
        """The decode loop's XLA:CPU options above SMALL_DECODE_ROWS decoded rows (`large`) and at
        most (`small`). They change speed, never tokens."""
        with self._lock:
            self._generate_fn, self._generate_small_fn = self._decode_fn(large), self._decode_fn(small)

    def _program_shape(self, program: str, wanted: tuple[int, ...]) -> tuple[int, ...]:
        """The shape to run `program` in ('prefill': rows, distinct-prompt rows, token bucket;
        'extend': rows, token bucket, copy window; 'decode': rows, cache window): `wanted`, or a
        compiled larger one while that is cheaper than compiling (`shape_reuse`; the padding is
        rows dropped or not live, tokens past the prompts', cache positions past the requests')."""
        reuse = self.shape_reuse.get(program)
        return wanted if reuse is None else reuse.choose(wanted)

    def decode_step_seconds(self, options: dict[str, Any], rows: int, *, calls: int = 3) -> float:
        """Seconds per decode step of `calls` generate calls under `options`, `rows` slots decoded
        (all active, on a scratch decode state; compiled and warmed up first). For measuring option
        sets on this host (`sampling.host_tuning`); the engine's own decode state is not touched."""
        fn = self._decode_fn(options)
        with self._lock:
            params, kernel, version = self._params, self._kernel, self._version
        state = self.init_decode_state()
        state = state.replace(active=jnp.ones_like(state.active))
        window = self.max_cache_length
        # Every call runs steps_per_call steps exactly (its bound), whatever the scratch rows sample.
        steps = np.int32(self.steps_per_call)
        state, data = fn(params, kernel, state, np.int32(version), steps, rows=rows, window=window)  # compile + warm up
        jax.block_until_ready(data)
        start = time.perf_counter()
        for _ in range(calls):
            state, data = fn(params, kernel, state, np.int32(version), steps, rows=rows, window=window)
        jax.block_until_ready(data)
        return (time.perf_counter() - start) / (calls * self.steps_per_call)

    # ---------------------------------------------------------------- weights
    @property
    def version(self) -> int:
        return self._version

    def current_params(self):
        """(params, version): the weights as the engine holds them (layers unstacked), for pinning
        the weights of `prefill_insert_many` / `extend_insert_many` calls."""
        with self._lock:
            return self._params, self._version

    def param_template(self):
        """The parameter tree `update_weights` takes (stacked layers), as ShapeDtypeStructs with
        shardings: e.g. the target of an orbax restore."""
        return self._template

    def update_weights(self, params, version: int) -> None:
        """New weights (the stacked tree of `param_template()`) for every call from now on; tokens
        they sample carry `version`."""
        params, kernel = self._own_copy(params)
        with self._lock:
            self._params, self._kernel, self._version = params, kernel, int(version)

    def _own_copy(self, params):
        """(unstacked params, output kernel or None) on this engine's mesh, copied: the learner
        donates its parameter buffers to the next train step, which may run while this engine is
        still sampling (asynchronous schedules). Parameters sharded over several processes are
        gathered first (every process calls this at the same point)."""
        params = sharding.to_host_tree(params)
        params = jax.tree.map(lambda new, like: jax.device_put(jnp.array(new, like.dtype, copy=True), like.sharding),
                              params, self._template)
        params = models.unstack_layers(params)
        return params, (self._output_kernel_fn(params) if self._output_kernel_fn else None)

    # ---------------------------------------------------------------- JetStream Engine API
    def load_params(self, *args, **kwargs):
        return self._params

    def bucket_length(self, length: int) -> int:
        """Tokens a prompt (or a continued turn's new tokens) of `length` is padded to
        (`prefill_bucket`); a prompt longer than max_prefill_length is refused."""
        if length > self._max_prefill:
            raise PromptTooLongError(
                f"prompt of {length} tokens exceeds max_prefill_length={self._max_prefill}")
        return prefill_bucket(length)

    def prefill(self, *, params=None, existing_prefix=None, padded_tokens, true_length: int,
                sampling: SamplingParams | None = None) -> Prefix:
        del params  # the engine's own (params, version), read now
        if existing_prefix is not None:
            raise ValueError("existing_prefix (prefix caching) is not supported; send the whole history as ids")
        sampling = sampling or SamplingParams()
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if true_length < 1 or true_length > tokens.shape[0]:
            raise ValueError(f"true_length={true_length} does not fit padded tokens of length {tokens.shape[0]}")
        bucket = self.bucket_length(true_length)
        if tokens.shape[0] != bucket:
            tokens = np.pad(tokens[:true_length], (0, bucket - true_length), constant_values=self.tokenizer.pad_id)
        params, version = self.current_params()
        self._prefill_count += 1
        rng = jax.random.fold_in(jax.random.PRNGKey(self._seed), self._prefill_count)
        return self._prefill_fn(params, tokens[None], np.int32(true_length), rng,
                                np.float32(sampling.temperature), np.int32(sampling.top_k),
                                np.float32(sampling.top_p), np.int32(version))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        return self._insert_fn(prefix, decode_state, jnp.int32(slot))

    def prefill_insert_many(self, prompts: Sequence[np.ndarray], samplings: Sequence[SamplingParams],
                            decode_state: DecodeState, slots: Sequence[int], *,
                            params_version: tuple[Any, int] | None = None) -> DecodeState:
        """Prefills several prompts in one batched call and inserts them into `slots`.

        Equivalent to `insert(prefill(...), state, slot)` per prompt (same tokens, log-probs and
        cache contents), but one forward pass for all: with hundreds of short requests, per-request
        prefill dominated the sampler's time on CPU. Identical prompts (a group's G episodes all
        start from the task's prompt) run through the model once, in `unique_prefill_rows` rows;
        each row still samples its first token with its own random stream, in the sampling program
        shared by every batched admission of its row count (`_sample_insert`). The batch is padded
        to a power-of-two count of rows (at least 8; padded rows are dropped) and to a
        `prefill_bucket` of tokens, so that few shapes are ever compiled. `params_version` (from
        `current_params()`) pins the weights used.
        """
        n = len(prompts)
        if not n == len(samplings) == len(slots):
            raise ValueError(f"{n} prompts, {len(samplings)} sampling params and {len(slots)} slots differ")
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        lengths = [int(p.size) for p in prompts]
        bucket = self.bucket_length(max(lengths))
        params, version = params_version or self.current_params()
        first_of: dict[bytes, int] = {}
        source = [first_of.setdefault(p.tobytes(), len(first_of)) for p in prompts]  # row -> unique prompt
        unique = [prompts[source.index(u)] for u in range(len(first_of))]
        rows = prefill_rows(n)
        rows, unique_rows, bucket = self._program_shape(
            "prefill", (rows, unique_prefill_rows(len(unique), rows), bucket))
        batch = self._batch_rows(prompts, lengths, bucket, samplings, slots, rows=rows)
        unique_tokens = np.full((unique_rows, bucket), self.tokenizer.pad_id, np.int32)
        for i, prompt in enumerate(unique):
            unique_tokens[i, :prompt.size] = prompt
        source = np.asarray(source + [0] * (rows - n), np.int32)  # padding rows read unique prompt 0
        decode_state, last = self._prefill_insert_fn(params, decode_state, unique_tokens, source,
                                                     batch["true_lengths"], batch["slots"])
        return self._sample_insert(decode_state, last, batch["true_lengths"], batch, version)

    def _sample_insert(self, decode_state: DecodeState, last, positions, batch: dict[str, np.ndarray],
                       version: int) -> DecodeState:
        """Samples the batch's first tokens from `last` [R, V] and puts them, with each row's sampling
        state and next `positions` [R], into the batch's slots."""
        return self._sample_insert_fn(self._base_key, decode_state, last, positions, batch["counts"],
                                      batch["temperature"], batch["top_k"], batch["top_p"], np.int32(version),
                                      batch["slots"])

    def _batch_rows(self, token_rows, lengths, bucket, samplings, slots, rows: int | None = None
                    ) -> dict[str, np.ndarray]:
        """Right-pads `token_rows` to [R, bucket] for R = `rows` (None = `prefill_rows`: a power of
        two >= MIN_PREFILL_ROWS; each distinct shape costs one compilation; padding rows cost
        compute and are dropped: their slot is out of range), with per-row sampling params and RNG
        stream counts. Host (numpy) arrays: the jitted call transfers them, where a `jnp.asarray`
        each cost ~0.1 ms of dispatch."""
        n = len(token_rows)
        rows = prefill_rows(n) if rows is None else rows
        pad = rows - n
        tokens = np.full((rows, bucket), self.tokenizer.pad_id, np.int32)
        for i, row in enumerate(token_rows):
            tokens[i, :lengths[i]] = np.asarray(row, np.int32).reshape(-1)
        counts = np.arange(self._prefill_count + 1, self._prefill_count + rows + 1, dtype=np.uint32)
        self._prefill_count += n
        return {
            "tokens": tokens,
            "true_lengths": np.asarray(list(lengths) + [1] * pad, np.int32),
            "counts": counts,
            "temperature": np.asarray([s.temperature for s in samplings] + [1.0] * pad, np.float32),
            "top_k": np.asarray([s.top_k for s in samplings] + [0] * pad, np.int32),
            "top_p": np.asarray([s.top_p for s in samplings] + [1.0] * pad, np.float32),
            "slots": np.asarray(list(slots) + [self._slots] * pad, np.int32),
            "pad": pad,
        }

    def extend_insert_many(self, entries: Sequence[int], starts: Sequence[int], suffixes: Sequence[np.ndarray],
                           samplings: Sequence[SamplingParams], decode_state: DecodeState, slots: Sequence[int], *,
                           params_version: tuple[Any, int] | None = None) -> DecodeState:
        """Continues cached prefixes: row i takes prefix-cache entry `entries[i]` (whose first
        `starts[i]` positions hold the keys/values of the prompt's first `starts[i]` tokens), runs
        only `suffixes[i]` (the rest of the prompt) at positions starts[i]..., samples the first
        new token, and inserts the row into `slots[i]`.

        Equivalent to `prefill_insert_many` on the whole prompts (same sampling stream; keys and
        values equal up to float rounding) when the entries were computed with the same weights —
        the caller's `PrefixIndex` guarantees that by versioning its entries.
        """
        n = len(entries)
        if not n == len(starts) == len(suffixes) == len(samplings) == len(slots):
            raise ValueError(f"{n} entries, {len(starts)} starts, {len(suffixes)} suffixes, {len(samplings)} "
                             f"sampling params and {len(slots)} slots differ")
        if n == 0 or self.prefix_cache_entries == 0:
            raise ValueError("extend_insert_many needs rows and an engine with prefix_cache_entries > 0")
        lengths = [int(np.asarray(x).size) for x in suffixes]
        if min(lengths) < 1:
            raise ValueError("every suffix needs at least one token (the position whose logits sample next)")
        for start, length in zip(starts, lengths):
            if start < 1 or start + length > self.max_cache_length:
                raise ValueError(f"prefix of {start} + suffix of {length} tokens does not fit "
                                 f"max_cache_length={self.max_cache_length}")
        params, version = params_version or self.current_params()
        rows, bucket, window = self._program_shape("extend", (
            prefill_rows(n), self.bucket_length(max(lengths)),
            self.copy_window(max(start + length for start, length in zip(starts, lengths)))))
        batch = self._batch_rows(suffixes, lengths, bucket, samplings, slots, rows=rows)
        pad = batch["pad"]
        starts = np.asarray(list(starts) + [0] * pad, np.int32)
        decode_state, last = self._extend_insert_fn(
            params, decode_state, np.asarray(list(entries) + [0] * pad, np.int32), starts, batch["tokens"],
            batch["true_lengths"], batch["slots"], window=window)
        return self._sample_insert(decode_state, last, starts + batch["true_lengths"], batch, version)

    def save_prefixes(self, decode_state: DecodeState, slots: Sequence[int], entries: Sequence[int], *,
                      length: int | None = None) -> DecodeState:
        """Copies the keys/values of `slots` into prefix-cache `entries` (before the slots are
        reused): their first `length` positions (None = all; `copy_window(length)` are copied)."""
        if len(slots) != len(entries):
            raise ValueError(f"{len(slots)} slots and {len(entries)} entries differ")
        rows = prefill_rows(len(slots))
        pad = rows - len(slots)
        return self._save_fn(decode_state, np.asarray(list(slots) + [0] * pad, np.int32),
                             np.asarray(list(entries) + [self.prefix_cache_entries] * pad, np.int32),
                             window=self.copy_window(length))

    def copy_window(self, length: int | None) -> int:
        """Cache positions a prefix-cache copy moves when the tokens that matter lie below position
        `length`: S/4 or S/2 (at least MIN_COPY_WINDOW) when they fit, else all S (None = all).
        Positions past the window are never read for these tokens: a slot's attention is masked
        at its own position, and a pool entry serves only prefixes of the tokens it stored."""
        return _cache_window(self.max_cache_length, length, MIN_COPY_WINDOW)

    def decode_rows(self, live_slots: int | None) -> int:
        """Slots a `generate` call decodes when every live slot lies below `live_slots`: B/8 or B/4
        (at least 8) when that covers them, else all B — three compiled shapes at most. (Half the
        slots saved almost nothing: copying their keys/values out of and back into the cache cost
        about what the other half's decoding did; benchmarks/decode_occupancy.py.)"""
        b = self._slots
        if live_slots is None:
            return b
        for rows in (max(MIN_DECODE_ROWS, b // 8), max(MIN_DECODE_ROWS, b // 4)):
            if live_slots <= rows < b:
                return rows
        return b

    def decode_window(self, live_length: int | None) -> int:
        """Cache positions a `generate` call attends over when every live request's next token
        lies below position `live_length`: S/4 or S/2 (at least MIN_DECODE_WINDOW) when the call's
        `steps_per_call` tokens still fit below it, else all S — three compiled shapes at most."""
        end = None if live_length is None else live_length + self.steps_per_call
        return _cache_window(self.max_cache_length, end, MIN_DECODE_WINDOW)

    def call_steps(self, live_length: int | None = None, max_steps: int | None = None) -> int:
        """The most decode steps a `generate` call with these arguments runs: `max_steps` (None =
        max_steps_per_call) within [steps_per_call, max_steps_per_call], and no more than fit in
        the call's cache window (`decode_window(live_length)`; the window is chosen for
        steps_per_call steps, and a longer call never widens it)."""
        steps = self.max_steps_per_call if max_steps is None else min(int(max_steps), self.max_steps_per_call)
        steps = max(steps, self.steps_per_call)
        if live_length is not None:
            window = self.decode_window(live_length)
            if window < self.max_cache_length:  # a window holds live_length + steps_per_call at least
                steps = min(steps, window - live_length)
        return steps

    def generate(self, params, decode_state: DecodeState, *, live_slots: int | None = None,
                 live_length: int | None = None, max_steps: int | None = None):
        """Decode steps: `steps_per_call` of them, then more while no request finished in the call,
        up to `call_steps(live_length, max_steps)` — the host passes as `max_steps` the fewest
        tokens any live request may still emit (its max_tokens), which the device does not know.
        The result's "ran" column (`result_columns`) says how many steps ran.

        With `live_slots` (every slot holding a request lies below it; the caller allocates the
        lowest free slot first), only the first `decode_rows(live_slots)` slots are decoded: a
        step's cost is per slot decoded — the keys/values it reads, the rows of its matmuls, the
        sampling — not per live request, and most of an iteration's tail, an evaluation's end or an
        asynchronous run's waits on tools have few slots live. The other slots' rows of the result
        are zero (not valid).

        With `live_length` (every live request's next token — prompt length plus tokens emitted —
        lies below that position), the steps attend over the first `decode_window(live_length)`
        cache positions only: the keys and values a step reads, and its softmax, scale with the
        window, not with the cache's length (a multi-turn episode's early turns are short)."""
        del params
        with self._lock:
            params, kernel, version = self._params, self._kernel, self._version
        rows, window = self._program_shape("decode", (self.decode_rows(live_slots), self.decode_window(live_length)))
        generate = self._generate_small_fn if rows <= SMALL_DECODE_ROWS else self._generate_fn
        state, data = generate(params, kernel, decode_state, np.int32(version),
                               np.int32(self.call_steps(live_length, max_steps)), rows=rows, window=window)
        k = self.max_steps_per_call
        result = engine_api.ResultTokens(data=data, tokens_idx=(0, k), valid_idx=(k, 2 * k),
                                         length_idx=(2 * k, 2 * k + 1), samples_per_slot=1)
        return state, result

    def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stops a slot (its request completed on the host side, e.g. at max_tokens)."""
        return decode_state.replace(active=decode_state.active.at[slot].set(False))

    def free_slots(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Stops several slots in one call (a boolean mask, so one compiled shape)."""
        mask = np.zeros(self._slots, bool)
        mask[list(slots)] = True
        return self._free_fn(decode_state, mask)

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty decode state, placed as the engine's programs return theirs (replicated on the
        engine's mesh): a program called first with a fresh state and then with its own output sees
        the same input shardings both times and compiles once, not twice (~1.3 s a program here)."""
        b = self._slots
        zeros_i = lambda: jnp.zeros((b,), jnp.int32)  # distinct buffers: the state is donated
        return jax.device_put(DecodeState(
            cache=models.init_cache(self.config, b, self.max_cache_length),
            next_token=zeros_i(), next_logprob=jnp.zeros((b,), jnp.float32), next_version=zeros_i(),
            position=zeros_i(), generated=zeros_i(), active=jnp.zeros((b,), bool),
            temperature=jnp.ones((b,), jnp.float32), top_k=zeros_i(), top_p=jnp.ones((b,), jnp.float32),
            rng=jax.random.PRNGKey(self._seed + 1),
            pool=models.init_cache(self.config, self.prefix_cache_entries, self.max_cache_length),
        ), jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec()))

    def get_prefix_destination_sharding(self) -> Any:
        return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

    def get_tokenizer(self):
        from jetstream.engine import tokenizer_pb2

        return tokenizer_pb2.TokenizerParameters(path="jaxrl_agent")

    def build_tokenizer(self, metadata) -> EngineTokenizer:
        return EngineTokenizer(self.tokenizer, self.stop_token_ids)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self):
        return None


@functools.cache
def _admission_fns(config: models.ModelConfig) -> tuple[Callable, Callable, Callable]:
    """The jitted (prefill, batched prefill forward + cache insert, extend forward + cache insert) of
    a model, one per config. The batched two leave sampling to `_SAMPLE_INSERT_FN`."""
    return (jax.jit(functools.partial(_prefill, config)),
            jax.jit(functools.partial(_prefill_forward_insert, config), donate_argnums=(1,)),
            jax.jit(functools.partial(_extend_forward_insert, config), donate_argnums=(1,), static_argnames=("window",)))


@functools.cache
def _decode_fn(config: models.ModelConfig, min_steps: int, max_steps: int, stop_ids: tuple[int, ...],
               options: tuple[tuple[str, Any], ...]) -> Callable:
    """The jitted decode loop (`_generate`) of a model and decode shape under XLA:CPU `options`."""
    return jax.jit(functools.partial(_generate, config, min_steps, max_steps, np.asarray(stop_ids, np.int32)),
                   donate_argnums=(2,),
                   static_argnames=("rows", "window"), compiler_options=cpu_compiler_options(dict(options)))


# ------------------------------------------------------------------------------ jitted functions
def _prefill(config, params, tokens, true_length, rng, temperature, top_k, top_p, version) -> Prefix:
    cache = models.init_cache(config, 1, tokens.shape[1])
    last, cache = models.prefill(config, params, tokens, cache, at=(true_length - 1)[None])  # [1, V]
    token, logprob = decoding.sample_tokens(last, rng, temperature[None], top_k[None], top_p[None])
    return Prefix(k=cache.k, v=cache.v, true_length=true_length, first_token=token[0], first_logprob=logprob[0],
                  version=version, temperature=temperature, top_k=top_k, top_p=top_p)


def _prefill_forward_insert(config, params, state: DecodeState, unique_tokens, source, true_lengths,
                            slots) -> tuple[DecodeState, jax.Array]:
    """unique_tokens [U, P] right-padded distinct prompts; row i of the batch is prompt source[i]
    (source, true_lengths and slots are [N]; a slot >= B drops the row). Puts each row's keys/values
    into its slot; returns the state and the logits at each row's last prompt token [N, V]."""
    p = unique_tokens.shape[1]
    cache = models.init_cache(config, unique_tokens.shape[0], p)
    last, cache = models.prefill(config, params, unique_tokens, cache, at=source * p + true_lengths - 1)  # [N, V]
    rows = models.KVCache(*(tuple(c[source] for c in caches) for caches in (cache.k, cache.v)))
    return state.replace(cache=state.cache.put_rows(rows, slots)), last


def _extend_forward_insert(config, params, state: DecodeState, entries, starts, tokens, true_lengths, slots,
                           window: int) -> tuple[DecodeState, jax.Array]:
    """Rows start from prefix-cache entries [N] holding `starts` [N] positions; tokens [N, T] (the
    right-padded suffixes, `true_lengths` [N]) run at positions starts + 0..T-1 on top of them, and
    each row's keys/values go into its slot (a slot >= B drops the row). Only the entries' first
    `window` positions (static; starts + true_lengths <= window) are taken, attended over and put
    into the slots. Returns the state and the logits at each row's last suffix token [N, V]."""
    t = tokens.shape[1]
    # A padded suffix may run past the window's end; `extend` drops those writes (only padding).
    rows = models.KVCache(tuple(c[entries][..., :window] for c in state.pool.k),
                          tuple(c[entries][:, :, :window] for c in state.pool.v))
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    last, cache = models.extend(config, params, tokens, positions, rows,
                                at=jnp.arange(tokens.shape[0]) * t + true_lengths - 1)  # [N, V]
    return state.replace(cache=state.cache.put_rows(cache, slots)), last


def _save_prefixes(state: DecodeState, slots, entries, window: int) -> DecodeState:
    """pool[entries[i], :window] = cache[slots[i], :window] per layer, over the position axis of
    keys [.., D, S] and values [.., S, D] (an entry index >= M drops the row)."""
    keys = tuple(p.at[entries, :, :, :window].set(c[slots][..., :window], mode="drop")
                 for p, c in zip(state.pool.k, state.cache.k))
    values = tuple(p.at[entries, :, :window, :].set(c[slots][:, :, :window], mode="drop")
                   for p, c in zip(state.pool.v, state.cache.v))
    return state.replace(pool=models.KVCache(keys, values))


def _sample_insert(base, state: DecodeState, last, positions, counts, temperature, top_k, top_p, version,
                   slots) -> DecodeState:
    """Samples each row's first token from `last` [N, V] (the logits at its prompt's last token) and
    puts the row's sampling state into `slots` (a slot >= B drops the row); `positions` [N] is where
    that first token will sit. A program of its own, shared by batched prefills and extends of every
    length: inside each of them, sampling was ~0.5 s of a ~1 s compile (benchmarks/RESULTS.md)."""
    n = last.shape[0]
    keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(counts)
    # One batched call (its filter / greedy branches decided once for all rows), per-row keys.
    token, logprob = decoding.sample_tokens(last, keys, temperature, top_k, top_p)

    at = lambda array, value: array.at[slots].set(value, mode="drop")
    return state.replace(
        next_token=at(state.next_token, token),
        next_logprob=at(state.next_logprob, logprob),
        next_version=at(state.next_version, jnp.broadcast_to(version, (n,))),
        position=at(state.position, positions),
        generated=at(state.generated, jnp.zeros((n,), jnp.int32)),
        active=at(state.active, jnp.ones((n,), bool)),
        temperature=at(state.temperature, temperature),
        top_k=at(state.top_k, top_k),
        top_p=at(state.top_p, top_p),
    )


def _insert(prefix: Prefix, state: DecodeState, slot) -> DecodeState:
    at = lambda array, value: array.at[slot].set(value)
    return state.replace(
        cache=state.cache.put_rows(models.KVCache(prefix.k, prefix.v), slot[None]),
        next_token=at(state.next_token, prefix.first_token),
        next_logprob=at(state.next_logprob, prefix.first_logprob),
        next_version=at(state.next_version, prefix.version),
        position=at(state.position, prefix.true_length),
        generated=at(state.generated, 0),
        active=at(state.active, True),
        temperature=at(state.temperature, prefix.temperature),
        top_k=at(state.top_k, prefix.top_k),
        top_p=at(state.top_p, prefix.top_p),
    )


_INSERT_FN = jax.jit(_insert, donate_argnums=(1,))
_FREE_FN = jax.jit(lambda state, mask: state.replace(active=state.active & ~mask), donate_argnums=(0,))
_SAVE_FN = jax.jit(_save_prefixes, donate_argnums=(0,), static_argnames=("window",))
_SAMPLE_INSERT_FN = jax.jit(_sample_insert, donate_argnums=(1,))


def _generate(config, min_steps, max_steps, stop_ids, params, kernel, state: DecodeState, version, bound,
              rows: int, window: int):
    """Decode steps over the first `rows` slots (static), attending over the first `window` cache
    positions (static; every active slot's positions in this call must lie below it); the other
    slots and positions are left as they are. The call runs n steps: `min_steps`, then on while no
    slot active at the call's start has stopped (a stop token emitted, or its window full), up to
    `bound` ([] int32, clipped to [min_steps, max_steps]); n is the result's last column, and its
    other columns hold max_steps steps, the first n of them run. params: the engine's weights,
    layers unstacked (see `AgentEngine.__init__`); kernel: the output projection [H, V], or None to
    derive it from params in the loop."""
    steps = max_steps
    b, full = state.next_token.shape[0], state.cache.max_length
    max_len = window
    per_slot = ("next_token", "next_logprob", "next_version", "position", "generated", "active", "temperature",
                "top_k", "top_p")
    head = lambda x: x[:rows] if rows < b else x
    sub = state.replace(cache=models.KVCache(tuple(head(c)[..., :window] for c in state.cache.k),
                                             tuple(head(c)[:, :, :window] for c in state.cache.v)),
                        **{f: head(getattr(state, f)) for f in per_slot})

    def step(state: DecodeState, _):
        emit = (state.next_token, state.next_logprob, state.next_version, state.active)
        is_stop = jnp.any(state.next_token[:, None] == stop_ids[None, :], axis=-1)
        generated = state.generated + state.active.astype(jnp.int32)
        # Run the model on the token just emitted, at its position, to sample the next one.
        position = jnp.minimum(state.position, max_len - 1)
        logits, cache = models.decode_step(config, params, state.next_token, position, state.cache, kernel=kernel)
        rng, key = jax.random.split(state.rng)
        with jax.named_scope("sample_tokens"):  # names its ops in profiles (benchmarks/decode_profile.py)
            token, logprob = decoding.sample_tokens(logits, key, state.temperature, state.top_k, state.top_p)
        keep_going = state.active & ~is_stop & (state.position < max_len)
        new_state = state.replace(
            cache=cache,
            next_token=jnp.where(keep_going, token, state.next_token),
            next_logprob=jnp.where(keep_going, logprob, state.next_logprob),
            next_version=jnp.where(keep_going, version, state.next_version),
            position=state.position + keep_going.astype(jnp.int32),
            generated=generated,
            active=keep_going,
            rng=rng,
        )
        return new_state, emit

    if min_steps == max_steps:
        sub, (tokens, logprobs, versions, valid) = jax.lax.scan(step, sub, None, length=steps)
        ran = jnp.int32(steps)
    else:
        bound = jnp.clip(bound, min_steps, max_steps)
        started = sub.active

        def go_on(carry):
            i, s, _ = carry
            stopped = jnp.any(started & ~s.active)
            return (i < bound) & ((i < min_steps) | ~stopped)

        def one_step(carry):
            i, s, outs = carry
            s, emitted = step(s, None)
            return i + 1, s, tuple(jax.lax.dynamic_update_index_in_dim(o, e, i, 0) for o, e in zip(outs, emitted))

        outs = tuple(jnp.zeros((steps,) + e.shape, e.dtype)
                     for e in (sub.next_token, sub.next_logprob, sub.next_version, sub.active))
        ran, sub, (tokens, logprobs, versions, valid) = jax.lax.while_loop(go_on, one_step, (jnp.int32(0), sub, outs))
    # [steps, rows] -> [rows, 4 * steps + 2] int32 (`result_columns`)
    data = jnp.concatenate([
        tokens.T, valid.T.astype(jnp.int32), sub.generated[:, None],
        jax.lax.bitcast_convert_type(logprobs.T.astype(jnp.float32), jnp.int32), versions.T,
        jnp.broadcast_to(ran, (tokens.shape[1], 1)),
    ], axis=1).astype(jnp.int32)
    if rows == b and window == full:
        return sub, data
    back = lambda whole, part: jax.lax.dynamic_update_slice(whole, part.astype(whole.dtype), (0,) * whole.ndim)
    # Only the positions the steps wrote go back into the whole cache: step i wrote row r's keys and
    # values at min(p_r + i', window - 1) for some i' <= i (a row's position advances at most once a
    # step, and every row writes at its clamped position, live or not), so the strip
    # min(p_r + 0..steps-1, window - 1) covers every write; the rest of the window is the copy it
    # was taken from. Taking the window and writing all of it back cost 0.2-0.5 ms of a ~3 ms
    # 4-step call of 8 rows at windows 128-256, the write-back about half (benchmarks/RESULTS.md).
    written = jnp.minimum(head(state.position)[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :], window - 1)
    slot = jnp.arange(rows)[:, None]  # [rows, 1] against written [rows, steps]
    # Both index forms put the indexed axes first: the strip is [rows, steps, K, D] either way.
    strip_k = lambda whole, part: whole.at[slot, :, :, written].set(part[slot, :, :, written])
    strip_v = lambda whole, part: whole.at[slot, :, written, :].set(part[slot, :, written, :])
    state = state.replace(
        cache=models.KVCache(tuple(strip_k(f, p) for f, p in zip(state.cache.k, sub.cache.k)),
                             tuple(strip_v(f, p) for f, p in zip(state.cache.v, sub.cache.v))),
        rng=sub.rng, **{f: back(getattr(state, f), getattr(sub, f)) for f in per_slot})
    return state, jnp.pad(data, ((0, b - rows), (0, 0)))
