"""Decode throughput of one engine against several in threads of their own (`sampler.local_engines`).

  python benchmarks/decode_lanes.py [--config configs/calculator_tiny.py] [--lanes 2] [--slots S] [--calls 20] [--rounds 5]

Builds the config's engine with all of `sampler.max_concurrent_decodes` slots (S) and `--lanes` (N)
engines of S / N slots each (`build.build_engines`, as the trainer does), fills every slot with a
sampled request, then times `--calls` `generate` calls on the one engine, and the same count on
each of the N engines at once, each in its own thread — in alternating rounds, so that drift of
the host's speed hits both alike. Prints the median milliseconds per decode step and the rows
decoded per millisecond of each, and their ratio: what a host's cores give the in-process sampler's
decode when its slots are split between engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _filled(engine, prompt):
    from jaxrl_agent.sampling import SamplingParams

    slots = engine.max_concurrent_decodes
    return engine.prefill_insert_many([prompt] * slots, [SamplingParams(temperature=1.0)] * slots,
                                      engine.init_decode_state(), list(range(slots)))


def _calls(engine, state, calls: int):
    """`calls` generate calls over every slot (restarted when the cache window fills); seconds."""
    start = time.perf_counter()
    for _ in range(calls):
        state, result = engine.generate(None, state, max_steps=engine.steps_per_call)
        np.asarray(result.data)
    return state, time.perf_counter() - start


def main() -> None:
    from jaxrl_agent import build, config_lib, heap

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "calculator_tiny.py"))
    parser.add_argument("--lanes", type=int, default=2, help="engines decoding at once, each in its own thread")
    parser.add_argument("--calls", type=int, default=20, help="generate calls per timing")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians reported)")
    parser.add_argument("--slots", type=int, default=0,
                        help="sampler.max_concurrent_decodes (S) instead of the config's (0 = the config's)")
    args = parser.parse_args()

    config = config_lib.load_config(args.config)
    heap.set_host_allocator(config.get("host_allocator", "system"))  # as the launcher does
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, build.build_mesh(config))
    config.unlock()
    if args.slots:
        if args.slots % args.lanes:
            raise SystemExit(f"--slots={args.slots}: expected a multiple of --lanes={args.lanes}")
        config.sampler.max_concurrent_decodes = args.slots
    config.sampler.local_engines = 1
    one = build.build_engines(config, model_config, params, tokenizer)[0]
    config.sampler.local_engines = args.lanes
    lanes = build.build_engines(config, model_config, params, tokenizer)
    prompt = np.asarray(tokenizer.encode("Q: 17*23+5=?"), np.int32)
    states = {id(e): _filled(e, prompt) for e in [one, *lanes]}
    steps = one.steps_per_call

    def run(engine, calls, out):
        states[id(engine)], out[id(engine)] = _calls(engine, states[id(engine)], calls)

    for engine in [one, *lanes]:  # compile, warm up
        run(engine, 2, {})
    single, split = [], []
    for _ in range(args.rounds):
        out: dict = {}
        run(one, args.calls, out)
        single.append(out[id(one)] / (args.calls * steps))
        out = {}
        threads = [threading.Thread(target=run, args=(e, args.calls, out)) for e in lanes]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        split.append((time.perf_counter() - start) / (args.calls * steps))
    rows = one.max_concurrent_decodes
    a, b = statistics.median(single), statistics.median(split)
    print(f"{rows} slots, decode options {one.decode_choice.describe()}; medians of {args.rounds} rounds x "
          f"{args.calls} calls x {steps} steps")
    print("| engines | rows each | ms per step (all engines) | rows per ms | vs one engine |")
    print("|---|---|---|---|---|")
    print(f"| 1 | {rows} | {1e3 * a:.2f} | {rows / (1e3 * a):.1f} | 1.00 |")
    print(f"| {args.lanes} (threads) | {rows // args.lanes} | {1e3 * b:.2f} | {rows / (1e3 * b):.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
