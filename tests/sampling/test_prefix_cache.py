"""The prefix cache: a prompt continuing a finished request prefills only its new tokens, and the
tokens and log-probs it samples are those of a full prefill."""

import jax
import numpy as np
import pytest

from jaxrl_agent.sampling import LocalSampler, SamplingParams
from jaxrl_agent.sampling.prefix_cache import PrefixIndex
from tests.sampling.test_engine import PARAMS, TOKENIZER, _engine, _greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


def _episode(sampler, prompt, observations, sampling=GREEDY):
    """A multi-turn exchange: each next prompt is the whole history plus an observation."""
    history, completions = list(prompt), []
    for observation in observations + [""]:
        completion = sampler.generate_many([history], sampling)[0]
        completions.append(completion)
        history += list(completion.token_ids) + TOKENIZER.encode(observation)
    return completions


def test_prefix_index_finds_the_longest_stored_prefix_and_evicts_continued_entries_first():
    index = PrefixIndex(3)
    a = index.store([1, 2, 3], version=0)
    b = index.store([1, 2, 3, 4, 5], version=0)
    c = index.store([4, 4], version=0)
    assert index.lookup([1, 2, 3, 4, 5, 6], version=0) == (b, 5)
    assert index.lookup([1, 2, 3, 9], version=0) == (a, 3)
    assert index.lookup([1, 2, 3], version=0) == (a, 2)  # the last prompt token must still run
    assert index.lookup([7, 1, 2, 3], version=0) is None
    d = index.store([8, 8], version=0)  # evicts a, the entry continued last; then b; c stays
    e = index.store([9, 9], version=0)
    assert {d, e} == {a, b} and index.lookup([4, 4, 1], version=0) == (c, 2)
    assert index.lookup([1, 2, 3, 4, 5, 6], version=0) is None
    assert index.store([9], version=-1) is None  # older weights than the index holds
    assert index.lookup([8, 8, 1], version=1) is None and len(index) == 0  # new weights: all invalid
    assert PrefixIndex(0).store([1, 2], version=0) is None


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_continued_turns_sample_exactly_what_a_full_prefill_samples(steps_per_call):
    observations = [" -> 42\n", "go: "]
    with LocalSampler(_engine(steps_per_call=steps_per_call)) as plain:
        expected = _episode(plain, TOKENIZER.encode("Q: 6*7=?"), observations)
        assert plain.stats["reused_tokens"] == 0
    with LocalSampler(_engine(steps_per_call=steps_per_call, prefix_cache_entries=4)) as cached:
        got = _episode(cached, TOKENIZER.encode("Q: 6*7=?"), observations)
        assert cached.stats["prefix_hits"] == 2 and cached.stats["reused_tokens"] > 0
        assert cached.stats["prefill_tokens"] + cached.stats["reused_tokens"] == plain.stats["prefill_tokens"]
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
        np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-5)
    # And both against the full-forward reference for the last turn.
    history = TOKENIZER.encode("Q: 6*7=?")
    for completion, observation in zip(got[:-1], observations):
        history += list(completion.token_ids) + TOKENIZER.encode(observation)
    reference, reference_lps = _greedy_reference(history, 5)
    assert list(got[-1].token_ids) == reference
    np.testing.assert_allclose(got[-1].logprobs, reference_lps, atol=1e-5)


@pytest.mark.parametrize("entries,hits", [(10, 10), (3, None)])
def test_many_concurrent_episodes_share_slots_and_the_cache_without_cross_talk(entries, hits):
    prompts = [TOKENIZER.encode(f"Q: {i}+{i}=?") for i in range(10)]
    observations = [TOKENIZER.encode(f" [{i}] ") for i in range(10)]

    def run(sampler):
        first = sampler.generate_many(prompts, GREEDY)
        second = sampler.generate_many([p + list(c.token_ids) + o for p, c, o in zip(prompts, first, observations)],
                                       GREEDY)
        return first, second

    with LocalSampler(_engine()) as plain:
        expected = run(plain)
    # 10 episodes through 4 slots; with 3 entries, later finishers evict earlier ones' prefixes.
    with LocalSampler(_engine(prefix_cache_entries=entries)) as cached:
        got = run(cached)
        if hits is not None:
            assert cached.stats["prefix_hits"] == hits
    for e_turn, g_turn in zip(expected, got):
        for e, g in zip(e_turn, g_turn):
            assert g.token_ids == e.token_ids
            np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-5)


def test_new_weights_invalidate_the_cache_and_the_turn_uses_them():
    new_params = jax.tree.map(lambda p: p * 1.5, PARAMS)
    prompt = TOKENIZER.encode("Q: 2+2=?")
    with LocalSampler(_engine(prefix_cache_entries=4)) as sampler:
        first = sampler.generate_many([prompt], GREEDY)[0]
        sampler.update_weights(new_params, 1)
        second = sampler.generate_many([prompt + list(first.token_ids) + [5, 6]], GREEDY)[0]
        assert sampler.stats["prefix_hits"] == 0
    reference, reference_lps = _greedy_reference(prompt + list(first.token_ids) + [5, 6], 5, params=new_params)
    assert list(second.token_ids) == reference and set(second.versions) == {1}
    np.testing.assert_allclose(second.logprobs, reference_lps, atol=1e-5)


