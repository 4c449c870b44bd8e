"""The engine and the in-process sampler: exact greedy decoding, exact log-probs, slots, stops."""

import asyncio
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import models, tokenizer as tok
from jaxrl_agent.sampling import AgentEngine, LocalSampler, PromptTooLongError, SamplingParams
from jaxrl_agent.sampling import decoding
from jaxrl_agent.sampling import engine as engine_lib
from jaxrl_agent.sampling.engine import decode_result_lists, decode_result_row

TOKENIZER = tok.CharTokenizer()
CONFIG = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=16)
PARAMS = models.init_params(CONFIG, jax.random.PRNGKey(0))
_forward = jax.jit(models.forward, static_argnums=0)
PAD_TO = 64


def forward_rows(params, seq):
    """Full-forward logits [len(seq), V]: padded to one length so that it compiles once (causal
    attention: the padding after a position cannot change its logits)."""
    padded = np.zeros((1, PAD_TO), np.int32)
    padded[0, :len(seq)] = seq
    return _forward(CONFIG, params, jnp.asarray(padded))[0, :len(seq)]


def _engine(params=PARAMS, **kwargs):
    defaults = dict(max_concurrent_decodes=4, max_prefill_length=32, max_cache_length=64, steps_per_call=3,
                    stop_token_ids=[])
    defaults.update(kwargs)
    return AgentEngine(CONFIG, params, TOKENIZER, **defaults)


def _greedy_reference(prompt, n, params=PARAMS):
    seq, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = forward_rows(params, seq)[-1]
        token = int(jnp.argmax(logits))
        out.append(token)
        lps.append(float(jax.nn.log_softmax(logits)[token]))
        seq.append(token)
    return out, lps


PROMPTS = ["Q: 1+2=?", "a", "hello world, a longer prompt!", "<|im_start|>user\nQ: 17*23+5=?<|im_end|>",
           "xyz", "Q: 9*9=?", "0123456789", "tool"]


def test_greedy_decoding_matches_full_forward_argmax_across_slots():
    with LocalSampler(_engine()) as sampler:  # 8 requests through 4 slots: slots are reused
        completions = sampler.generate_many([TOKENIZER.encode(p) for p in PROMPTS],
                                            SamplingParams(temperature=0.0, max_tokens=9))
    for prompt, completion in zip(PROMPTS, completions):
        expected, expected_lps = _greedy_reference(TOKENIZER.encode(prompt), 9)
        assert list(completion.token_ids) == expected, prompt
        np.testing.assert_allclose(completion.logprobs, expected_lps, atol=1e-5)
        assert completion.finish_reason == "length" and set(completion.versions) == {0}


def test_sampled_logprobs_equal_learner_recomputation_with_temperature():
    temperature = 0.7
    with LocalSampler(_engine(seed=3)) as sampler:
        prompts = [TOKENIZER.encode(p) for p in PROMPTS[:5]]
        completions = sampler.generate_many(prompts, SamplingParams(temperature=temperature, max_tokens=12))
    for prompt, completion in zip(prompts, completions):
        ids = list(prompt) + list(completion.token_ids)
        logits = forward_rows(PARAMS, ids)[len(prompt) - 1:-1]
        learner = models.token_logprobs(logits / temperature, jnp.asarray(completion.token_ids))
        np.testing.assert_allclose(completion.logprobs, learner, atol=1e-5)
    # Sampling at temperature 0.7 is not greedy: some completion differs from argmax decoding.
    assert any(list(c.token_ids) != _greedy_reference(p, 12)[0] for p, c in zip(prompts, completions))


def test_stop_token_is_kept_with_its_logprob():
    prompt = TOKENIZER.encode("Q: 1+2=?")
    expected, expected_lps = _greedy_reference(prompt, 3)
    with LocalSampler(_engine(stop_token_ids=[expected[2]])) as sampler:
        completion = sampler.generate_many([prompt], SamplingParams(temperature=0.0, max_tokens=20))[0]
    stop_at = expected.index(expected[2])
    assert list(completion.token_ids) == expected[:stop_at + 1]
    assert completion.finish_reason == "stop"
    np.testing.assert_allclose(completion.logprobs, expected_lps[:stop_at + 1], atol=1e-5)


def test_context_limit_and_prompt_rejection():
    with LocalSampler(_engine(max_prefill_length=16, max_cache_length=20)) as sampler:
        prompt = TOKENIZER.encode("0123456789abcdef")  # 16 tokens, 4 slots of cache left
        completion = sampler.generate_many([prompt], SamplingParams(temperature=0.0, max_tokens=50))[0]
        assert completion.finish_reason == "context_limit" and len(completion.token_ids) == 5
        assert list(completion.token_ids) == _greedy_reference(prompt, 5)[0]
        with pytest.raises(PromptTooLongError, match="17 tokens exceeds max_prefill_length=16"):
            sampler.submit(TOKENIZER.encode("0123456789abcdefg"))
        with pytest.raises(ValueError, match="prompt ids must lie in"):
            sampler.submit([CONFIG.vocab_size + 3])


def test_a_cancelled_request_never_stops_the_sampler():
    """Cancelling the asyncio task that awaits `generate` (a timeout, an episode closed at the end of
    a run) leaves the sampler serving: a request already decoding runs to its end unseen, one still
    queued is dropped unrun (counted), and later requests complete. (The decoding one's result, set
    on a future its caller had cancelled, used to raise in the sampler's thread and end it: every
    later request waited forever.)"""
    engine = _engine(max_concurrent_decodes=1)  # one slot: a second request waits in the queue
    entered, release = threading.Event(), threading.Event()
    real_generate = engine.generate

    def held_generate(*args, **kwargs):  # the first decode call waits until both are cancelled
        entered.set()
        release.wait(30)
        return real_generate(*args, **kwargs)

    engine.generate = held_generate
    prompt = TOKENIZER.encode("Q: 1+2=?")

    async def scenario(sampler):
        decoding_one = asyncio.ensure_future(sampler.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20)))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        queued_one = asyncio.ensure_future(sampler.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20)))
        await asyncio.sleep(0.05)  # submitted
        for task in (decoding_one, queued_one):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        release.set()
        return await asyncio.wait_for(sampler.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5)), 60)

    with LocalSampler(engine) as sampler:
        completion = asyncio.run(scenario(sampler))
        assert list(completion.token_ids) == _greedy_reference(prompt, 5)[0]
        assert sampler.stats["cancelled"] == 1 and sampler.stats["requests"] == 2  # the decoding one ran out
        assert sampler.is_alive()


