"""Agentic (multi-turn) sampling: our engine with its prefix cache against tunix's sampler, which
re-prefills the growing history every turn; one invocation, alternating rounds.

  python benchmarks/agentic_sampling.py --tunix_python /tmp/tunix_venv/bin/python [--batches 8,32]
      [--rounds 5] [--episodes 2] [--steps_per_call 4]
  python benchmarks/agentic_sampling.py --breakdown [--batches 8,32] [--episodes 8]   # where ours spends its time
  ... --lanes 2   # ours with its slots split between two engines, one decode thread each

Episodes (benchmarks/agentic_plan.py): 4 assistant turns of 16-64 tokens, tool results of 10-40
tokens between them, each turn's prompt the whole history so far; greedy, no early stop. Model: the
sampler benchmark's shape (Qwen3-style, 2 layers, d=256, vocabulary 8192, random weights, float32),
built alike on both sides. Arms, each round in this order, per batch size:
  * ours: `LocalSampler` over `AgentEngine` with its prefix cache (a turn prefills only the tokens
    after the longest cached prefix of its history), with the decode options chosen for this host;
  * ours, no prefix cache: the same engine re-prefilling every history (the control: what the
    prefix cache itself is worth);
  * tunix: tunix's `Sampler` (a subprocess, kept compiled, idle while ours run), the batch's
    histories as one padded batch per turn.
Reports generated tokens/s and seconds per episode batch (medians over all rounds' episode
batches) and the ratio ours / tunix per round.

`--breakdown` instead times every engine call of the `ours` arm (each followed by a wait for its
result, which adds a little to each call): ms and calls per episode batch for decoding (`generate`),
first-turn prefills, continued turns (`extend_insert_many`), saves to the prefix pool and frees,
after two warm-up episode batches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import agentic_plan  # noqa: E402
import launcher_runs  # noqa: E402
from sampler_throughput import MODEL  # noqa: E402
from served_baseline import ServedBaseline  # noqa: E402

from jaxrl_agent import models, tokenizer as tok  # noqa: E402
from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams, host_tuning  # noqa: E402


def our_sampler(config, params, batch: int, steps: int, prefix_cache: bool, lanes: int = 1,
                max_steps: int = 0) -> LocalSampler:
    """`batch` slots (and 2 x batch prefix-cache entries) in one engine, or split between `lanes`
    engines decoding in threads of their own (as `sampler.local_engines` splits them)."""
    if batch % lanes:
        raise SystemExit(f"--lanes={lanes}: expected a divisor of every batch size, got batch {batch}")
    engines = []
    for i in range(lanes):
        engine = AgentEngine(config, params, tok.CharTokenizer(), max_concurrent_decodes=batch // lanes,
                             max_prefill_length=agentic_plan.CACHE_LENGTH, max_cache_length=agentic_plan.CACHE_LENGTH,
                             steps_per_call=steps, max_steps_per_call=max_steps, stop_token_ids=[-1], seed=i,
                             prefix_cache_entries=2 * batch // lanes if prefix_cache else 0)
        host_tuning.tune_engine(engine, "auto", cache_path=launcher_runs.host_choices_path())
        engines.append(engine)
    return LocalSampler(engines)


def play(sampler: LocalSampler, batch: int, ids_seed: int) -> tuple[int, float]:
    """(tokens generated, seconds) of one episode batch (new ids, the plan's lengths)."""
    plan = agentic_plan.episode_batch(batch, ids_seed=ids_seed)

    def sample(histories, n):
        completions = sampler.generate_many(histories, SamplingParams(temperature=0.0, max_tokens=n))
        return [c.token_ids for c in completions]

    start = time.perf_counter()
    tokens, _ = agentic_plan.run_episodes(plan, sample)
    return tokens, time.perf_counter() - start


ENGINE_CALLS = {"generate": "decode (generate)", "prefill_insert_many": "first-turn prefill",
                "extend_insert_many": "continued turns (extend)", "save_prefixes": "save to the prefix pool",
                "free_slots": "free slots"}


def timed_engine_calls(engine) -> dict[str, list[float]]:
    """Wraps the engine's admission, decode and bookkeeping calls (ENGINE_CALLS) so that each waits
    for its result and records its seconds; returns {method: [seconds per call]}, filled as it runs."""
    times = {name: [] for name in ENGINE_CALLS}

    def wrap(name, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = jax.block_until_ready(method(*args, **kwargs))
            times[name].append(time.perf_counter() - start)
            return out
        return call

    for name in ENGINE_CALLS:
        setattr(engine, name, wrap(name, getattr(engine, name)))
    return times


def breakdown(config, params, batches, steps: int, episodes: int, max_steps: int = 0) -> None:
    """Per batch size: ms and calls per episode batch of each engine call of the `ours` arm, over
    `episodes` episode batches after two warm-ups, and the wall time per episode batch."""
    seeds = iter(range(1, 10**9))
    print("\n| batch | engine call | ms per episode batch | calls per episode batch | ms per call |\n|---|---|---|---|---|")
    for b in batches:
        with our_sampler(config, params, b, steps, True, max_steps=max_steps) as sampler:
            play(sampler, b, next(seeds))
            play(sampler, b, next(seeds))
            times = timed_engine_calls(sampler.engine)
            wall = [play(sampler, b, next(seeds))[1] for _ in range(episodes)]
        for name, label in ENGINE_CALLS.items():
            total = sum(times[name])
            if times[name]:
                print(f"| {b} | {label} | {total / episodes * 1e3:.1f} | {len(times[name]) / episodes:.1f} | "
                      f"{total / len(times[name]) * 1e3:.2f} |")
        print(f"| {b} | wall time (median) | {statistics.median(wall) * 1e3:.1f} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tunix_python", default="", help="A Python with google-tunix ('' = our arms only).")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=2, help="Episode batches per arm per round.")
    parser.add_argument("--steps_per_call", type=int, default=4)
    parser.add_argument("--max_steps_per_call", type=int, default=16,
                        help="The most steps a call runs while no request finishes (the configs' default; "
                             "0 = steps_per_call).")
    parser.add_argument("--breakdown", action="store_true", help="Time each engine call of ours instead (no tunix).")
    parser.add_argument("--lanes", type=int, default=1,
                        help="Our arms' slots split between this many engines, each decoding in a thread of its own.")
    args = parser.parse_args()
    config = models.ModelConfig(**MODEL)
    params = models.init_params(config, jax.random.PRNGKey(0))
    batches = [int(b) for b in args.batches.split(",")]
    if args.breakdown:
        return breakdown(config, params, batches, args.steps_per_call, args.episodes, args.max_steps_per_call)
    arms = ["ours", "ours, no prefix cache"] + (["tunix"] if args.tunix_python else [])
    samplers, tunix = {}, {}
    results = {(b, arm): [] for b in batches for arm in arms}  # (tokens, seconds) per episode batch
    ratios = {b: [] for b in batches}
    seeds = iter(range(1, 10**9))  # every episode batch has new token ids
    try:
        for b in batches:
            samplers[b] = {"ours": our_sampler(config, params, b, args.steps_per_call, True, args.lanes,
                                               args.max_steps_per_call),
                           "ours, no prefix cache": our_sampler(config, params, b, args.steps_per_call, False,
                                                                args.lanes, args.max_steps_per_call)}
            for sampler in samplers[b].values():  # compile every shape the plans meet (a first
                play(sampler, b, next(seeds))     # episode batch fills the prefix cache, a second
                play(sampler, b, next(seeds))     # meets it)
            if args.tunix_python:
                tunix[b] = ServedBaseline(args.tunix_python, os.path.join(ROOT, "benchmarks", "tunix_sampler_baseline.py"),
                                          ["--agentic", "--batch", str(b)], "tunix_agentic=")
        print(f"decode options here: {samplers[batches[0]]['ours'].engine.decode_choice.describe()}", file=sys.stderr)
        for r in range(args.rounds):
            for b in batches:
                for arm in arms:
                    if arm == "tunix":
                        runs = tunix[b].request_raw(args.episodes)
                        got = [tuple(float(x) for x in item.split(":")) for item in runs.split(",")]
                    else:
                        got = [play(samplers[b][arm], b, next(seeds)) for _ in range(args.episodes)]
                    results[(b, arm)] += got
                if args.tunix_python:
                    rate = lambda arm: statistics.median(t / s for t, s in results[(b, arm)][-args.episodes:])
                    ratios[b].append(rate("ours") / rate("tunix"))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for by_arm in samplers.values():
            for sampler in by_arm.values():
                sampler.close()
        for baseline in tunix.values():
            baseline.close()

    print(f"\n{agentic_plan.TURNS}-turn episodes (replies 16-64 tokens, tool results 10-40), greedy, "
          f"{args.rounds} alternating rounds of {args.episodes} episode batches per arm; ours on {args.lanes} "
          "engine(s)\n")
    print("| batch | arm | generated tokens/s | s per episode batch | vs tunix |\n|---|---|---|---|---|")
    for b in batches:
        tunix_rate = (statistics.median(t / s for t, s in results[(b, "tunix")]) if args.tunix_python else None)
        for arm in arms:
            rate = statistics.median(t / s for t, s in results[(b, arm)])
            seconds = statistics.median(s for _, s in results[(b, arm)])
            versus = f"{rate / tunix_rate:.2f}" if tunix_rate else ""
            print(f"| {b} | {arm} | {rate:,.0f} | {seconds:.3f} | {versus} |")
    for b in batches:
        if ratios[b]:
            print(f"batch {b}: per-round ratios ours / tunix " + ", ".join(f"{x:.2f}" for x in ratios[b])
                  + f" (median {statistics.median(ratios[b]):.2f})")


if __name__ == "__main__":
    main()
