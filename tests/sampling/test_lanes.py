"""A LocalSampler over several engines (`sampler.local_engines`): each engine decodes in a thread of
its own; an episode's next turn goes to the engine whose prefix cache holds its history, a repeated
prompt to the engine that has it; greedy tokens are those of one engine."""

import asyncio

import jax
import numpy as np
import pytest

from jaxrl_agent import build, config_lib
from jaxrl_agent.sampling import LocalSampler, SamplingParams
from jaxrl_agent.sampling.prefix_cache import PrefixIndex
from tests.sampling.test_engine import PARAMS, PROMPTS, TOKENIZER, _engine, _greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_two_engines_decode_greedy_tokens_exactly_and_sum_their_counters():
    with LocalSampler([_engine(), _engine(seed=5)]) as sampler:
        completions = sampler.generate_many([TOKENIZER.encode(p) for p in PROMPTS], GREEDY)
        assert sampler.stats["requests"] == len(PROMPTS)
        per_lane = [lane.stats["requests"] for lane in sampler._lanes]
        assert sum(per_lane) == len(PROMPTS) and min(per_lane) > 0, per_lane  # both engines decoded
        assert sampler.is_alive()
    assert not sampler.is_alive()  # close() stops every engine's thread
    for prompt, completion in zip(PROMPTS, completions):
        expected, expected_lps = _greedy_reference(TOKENIZER.encode(prompt), 6)
        assert list(completion.token_ids) == expected, prompt
        np.testing.assert_allclose(completion.logprobs, expected_lps, atol=1e-5)


def test_a_next_turn_goes_to_the_engine_that_holds_its_history():
    engines = [_engine(prefix_cache_entries=8), _engine(prefix_cache_entries=8, seed=5)]
    with LocalSampler(engines) as sampler:
        prompts = [TOKENIZER.encode(p) for p in ("Q: 1+2=?", "a", "xyz", "Q: 9*9=?", "0123456789", "tool")]
        first = sampler.generate_many(prompts, GREEDY)  # spread over both engines by load
        assert all(lane.stats["requests"] > 0 for lane in sampler._lanes)
        # Reversed: routed by load alone, the continuations would meet the engines in another order.
        prompts, first = prompts[::-1], first[::-1]
        second = [p + list(c.token_ids) + TOKENIZER.encode(" ok ") for p, c in zip(prompts, first)]
        lanes = [sampler._lane_for(np.asarray(p, np.int32)) for p in second]
        continued = sampler.generate_many(second, GREEDY)
        # Each continuation reused its own first turn's keys and values: routed by load alone,
        # some would land on the engine that lacks them and prefill everything.
        assert sampler.stats["prefix_hits"] == len(second)
        assert sampler.stats["reused_tokens"] == sum(len(p) + len(c.token_ids) for p, c in zip(prompts, first))
        assert lanes.count(sampler._lanes[0]) not in (0, len(second))
    for history, completion in zip(second, continued):
        assert list(completion.token_ids) == _greedy_reference(history, 6)[0]


def test_a_repeated_prompt_joins_the_engine_that_has_it():
    with LocalSampler([_engine(), _engine(seed=5)]) as sampler:
        prompt = np.asarray(TOKENIZER.encode("Q: 4+4=?"), np.int32)
        other = np.asarray(TOKENIZER.encode("Q: 5+5=?"), np.int32)
        lane = sampler._lane_for(prompt)
        sampler._lanes[sampler._lanes.index(lane)]._pending.extend([None] * 3)  # now the busier one
        try:
            assert sampler._lane_for(prompt) is lane  # a group's episodes share one prefill
            assert sampler._lane_for(other) is not lane  # a new prompt goes to the less loaded
        finally:
            lane._pending.clear()


def test_update_weights_reaches_every_engine():
    new = jax.tree.map(lambda x: x * 1.5, PARAMS)
    with LocalSampler([_engine(), _engine(seed=5)]) as sampler:
        sampler.update_weights(new, 3)
        assert [e.version for e in sampler.engines] == [3, 3]
        completions = asyncio.run(_gather(sampler, [TOKENIZER.encode(p) for p in PROMPTS[:4]]))
    for prompt, completion in zip(PROMPTS, completions):
        assert set(completion.versions) == {3}
        assert list(completion.token_ids) == _greedy_reference(TOKENIZER.encode(prompt), 6, params=new)[0]