def test_result_lists_read_every_slot_as_its_row_does():
    """`decode_result_lists` (all slots at once, Python lists) gives each slot's tokens, valid flags,
    length, log-probs (bit-exact float32) and versions as `decode_result_row` does."""
    engine = _engine(max_concurrent_decodes=4, steps_per_call=3)
    prompts = [np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS[:3]]
    samplings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    state = engine.prefill_insert_many(prompts, samplings, engine.init_decode_state(), [0, 1, 3])
    engine.update_weights(PARAMS, 5)
    _, result = engine.generate(None, state)
    data = np.asarray(result.data)
    columns = decode_result_lists(data, 3)
    assert sorted(columns) == ["length", "logprobs", "tokens", "valid", "versions"]
    for slot in range(4):
        row = decode_result_row(data, slot, 3)
        assert columns["tokens"][slot] == row["tokens"].tolist()
        assert columns["valid"][slot] == row["valid"].astype(int).tolist()
        assert columns["length"][slot] == row["length"]
        assert columns["versions"][slot] == row["versions"].tolist()
        np.testing.assert_array_equal(np.asarray(columns["logprobs"][slot], np.float32), row["logprobs"])
    assert columns["valid"][2] == [0, 0, 0] and all(columns["valid"][0])  # slot 2 is empty
    assert set(columns["versions"][1][1:]) == {5}  # sampled after the update
    with pytest.raises(ValueError, match=r"expected decode results of 22 columns \(5 steps a call\), got 14"):
        decode_result_lists(data, 5)  # read as another decode shape's results


def test_weight_update_takes_effect_and_versions_are_recorded():
    params2 = jax.tree.map(lambda x: x * 1.5, PARAMS)
    engine = _engine(steps_per_call=2)
    prompt = TOKENIZER.encode("Q: 5*5=?")
    state = engine.init_decode_state()
    state = engine.insert(engine.prefill(padded_tokens=np.asarray(prompt), true_length=len(prompt),
                                         sampling=SamplingParams(temperature=0.0)), state, 0)
    state, first = engine.generate(None, state)
    engine.update_weights(params2, 7)
    state, second = engine.generate(None, state)
    rows = [decode_result_row(np.asarray(r.data), 0, 2) for r in (first, second)]
    tokens = [int(t) for r in rows for t in r["tokens"]]
    versions = [int(v) for r in rows for v in r["versions"]]
    # Emission lags sampling by one step: the first token of the second call was sampled before the update.
    assert versions == [0, 0, 0, 7]
    old, _ = _greedy_reference(prompt, 3)
    assert tokens[:3] == old
    # In-flight requests keep their KV cache: t3 comes from the new weights run on t2, attending to
    # the prompt, t0 and t1 as the old weights encoded them.
    cache = models.init_cache(CONFIG, 1, 64)
    _, cache = models.prefill(CONFIG, PARAMS, jnp.asarray([list(prompt) + tokens[:2]]), cache)
    logits, _ = models.decode_step(CONFIG, params2, jnp.asarray([tokens[2]]), jnp.asarray([len(prompt) + 2]), cache)
    assert tokens[3] == int(jnp.argmax(logits[0]))


def test_tied_embeddings_decode_through_a_materialised_kernel_that_follows_weight_updates():
    """With tied embeddings the engine decodes against an [H, V] copy of the embedding's transpose
    made at each weight update (models.extend): greedy tokens and log-probs must be the full
    forward's, before and after an update (a stale copy would decode with the old projection)."""
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    params = models.init_params(tied, jax.random.PRNGKey(4))
    forward = jax.jit(models.forward, static_argnums=0)

    def reference(params, prompt, n):
        seq, lps = list(prompt), []
        for _ in range(n):
            padded = np.zeros((1, PAD_TO), np.int32)  # one compiled length (see forward_rows)
            padded[0, :len(seq)] = seq
            logits = forward(tied, params, jnp.asarray(padded))[0, len(seq) - 1]
            seq.append(int(jnp.argmax(logits)))
            lps.append(float(jax.nn.log_softmax(logits)[seq[-1]]))
        return seq[len(prompt):], lps

    engine = AgentEngine(tied, params, TOKENIZER, max_concurrent_decodes=2, max_prefill_length=32,
                         max_cache_length=64, steps_per_call=3, stop_token_ids=[])
    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=7)
    # The embedding alone changes: only the output projection (and the input embedding) differ.
    params2 = {**params, "embed": {"embedding": params["embed"]["embedding"][::-1] * 1.3}}
    with LocalSampler(engine) as sampler:
        for version, p in ((0, params), (1, params2)):
            if version:
                sampler.update_weights(params2, version)
            for prompt, completion in zip(prompts, sampler.generate_many(prompts, greedy)):
                tokens, lps = reference(p, prompt, 7)
                assert list(completion.token_ids) == tokens, (version, prompt)
                np.testing.assert_allclose(completion.logprobs, lps, atol=1e-5)
                assert set(completion.versions) == {version}


def test_concurrent_async_requests_do_not_cross_talk():
    import asyncio

    async def run(sampler):
        prompts = [TOKENIZER.encode(p) for p in PROMPTS * 3]
        return prompts, await asyncio.gather(*(sampler.generate(p, SamplingParams(temperature=0.0, max_tokens=6))
                                               for p in prompts))

    with LocalSampler(_engine(max_concurrent_decodes=5)) as sampler:
        prompts, completions = asyncio.run(run(sampler))
    cache = {}
    for prompt, completion in zip(prompts, completions):
        key = tuple(prompt)
        cache.setdefault(key, _greedy_reference(prompt, 6)[0])
        assert list(completion.token_ids) == cache[key]