def test_temperature_sampling_stream_is_unchanged_by_the_cache():
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    prompt = TOKENIZER.encode("Q: 3*3=?")
    with LocalSampler(_engine(seed=3)) as plain:
        expected = _episode(plain, prompt, [" 9 "], sampling)
    with LocalSampler(_engine(seed=3, prefix_cache_entries=2)) as cached:
        got = _episode(cached, prompt, [" 9 "], sampling)
        assert cached.stats["prefix_hits"] == 1
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-5)


class _Buckets:
    """The one engine method `_by_bucket` reads: `prefill_bucket`s from 16, at most 128."""

    @staticmethod
    def bucket_length(length):
        from jaxrl_agent.sampling.engine import AgentEngine
        return AgentEngine.bucket_length(type("E", (), {"_max_prefill": 128})(), length)


def test_prefill_calls_merge_buckets_when_padding_costs_less_than_another_call():
    from jaxrl_agent.sampling import local

    def calls(lengths):
        return [sorted(group) for group in local._by_bucket(_Buckets(), list(lengths), lambda n: n)]

    # Eight tool results of 10-40 tokens: one call of 8 x 48 (448 slots with the call's cost), not
    # 8 x 16 + 8 x 24 + 8 x 32 + 8 x 48 (1,216 slots) as when each bucket had a call of its own.
    assert calls([10, 12, 20, 25, 30, 33, 38, 40]) == [[10, 12, 20, 25, 30, 33, 38, 40]]
    # One long prompt among many short ones keeps a call of its own: 32 x 16 + 8 x 128, not 64 x 128.
    assert calls([9] * 32 + [100]) == [[9] * 32, [100]]
    # Too long for any bucket: a group of its own (it fails there alone).
    assert calls([5, 500]) == [[5], [500]]
    assert calls([]) == []
    # The chosen calls never cost more than one call per bucket, nor than one call for everything.
    rng = np.random.RandomState(0)
    for _ in range(50):
        lengths = rng.randint(1, 129, rng.randint(1, 70)).tolist()
        cost = lambda groups: sum(local._prefill_slots(len(g), _Buckets.bucket_length(max(g))) for g in groups)
        per_bucket = {}
        for n in lengths:
            per_bucket.setdefault(_Buckets.bucket_length(n), []).append(n)
        chosen = calls(lengths)
        assert sorted(n for g in chosen for n in g) == sorted(lengths)
        assert cost(chosen) <= min(cost(per_bucket.values()), cost([lengths]))


def test_prefix_copies_of_the_first_positions_only_sample_what_a_full_prefill_samples():
    """At a 512-position cache the pool copies move S/4 or S/2 positions while a history is short
    (`AgentEngine.copy_window`). Slots and entries that held longer histories before keep stale
    keys/values past the window: a continued turn must still sample exactly a full prefill's tokens."""
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, TOKENIZER.vocab_size, 10).tolist() for _ in range(4)]
    observations = [[rng.randint(3, TOKENIZER.vocab_size, 48).tolist() for _ in range(4)] for _ in range(4)]

    def run(sampler):
        # A long episode first (its keys/values reach ~360 positions), then short ones in its slot.
        histories, turns = [list(p) for p in prompts], []
        for observation in observations + [None]:
            completions = sampler.generate_many(histories, sampling)
            turns.append([c.token_ids for c in completions])
            if observation is not None:
                histories = [h + list(c.token_ids) + o for h, c, o in zip(histories, completions, observation)]
        short = [p[:5] for p in prompts]
        first = sampler.generate_many(short, sampling)
        turns.append([c.token_ids for c in sampler.generate_many(
            [s + list(c.token_ids) + [7, 8, 9] for s, c in zip(short, first)], sampling)])
        return turns

    engine = dict(max_concurrent_decodes=4, max_prefill_length=512, max_cache_length=512, steps_per_call=4)
    with LocalSampler(_engine(**engine)) as plain:
        expected = run(plain)
    cached_engine = _engine(prefix_cache_entries=4, **engine)
    windows = []
    copy_window = cached_engine.copy_window
    cached_engine.copy_window = lambda length: windows.append(copy_window(length)) or windows[-1]
    with LocalSampler(cached_engine) as cached:
        got = run(cached)
        assert cached.stats["prefix_hits"] == 4 * 4 + 4
    assert {128, 256, 512} <= set(windows)
    assert got == expected


def test_prefill_buckets_are_powers_of_two_and_three_quarters_of_them():
    """A prompt pads to the smallest of 16, 24, 32, 48, 64, 96, 128, ... that holds it: a 33-token
    turn runs 48 positions, not 64; no bucket is below 16; past max_prefill_length it is refused."""
    from jaxrl_agent.sampling.engine import prefill_bucket
    from jaxrl_agent.sampling.types import PromptTooLongError
    assert [prefill_bucket(n) for n in (1, 16, 17, 24, 25, 32, 33, 48, 49, 64, 65, 96, 97, 128)] == \
        [16, 16, 24, 24, 32, 32, 48, 48, 64, 64, 96, 96, 128, 128]
    for n in range(1, 1025):  # the smallest of the ladder that holds n
        ladder = [b for k in range(4, 11) for b in (3 << (k - 2), 1 << k) if b >= 16]
        assert prefill_bucket(n) == min(b for b in ladder if b >= n), n
    assert _Buckets.bucket_length(128) == 128
    with pytest.raises(PromptTooLongError, match="129 tokens exceeds max_prefill_length=128"):
        _Buckets.bucket_length(129)