async def _gather(sampler, prompts):
    return await asyncio.gather(*(sampler.generate(p, GREEDY) for p in prompts))


def test_peek_reports_what_lookup_would_reuse_and_changes_nothing():
    index = PrefixIndex(2)
    index.store([1, 2, 3], version=0)
    index.store([1, 2, 3, 4, 5], version=0)
    assert index.peek([1, 2, 3, 4, 5, 6], version=0) == 5
    assert index.peek([1, 2, 3], version=0) == 2  # the last prompt token still runs
    assert index.peek([9, 1, 2], version=0) == 0 and index.peek([1, 2, 3, 4], version=1) == 0
    assert index.stats["hits"] == index.stats["misses"] == 0 and len(index) == 2
    assert index.lookup([1, 2, 3, 4, 5, 6], version=0)[1] == 5


def _tiny_config(**sampler):
    config = config_lib.load_config("configs/calculator_tiny.py")
    config.model.num_layers, config.model.hidden_size, config.model.intermediate_size = 1, 32, 64
    config.model.num_heads = config.model.num_kv_heads = 2
    config.model.head_dim = 16
    config.sampler.decode_options = "builtin"
    config.compilation_cache_dir = ""
    for key, value in sampler.items():
        config.sampler[key] = value
    return config


def test_build_splits_slots_and_cache_entries_between_engines_with_their_own_streams():
    config = _tiny_config(local_engines=2, max_concurrent_decodes=8, prefix_cache_entries=6)
    model_config, params = build.build_model(config)
    engines = build.build_engines(config, model_config, params, build.build_tokenizer(config))
    assert [(e.max_concurrent_decodes, e.prefix_cache_entries) for e in engines] == [(4, 3), (4, 3)]
    assert engines[0]._seed == config.seed and engines[1]._seed != engines[0]._seed
    assert engines[1].decode_choice == engines[0].decode_choice
    # One compiled program per shape for both: the seed is an argument, not a constant of it.
    assert engines[1]._extend_insert_fn is engines[0]._extend_insert_fn
    assert engines[1]._decode_fn({}) is engines[0]._decode_fn({})


def test_auto_picks_two_engines_on_a_cpu_host_with_two_cores_and_an_even_split(monkeypatch):
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1})
    assert build.local_engine_count(_tiny_config(local_engines=0)) == 2
    assert build.local_engine_count(_tiny_config(local_engines=0, max_concurrent_decodes=5)) == 1
    assert build.local_engine_count(_tiny_config(local_engines=3, max_concurrent_decodes=6)) == 3  # as asked
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0})
    assert build.local_engine_count(_tiny_config(local_engines=0)) == 1
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
    assert build.local_engine_count(_tiny_config(local_engines=0)) == 1
    build.validate_config(_tiny_config(local_engines=0, max_concurrent_decodes=5))  # auto never refuses


@pytest.mark.parametrize("sampler", [dict(local_engines=3), dict(local_engines=-1),
                                     dict(local_engines=2, prefix_cache_entries=5)])
def test_local_engines_that_do_not_divide_the_slots_are_refused(sampler):
    with pytest.raises(build.ConfigError, match="sampler.local_engines"):
        build.validate_config(_tiny_config(**sampler))


def test_the_call_length_keys_reach_every_engine_and_bad_ones_are_refused():
    """sampler.steps_per_call / max_steps_per_call from the config to each engine the run builds
    (0 = fixed calls of steps_per_call); a maximum below the minimum is a config error naming both."""
    for most, expected in ((12, 12), (0, 3)):
        config = _tiny_config(local_engines=2, max_concurrent_decodes=8, steps_per_call=3, max_steps_per_call=most)
        model_config, params = build.build_model(config)
        engines = build.build_engines(config, model_config, params, build.build_tokenizer(config))
        assert [(e.steps_per_call, e.max_steps_per_call) for e in engines] == [(3, expected)] * 2
    with pytest.raises(build.ConfigError, match=r"sampler.max_steps_per_call=2: expected 0 .* >= "
                                                r"sampler.steps_per_call=3"):
        build.validate_config(_tiny_config(steps_per_call=3, max_steps_per_call=2))