def test_filters_restrict_the_support():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    top2 = decoding.filter_logits(logits, jnp.asarray([2, 0]), jnp.asarray([1.0, 1.0]))
    assert np.isfinite(np.asarray(top2[0])).tolist() == [False, True, False, True]
    assert np.isfinite(np.asarray(top2[1])).all()
    nucleus = decoding.filter_logits(logits, jnp.asarray([0, 0]), jnp.asarray([0.5, 0.5]))
    assert np.isfinite(np.asarray(nucleus)).sum(-1).tolist() == [1, 1]
    tokens, lps = decoding.sample_tokens(logits, jax.random.PRNGKey(0), jnp.asarray([1.0, 1.0]),
                                         jnp.asarray([1, 1]), jnp.asarray([1.0, 1.0]))
    assert tokens.tolist() == [1, 0] and np.allclose(lps, 0.0)  # top-1: a point mass


def test_inverse_cdf_draws_follow_the_weights_and_never_pick_zero_weight_tokens():
    """`draw_from_weights` against the distribution it claims (V = 300: chunks of 128 plus padding),
    with 30% of the tokens at weight 0 (filtered out)."""
    rng = np.random.RandomState(0)
    v, n = 300, 40_000
    logits = (rng.randn(v) * 2).astype(np.float32)
    logits[rng.rand(v) < 0.3] = -np.inf
    weights = np.exp(logits - logits[np.isfinite(logits)].max())
    u = jax.random.uniform(jax.random.PRNGKey(1), (n,))
    tokens = np.asarray(jax.jit(decoding.draw_from_weights)(jnp.broadcast_to(jnp.asarray(weights), (n, v)), u))
    freq = np.bincount(tokens, minlength=v) / n
    p = weights / weights.sum()
    assert freq[p == 0].sum() == 0
    z = np.abs(freq - p)[p > 0] / np.sqrt(p * (1 - p) / n)[p > 0]
    assert z.max() < 5.0, z.max()  # 210 tokens: |z| > 5 has probability ~1e-4 for a correct sampler
    # The same u draws the same token as a sequential running sum over the whole row.
    cdf = np.cumsum(p)
    np.testing.assert_array_equal(tokens[:2000], np.minimum(np.searchsorted(cdf, np.asarray(u[:2000]), "right"), v - 1))


def test_inverse_cdf_edges():
    w = jnp.asarray([[0.0, 1.0, 0.0, 2.0, 0.0]])
    draw = lambda w, u: int(decoding.draw_from_weights(w, jnp.asarray([u], jnp.float32))[0])
    assert draw(w, 0.0) == 1 and draw(w, 0.33) == 1 and draw(w, 0.34) == 3
    assert draw(w, np.nextafter(np.float32(1), np.float32(0))) == 3  # never the zero-weight tail
    one_hot = np.zeros((1, 1000), np.float32)
    one_hot[0, 999] = 1.0  # the only positive weight in the last (padded) chunk
    assert draw(jnp.asarray(one_hot), 0.0) == 999 and draw(jnp.asarray(one_hot), 0.999) == 999
    boundary = np.zeros((1, 256), np.float32)
    boundary[0, [127, 128]] = 1.0  # either side of a chunk boundary
    assert draw(jnp.asarray(boundary), 0.49) == 127 and draw(jnp.asarray(boundary), 0.51) == 128


def test_greedy_tokens_are_the_first_maximum_and_nan_rows_give_token_zero():
    rng = np.random.RandomState(0)
    logits = rng.randint(0, 4, (64, 50)).astype(np.float32)  # many ties for the maximum
    logits[3] = -np.inf
    logits[3, 7] = 2.0
    zeros = np.zeros(64, np.float32)
    tokens, lps = decoding.sample_tokens(jnp.asarray(logits), jax.random.PRNGKey(0), jnp.asarray(zeros),
                                         jnp.zeros(64, jnp.int32), jnp.ones(64, jnp.float32))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    np.testing.assert_allclose(lps, jax.nn.log_softmax(jnp.asarray(logits))[np.arange(64), np.argmax(logits, -1)],
                               atol=1e-6)
    nan_row = np.where(np.arange(50) == 5, np.nan, 1.0).astype(np.float32)[None]
    token, lp = decoding.sample_tokens(jnp.asarray(nan_row), jax.random.PRNGKey(0), jnp.zeros(1), jnp.zeros(1, jnp.int32),
                                       jnp.ones(1))
    assert int(token[0]) == 0 and np.isnan(lp[0])  # a valid id; the NaN log-prob is rejected downstream


@pytest.mark.parametrize("options", sorted(engine_lib.DECODE_OPTION_SETS))  # any set a host may choose
@pytest.mark.parametrize("slots, requests", [(4, 3), (32, 20)])  # the small-batch and the general program
def test_nan_weights_decode_valid_ids_with_nan_logprobs(slots, requests, options):
    """The decode programs' compiler options (CPU) may let a NaN row's max skip the NaN: whatever id
    it picks must be a real one, and every log-prob must still be NaN for the replay buffer to reject."""
    nan_params = jax.tree.map(lambda p: p * jnp.nan, PARAMS)
    engine = _engine(params=nan_params, max_concurrent_decodes=slots,
                     decode_compiler_options=engine_lib.DECODE_OPTION_SETS[options])
    assert (engine.decode_rows(requests) <= engine_lib.SMALL_DECODE_ROWS) == (slots == 4)
    with LocalSampler(engine) as sampler:
        completions = sampler.generate_many([TOKENIZER.encode(PROMPTS[i % len(PROMPTS)]) for i in range(requests)],
                                            SamplingParams(temperature=0.0, max_tokens=5))
    for completion in completions:
        assert len(completion.token_ids) == 5
        assert all(0 <= t < CONFIG.vocab_size for t in completion.token_ids)
        assert np.isnan(completion.logprobs).all()


def test_decode_compiler_options_this_xla_does_not_know_are_left_out(caplog):
    known = engine_lib.cpu_compiler_options(engine_lib.CPU_SMALL_DECODE_COMPILER_OPTIONS)
    assert known == engine_lib.CPU_SMALL_DECODE_COMPILER_OPTIONS  # this jaxlib knows all of them
    mixed = {"xla_cpu_enable_fast_min_max": True, "xla_cpu_no_such_option_for_this_test": True}
    assert engine_lib.cpu_compiler_options(mixed) == {"xla_cpu_enable_fast_min_max": True}
    assert "xla_cpu_no_such_option_for_this_test" in caplog.text
    assert engine_lib.cpu_compiler_options({"xla_cpu_no_such_option_for_this_test": 1}) is None


def test_decode_compiler_options_change_speed_not_tokens():
    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:3]]
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    runs = []
    for options in (None, {}, engine_lib.CPU_SMALL_DECODE_COMPILER_OPTIONS,
                    (engine_lib.CPU_SMALL_DECODE_COMPILER_OPTIONS, {})):  # (above 16 rows, at most)
        with LocalSampler(_engine(decode_compiler_options=options)) as sampler:
            runs.append(sampler.generate_many(prompts, sampling))
    for completions in runs[1:]:
        for got, want in zip(completions, runs[0]):
            assert got.token_ids == want.token_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="power of two"):
        _engine(max_prefill_length=48)


def _by_position(cache):
    """Every layer's keys and values as [B, K, S, D] numpy arrays (keys are stored [B, K, D, S])."""
    return [np.swapaxes(np.asarray(k), -1, -2) for k in cache.k] + [np.asarray(v) for v in cache.v]


def test_batched_prefill_insert_equals_one_by_one():
    prompts = [np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS[:3]]
    samplings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5)]
    slots = [2, 0, 3]
    one = _engine(seed=7)
    state = one.init_decode_state()
    for prompt, sampling, slot in zip(prompts, samplings, slots):
        state = one.insert(one.prefill(padded_tokens=prompt, true_length=len(prompt), sampling=sampling), state, slot)
    many = _engine(seed=7)
    batched = many.prefill_insert_many(prompts, samplings, many.init_decode_state(), slots)
    for field in ("next_token", "next_logprob", "position", "active", "temperature", "top_k", "top_p"):
        np.testing.assert_allclose(np.asarray(getattr(batched, field)), np.asarray(getattr(state, field)),
                                   atol=1e-5, err_msg=field)
    for a, b in zip(_by_position(batched.cache), _by_position(state.cache)):
        for prompt, slot in zip(prompts, slots):  # beyond a prompt, slots hold masked padding
            np.testing.assert_allclose(a[slot, :, :len(prompt)], b[slot, :, :len(prompt)], atol=1e-5)
    assert not bool(batched.active[1])  # untouched slot (and the dropped padding row) stay free


def test_a_fresh_decode_state_and_a_returned_one_share_one_compiled_program():
    # A fresh state placed differently from the programs' outputs compiled every program twice:
    # once for its first call, again for the state it had returned (the host tuning paid ~1.3 s a
    # program for it).
    engine = _engine(steps_per_call=5)
    prompt = np.asarray(TOKENIZER.encode("Q: 1+2=?"), np.int32)
    programs = lambda: (engine._generate_small_fn._cache_size(), engine._prefill_insert_fn._cache_size(),
                        engine._sample_insert_fn._cache_size())
    state = engine.prefill_insert_many([prompt], [SamplingParams(temperature=0.0)], engine.init_decode_state(), [0])
    state, _ = engine.generate(None, state)
    fresh, _ = engine.generate(None, engine.init_decode_state())  # a fresh state straight into decoding
    before = programs()
    state = engine.prefill_insert_many([prompt], [SamplingParams(temperature=0.0)], state, [1])
    state, _ = engine.generate(None, state)
    fresh, _ = engine.generate(None, fresh)
    assert programs() == before


def test_identical_prompts_are_prefilled_once_and_sampled_with_their_own_streams():
    """A group's G episodes share their first prompt: one forward pass serves all G rows, and each
    row equals a one-by-one prefill + insert (own RNG stream, same keys/values)."""
    a, b = (np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS[:2])
    prompts = [a, b, a, a, b, a, b, b, a]
    samplings = [SamplingParams(temperature=1.0)] * 8 + [SamplingParams(temperature=0.0)]
    slots = [4, 0, 1, 2, 3, 8, 7, 5, 6]
    one = _engine(seed=3, max_concurrent_decodes=9)
    state = one.init_decode_state()
    for prompt, sampling, slot in zip(prompts, samplings, slots):
        state = one.insert(one.prefill(padded_tokens=prompt, true_length=len(prompt), sampling=sampling), state, slot)
    many = _engine(seed=3, max_concurrent_decodes=9)
    calls = []
    real_fn = many._prefill_insert_fn
    many._prefill_insert_fn = lambda *args: calls.append(args[2].shape) or real_fn(*args)
    batched = many.prefill_insert_many(prompts, samplings, many.init_decode_state(), slots)
    assert calls == [(2, 16)]  # 9 requests (16 rows padded), 2 distinct prompts of <= 16 tokens: 2 x 16 run
    for field in ("next_token", "next_logprob", "position", "active", "temperature"):
        np.testing.assert_allclose(np.asarray(getattr(batched, field)), np.asarray(getattr(state, field)),
                                   atol=1e-5, err_msg=field)
    for x, y in zip(_by_position(batched.cache), _by_position(state.cache)):
        for prompt, slot in zip(prompts, slots):
            np.testing.assert_allclose(x[slot, :, :len(prompt)], y[slot, :, :len(prompt)], atol=1e-5)


def test_a_batched_prefill_runs_its_distinct_prompts_in_two_rows_a_quarter_or_all():
    """A group's episodes share one prompt: the forward pass takes the distinct prompts in 2 rows
    when they fit, else in a quarter of the call's padded rows (at least 8), else in all of them."""
    from jaxrl_agent.sampling.engine import unique_prefill_rows
    assert [unique_prefill_rows(u, 8) for u in (1, 2, 3, 4, 5, 8)] == [2, 2, 8, 8, 8, 8]
    assert [unique_prefill_rows(u, 16) for u in (2, 3, 8, 9, 16)] == [2, 8, 8, 16, 16]
    assert [unique_prefill_rows(u, 64) for u in (1, 3, 16, 17, 64)] == [2, 16, 16, 64, 64]
    for rows in (8, 16, 32, 64):
        assert {unique_prefill_rows(u, rows) for u in range(1, rows + 1)} == {2, max(8, rows // 4), rows}


def test_batched_prefills_and_extends_of_a_row_count_share_one_sampling_program():
    """Sampling the first token is a program of its own, compiled once per padded row count and
    shared by prefills and extends of every length (inside each of their programs it was half of a
    ~1 s compile). What it samples is checked against one-by-one prefills and full prefills above
    and in test_prefix_cache."""
    engine = _engine(max_concurrent_decodes=8, max_prefill_length=64, max_cache_length=128, prefix_cache_entries=4)
    sample_programs = engine_lib._SAMPLE_INSERT_FN._cache_size
    rows_sampled = []
    engine._sample_insert_fn = lambda key, state, last, *rest: (
        rows_sampled.append(last.shape) or engine_lib._SAMPLE_INSERT_FN(key, state, last, *rest))
    before = sample_programs()
    greedy = SamplingParams(temperature=0.0)
    short = np.asarray(TOKENIZER.encode("Q: 1+2=?"), np.int32)
    long = np.asarray(TOKENIZER.encode(PROMPTS[2]), np.int32)
    state = engine.prefill_insert_many([short, short], [greedy] * 2, engine.init_decode_state(), [0, 1])
    added = sample_programs() - before  # 0 when an earlier test compiled this shape already
    assert added <= 1
    state = engine.prefill_insert_many([long], [greedy], state, [2])  # another token bucket
    state = engine.save_prefixes(state, [0], [0], length=len(short) + 1)
    state = engine.extend_insert_many([0], [len(short)], [long[:20]], [greedy], state, [3])
    assert rows_sampled == [(8, CONFIG.vocab_size)] * 3
    assert sample_programs() - before == added
    assert bool(state.active[3]) and int(state.position[3]) == len(short) + 20


def test_per_row_keys_draw_what_each_row_would_draw_alone():
    logits = jax.random.normal(jax.random.PRNGKey(5), (5, 11)) * 3.0
    keys = jax.vmap(lambda c: jax.random.fold_in(jax.random.PRNGKey(9), c))(jnp.arange(5))
    temperature = jnp.asarray([1.0, 0.7, 1.0, 0.0, 2.0])
    top_k, top_p = jnp.zeros((5,), jnp.int32), jnp.ones((5,))
    tokens, logprobs = decoding.sample_tokens(logits, keys, temperature, top_k, top_p)
    for b in range(5):
        alone, alone_lp = decoding.sample_tokens(logits[b:b + 1], keys[b], temperature[b:b + 1], top_k[b:b + 1],
                                                 top_p[b:b + 1])
        assert int(tokens[b]) == int(alone[0])
        np.testing.assert_allclose(logprobs[b], alone_lp[0], rtol=1e-6)
    # Different keys per row, not one key for all: identical rows can draw different tokens.
    same = jnp.broadcast_to(logits[0], (64, 11))
    many = jax.vmap(lambda c: jax.random.fold_in(jax.random.PRNGKey(9), c))(jnp.arange(64))
    drawn, _ = decoding.sample_tokens(same, many, jnp.ones((64,)), jnp.zeros((64,), jnp.int32), jnp.ones((64,)))
    assert len(set(np.asarray(drawn).tolist())) > 1


def test_generate_decodes_only_the_slots_below_the_highest_live_one():
    """`live_slots`: the first decode_rows(live) slots are decoded exactly as a full call decodes
    them; every other slot (cache, position, pending token) is left as it was."""
    engine = _engine(max_concurrent_decodes=32)
    assert [engine.decode_rows(n) for n in (None, 1, 8, 9, 16, 17, 33, 40)] == [32, 8, 8, 32, 32, 32, 32, 32]
    assert [_engine(max_concurrent_decodes=64).decode_rows(n) for n in (1, 8, 9, 16, 17, 64)] == [8, 8, 16, 16, 64, 64]
    prompts = [np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS[:4]]
    slots = [0, 2, 1, 20]  # slot 20 holds a request the compact call must not touch
    greedy = [SamplingParams(temperature=0.0)] * 4

    def fresh_state():
        return engine.prefill_insert_many(prompts, greedy, engine.init_decode_state(), slots)

    before = jax.device_get(fresh_state())
    full_state, full = engine.generate(None, fresh_state())
    compact_state, compact = engine.generate(None, fresh_state(), live_slots=3)
    full, compact = np.asarray(full.data), np.asarray(compact.data)
    for slot in range(8):  # tokens, valid flags, lengths, versions exactly; log-probs to float rounding
        got, want = decode_result_row(compact, slot, 3), decode_result_row(full, slot, 3)
        for key in ("tokens", "valid", "length", "versions"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-6)
    assert not compact[8:].any()  # rows not decoded: no valid tokens
    assert full[20, 3:6].all()  # while the full call did decode slot 20
    for name in ("position", "next_token", "generated", "active"):
        got = np.asarray(getattr(compact_state, name))
        np.testing.assert_array_equal(got[:8], np.asarray(getattr(full_state, name))[:8], err_msg=name)
        np.testing.assert_array_equal(got[8:], np.asarray(getattr(before, name))[8:], err_msg=name)
    for got, want, old in zip(compact_state.cache.k + compact_state.cache.v, full_state.cache.k + full_state.cache.v,
                              before.cache.k + before.cache.v):
        np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got)[8:], np.asarray(old)[8:])


def test_requests_of_different_lengths_through_many_slots_decode_exactly():
    """The sampler packs live requests into the lowest slots and decodes only those: as requests of
    different lengths finish, calls shrink, and every request still equals argmax decoding."""
    engine = _engine(max_concurrent_decodes=64)
    calls = []
    real = engine.generate
    engine.generate = lambda params, state, **kw: calls.append(engine.decode_rows(kw.get("live_slots"))) or real(
        params, state, **kw)
    requests = [(PROMPTS[i % len(PROMPTS)], 2 + (5 * i) % 11) for i in range(12)]
    with LocalSampler(engine) as sampler:
        futures = [sampler.submit(TOKENIZER.encode(p), SamplingParams(temperature=0.0, max_tokens=n))
                   for p, n in requests]
        completions = [f.result() for f in futures]
        stats = dict(sampler.stats)
    # The sampler's occupancy stats: a request is live in every call until the one that ends it.
    steps = engine.steps_per_call
    assert stats["generate_calls"] == len(calls) and stats["decoded_slots"] == sum(calls)
    assert stats["live_slots"] == sum(-(-len(c.token_ids) // steps) for c in completions)
    assert stats["decode_seconds"] > 0 and stats["admit_seconds"] > 0
    for (prompt, n), completion in zip(requests, completions):
        expected, expected_lps = _greedy_reference(TOKENIZER.encode(prompt), n)
        assert list(completion.token_ids) == expected, prompt
        np.testing.assert_allclose(completion.logprobs, expected_lps, atol=1e-5)
    assert max(calls) == 16 and min(calls) == 8  # 12 requests never need more than 16 of the 64 slots


def test_decode_windows_attend_over_the_live_positions_only_and_decode_exactly():
    """`live_length`: a call attends over the first S/4 or S/2 cache positions when every live
    request's positions fit; requests that grow past a window move to the next one, and every
    request still equals argmax decoding of the full sequence; a request that fills the whole
    cache still ends as context_limit."""
    engine = _engine(max_concurrent_decodes=8, max_prefill_length=128, max_cache_length=256, steps_per_call=3)
    assert [engine.decode_window(n) for n in (None, 0, 61, 62, 125, 126, 200)] == [256, 64, 64, 128, 128, 256, 256]
    assert _engine(max_cache_length=128).decode_window(0) == 64  # S/4 = 32 is below MIN_DECODE_WINDOW
    assert _engine(max_cache_length=64).decode_window(0) == 64  # so are S/4 and S/2: the whole cache
    windows = []
    real = engine.generate
    engine.generate = lambda params, state, **kw: windows.append(engine.decode_window(kw.get("live_length"))) or real(
        params, state, **kw)
    forward = jax.jit(models.forward, static_argnums=0)

    def reference(prompt, n):
        seq, out, lps = list(prompt), [], []
        for _ in range(n):
            padded = np.zeros((1, 256), np.int32)
            padded[0, :len(seq)] = seq
            logits = forward(CONFIG, PARAMS, jnp.asarray(padded))[0, len(seq) - 1]
            out.append(int(jnp.argmax(logits)))
            lps.append(float(jax.nn.log_softmax(logits)[out[-1]]))
            seq.append(out[-1])
        return out, lps

    rng = np.random.RandomState(3)
    requests = [(rng.randint(3, TOKENIZER.vocab_size, length).tolist(), n)
                for length, n in ((10, 70), (40, 100), (100, 50), (20, 12))]
    with LocalSampler(engine) as sampler:  # short ones alone first (window 64 -> 128), then all together
        completions = [sampler.generate_many([p], SamplingParams(temperature=0.0, max_tokens=n))[0]
                       for p, n in requests[:1]]
        completions += sampler.generate_many([p for p, _ in requests[1:]], SamplingParams(temperature=0.0, max_tokens=100))
        full = sampler.generate_many([rng.randint(3, TOKENIZER.vocab_size, 120).tolist()],
                                     SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert {64, 128, 256} <= set(windows)  # all three windows were used, the smallest first
    for (prompt, _), completion in zip(requests, completions):
        n = len(completion.token_ids)
        expected, expected_lps = reference(prompt, n)
        assert list(completion.token_ids) == expected
        np.testing.assert_allclose(completion.logprobs, expected_lps, atol=1e-5)
    assert full.finish_reason == "context_limit" and len(full.token_ids) == 256 - 120 + 1  # the last one uncached


def test_a_windowed_call_leaves_the_whole_cache_as_a_full_call_does():
    """A call over the first rows and window positions writes back only the strip of positions its
    steps wrote (each row from its own position): afterwards every cache position of the rows it
    decoded equals the full call's — rows whose strips start 55 positions apart, empty slots and a
    stopped row (which rewrites its position) — and the rows it did not decode are untouched."""
    engine = _engine(max_concurrent_decodes=32, max_prefill_length=128, max_cache_length=256, steps_per_call=5)
    rng = np.random.RandomState(7)
    prompts = [rng.randint(3, TOKENIZER.vocab_size, n).astype(np.int32) for n in (5, 50, 23, 60)]
    greedy = [SamplingParams(temperature=0.0)] * 4

    def fresh_state():
        state = engine.prefill_insert_many(prompts, greedy, engine.init_decode_state(), [0, 1, 2, 3])
        # Slot 3 stopped at position 60: a stopped row still writes at its clamped position.
        return engine.free_slots(state, [3])

    window = engine.decode_window(60)
    rows = engine.decode_rows(4)
    assert (rows, window) == (8, 128)  # a compact, windowed call: the strip write-back path
    before = jax.device_get(fresh_state())
    full_state, full = engine.generate(None, fresh_state())
    part_state, part = engine.generate(None, fresh_state(), live_slots=4, live_length=60)
    np.testing.assert_array_equal(np.asarray(part.data)[:4, :5], np.asarray(full.data)[:4, :5])  # tokens
    np.testing.assert_array_equal(np.asarray(part_state.rng), np.asarray(full_state.rng))
    for name in ("next_token", "next_logprob", "next_version", "position", "generated", "active"):
        got, want = np.asarray(getattr(part_state, name)), np.asarray(getattr(full_state, name))
        np.testing.assert_allclose(got[:rows], want[:rows], atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(got[rows:], np.asarray(getattr(before, name))[rows:], err_msg=name)
    # Every position of the decoded rows, the stopped row 3 included (both calls rewrite its
    # position 60), as the full call left them; the other rows as they were.
    for got, want, old in zip(part_state.cache.k + part_state.cache.v, full_state.cache.k + full_state.cache.v,
                              before.cache.k + before.cache.v):
        np.testing.assert_allclose(np.asarray(got)[:rows], np.asarray(want)[:rows], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got)[rows:], np.asarray(old)[rows:])


def test_weight_messages_reassemble_bit_exactly_and_bad_streams_are_named():
    """`weight_messages` -> `WeightAssembly` is the identity on a parameter tree (float32 and
    bfloat16, empty arrays, any chunk size); streams that are short, mixed or corrupt are refused."""
    import jax.numpy as jnp

    from jaxrl_agent.sampling.server import WeightAssembly, weight_messages

    rng = np.random.RandomState(0)
    tree = {"a": {"kernel": rng.randn(7, 5).astype(np.float32), "bias": np.zeros((0,), np.float32)},
            "b": jnp.asarray(rng.randn(33), jnp.bfloat16), "c": np.arange(10, dtype=np.int32)}
    for chunk in (1, 3, 64, 1 << 20):
        assembly = WeightAssembly()
        for message in weight_messages(tree, 9, chunk):
            assembly.add(message)
        version, back = assembly.result()
        assert version == 9
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
            assert np.asarray(x).dtype == y.dtype and np.asarray(x).shape == y.shape
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), y.view(np.uint8))
    messages = list(weight_messages(tree, 9, 16))
    for broken, match in ((messages[:-1], "incomplete"), (messages + messages[-1:], "incomplete or twice"),
                          (messages[:3] + list(weight_messages(tree, 10, 16))[3:], "version 10"), ([], "empty"),
                          ([b"\x01"], "no header"), ([b"\x04\x00\x00\x00{}{}"], "header")):
        assembly = WeightAssembly()
        with pytest.raises(ValueError, match=match):
            for message in broken:
                assembly.add(message)
            assembly.result()


def test_a_call_runs_on_until_a_request_stops_or_its_bound():
    """With max_steps_per_call, a call runs steps_per_call steps, then on while no request active at
    its start has stopped, up to its bound: it ends with the step that emits a stop token (the
    result's "ran" column), its rows' tokens those of argmax decoding; `max_steps` bounds it within
    [steps_per_call, max_steps_per_call]; a cache window it would outgrow shortens it."""
    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:2]]
    refs = [_greedy_reference(p, 14)[0] for p in prompts]
    k = next(k for k in range(4, 10) if refs[0][k] not in refs[0][:k] and refs[0][k] not in refs[1][:12])
    greedy = [SamplingParams(temperature=0.0)] * 2

    def one_call(engine, **kwargs):
        state = engine.prefill_insert_many([np.asarray(p, np.int32) for p in prompts], greedy,
                                           engine.init_decode_state(), [0, 1])
        data = np.asarray(engine.generate(None, state, **kwargs)[1].data)
        assert data.shape[1] == 4 * engine.max_steps_per_call + 2
        return data, decode_result_lists(data, engine.max_steps_per_call)

    stopping = _engine(steps_per_call=3, max_steps_per_call=12, stop_token_ids=[refs[0][k]])
    data, columns = one_call(stopping)
    assert data[0, -1] == k + 1  # ran through the step that emitted slot 0's stop token, no further
    assert columns["tokens"][0] == refs[0][:k + 1] and columns["tokens"][1] == refs[1][:k + 1]
    assert columns["valid"][0] == [1] * (k + 1)
    running = _engine(steps_per_call=3, max_steps_per_call=12)
    for bound, ran in ((None, 12), (100, 12), (5, 5), (1, 3)):
        data, columns = one_call(running, max_steps=bound)
        assert data[0, -1] == ran and columns["tokens"][1] == refs[1][:ran], bound
    fixed = _engine(steps_per_call=3)  # max_steps_per_call 0: every call runs steps_per_call steps
    assert fixed.max_steps_per_call == 3 and one_call(fixed, max_steps=12)[0][0, -1] == 3
    windowed = _engine(steps_per_call=3, max_steps_per_call=12, max_prefill_length=128, max_cache_length=256)
    # Windows of 64 / 128 positions (decode_window): a call never runs past its window's end.
    assert [windowed.call_steps(n) for n in (None, 50, 57, 60, 62)] == [12, 12, 7, 4, 12]
    assert windowed.call_steps(50, max_steps=6) == 6
    with pytest.raises(ValueError, match="max_steps_per_call must be 0 or >= steps_per_call=3, got 2"):
        _engine(steps_per_call=3, max_steps_per_call=2)


@pytest.mark.parametrize("max_steps", [0, 16])
def test_requests_that_stop_and_run_out_decode_exactly_with_calls_that_run_on(max_steps):
    """Requests of different prompt lengths, token limits and a stop token through a sampler whose
    calls run on until a request finishes (max_steps_per_call 16; 0 = fixed 3-step calls), in the
    64-position window of a 256-position cache (calls shortened at its end): every completion
    equals argmax decoding up to its stop token or limit, and running on takes fewer calls."""
    rng = np.random.RandomState(5)
    requests = [(rng.randint(3, TOKENIZER.vocab_size, length).tolist(), n)
                for length, n in ((5, 30), (20, 7), (30, 30), (12, 2), (25, 19), (8, 50))]  # within PAD_TO
    refs = [_greedy_reference(p, n)[0] for p, n in requests]
    stop = next(t for t in refs[2][3:] if all(t not in r[:10] for r in refs[:2] + refs[3:]))
    engine = _engine(max_concurrent_decodes=4, max_prefill_length=128, max_cache_length=256, steps_per_call=3,
                     max_steps_per_call=max_steps, stop_token_ids=[stop])
    with LocalSampler(engine) as sampler:
        futures = [sampler.submit(p, SamplingParams(temperature=0.0, max_tokens=n)) for p, n in requests]
        completions = [f.result() for f in futures]
        calls = sampler.stats["generate_calls"]
    for (prompt, n), ref, completion in zip(requests, refs, completions):
        end = ref.index(stop) + 1 if stop in ref else n
        assert list(completion.token_ids) == ref[:end]
        assert completion.finish_reason == ("stop" if stop in ref else "length")
        np.testing.assert_allclose(completion.logprobs, _greedy_reference(prompt, end)[1], atol=1e-5)
    assert completions[2].finish_reason == "stop"
    if max_steps:  # against what the same requests take in 3-step calls
        fixed_calls = _calls_of_fixed_steps(requests, stop)
        assert calls < fixed_calls * 0.6, (calls, fixed_calls)


def _calls_of_fixed_steps(requests, stop) -> int:
    engine = _engine(max_concurrent_decodes=4, max_prefill_length=128, max_cache_length=256, steps_per_call=3,
                     stop_token_ids=[stop])
    with LocalSampler(engine) as sampler:
        for f in [sampler.submit(p, SamplingParams(temperature=0.0, max_tokens=n)) for p, n in requests]:
            f.result()
        return sampler.stats["generate_calls"]


def test_admissions_padded_into_compiled_larger_shapes_sample_what_their_own_shapes_do():
    """sampler.shape_reuse_calls: a batched prefill or extend whose shape is not compiled runs in a
    compiled larger one (more rows, a longer token bucket); its rows' first tokens and log-probs,
    positions and cache contents are those of the call in its own shape."""
    from jaxrl_agent.shape_reuse import ShapeReuse

    kwargs = dict(max_concurrent_decodes=16, max_prefill_length=64, max_cache_length=128, prefix_cache_entries=8)
    own = _engine(**kwargs)
    reuse = {"prefill": ShapeReuse(64.0), "extend": ShapeReuse(64.0)}
    padded = _engine(**kwargs, shape_reuse=reuse)
    shapes = []
    padded._prefill_insert_fn = lambda p, s, unique, source, *rest: (
        shapes.append(("prefill", unique.shape, source.shape)) or
        engine_lib._admission_fns(CONFIG)[1](p, s, unique, source, *rest))
    padded._extend_insert_fn = lambda p, s, e, st, tokens, *rest, window: (
        shapes.append(("extend", tokens.shape, window)) or
        engine_lib._admission_fns(CONFIG)[2](p, s, e, st, tokens, *rest, window=window))
    sampled = SamplingParams(temperature=1.0)
    prompts = [np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS]
    states = []
    for engine in (own, padded):
        state = engine.init_decode_state()
        # 9 prompts of up to 29 tokens, 8 distinct: 16 rows, 8 of them run, a 32-token bucket.
        state = engine.prefill_insert_many(prompts + prompts[:1], [sampled] * 9, state, list(range(9)))
        # 2 requests of one 8-token prompt: 8 rows, 2 run, 16 tokens; held by the first shape.
        state = engine.prefill_insert_many([prompts[0]] * 2, [sampled] * 2, state, [9, 10])
        state = engine.save_prefixes(state, list(range(9)), list(range(8)) + [7], length=48)
        # Extends: 9 rows of up to 30 new tokens (16 rows, a 32-token bucket), then 1 row of 5 tokens.
        state = engine.extend_insert_many(list(range(8)) + [0], [len(p) for p in prompts + prompts[:1]],
                                          [p[:30] for p in prompts + prompts[:1]], [sampled] * 9, state,
                                          list(range(9)))
        state = engine.extend_insert_many([1], [1], [prompts[2][1:6]], [sampled], state, [11])
        states.append(jax.device_get(state))
    assert shapes == [("prefill", (8, 32), (16,))] * 2 + [("extend", (16, 32), 128)] * 2
    assert reuse["prefill"].padded_calls == 1 and reuse["extend"].padded_calls == 1
    want, got = states
    live = np.asarray(want.active)
    assert live[:12].all() and (np.asarray(got.active) == live).all()
    for name in ("next_token", "position", "next_version", "generated"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    np.testing.assert_allclose(got.next_logprob, want.next_logprob, atol=1e-5)
    # Keys [B, K, D, S] and values [B, K, S, D] up to each slot's position (past it a slot holds
    # its bucket's padding, never read: attention stops at the slot's own position).
    for slot, position in enumerate(np.asarray(want.position)[:12]):
        for got_k, want_k, got_v, want_v in zip(got.cache.k, want.cache.k, got.cache.v, want.cache.v):
            np.testing.assert_allclose(got_k[slot, ..., :position], want_k[slot, ..., :position], atol=1e-5)
            np.testing.assert_allclose(got_v[slot, :, :position], want_v[slot, :, :position], atol=1e-5)


def test_a_decode_call_padded_into_a_compiled_larger_shape_emits_what_its_own_shape_does():
    """sampler.decode_shape_reuse_calls: a `generate` call that wants few rows and a short cache
    window runs in a compiled call of all the rows and the whole cache; its tokens, valid flags,
    lengths and versions are exactly the compact call's, its log-probs to float rounding."""
    from jaxrl_agent.shape_reuse import ShapeReuse

    reuse = {"decode": ShapeReuse(256.0)}
    own, padded = _engine(max_concurrent_decodes=32), _engine(max_concurrent_decodes=32, shape_reuse=reuse)
    prompts = [np.asarray(TOKENIZER.encode(p), np.int32) for p in PROMPTS[:3]]
    sampled = [SamplingParams(temperature=1.0)] * 3
    results = []
    for engine in (own, padded):
        state = engine.prefill_insert_many(prompts, sampled, engine.init_decode_state(), [0, 1, 2])
        if engine is padded:
            _, _ = engine.generate(None, engine.prefill_insert_many(prompts, sampled, engine.init_decode_state(),
                                                                    [0, 1, 2]))  # all 32 rows, all 64 positions
        state, result = engine.generate(None, state, live_slots=3, live_length=40)  # wants 8 rows
        results.append((jax.device_get(state), np.asarray(result.data)))
    assert reuse["decode"].compiled == {(32, 64)} and reuse["decode"].padded_calls == 1
    (state_own, data_own), (state_padded, data_padded) = results
    for slot in range(3):
        got, want = decode_result_row(data_padded, slot, 3), decode_result_row(data_own, slot, 3)
        for key in ("tokens", "valid", "length", "versions"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-6)
    assert not any(decode_result_row(data_padded, slot, 3)["valid"].any() for slot in range(3, 32))  # no requests there
    for name in ("position", "next_token", "generated", "active"):
        np.testing.assert_array_equal(np.asarray(getattr(state_padded, name)), np.asarray(getattr(state_own, name)))
