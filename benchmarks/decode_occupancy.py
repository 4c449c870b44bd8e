"""Cost of one `generate` call when few slots are live: compact calls against the full batch.

  python benchmarks/decode_occupancy.py [--config configs/calculator_tiny.py] [--calls 10] [--repeats 5]

Builds the config's engine (the tiny default: 64 slots, 4 decode steps per call), fills every slot
with a sampled request, then times `generate(live_slots=n)` for n = 8, 16, 32 (the engine decodes
`decode_rows(n)` slots) and the full call (`live_slots=None`), interleaved round by round so that
machine noise hits all alike. Prints the median milliseconds per call and each one's ratio to the
full call: the cost of a call when only the first n slots hold requests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_agent import build, config_lib  # noqa: E402
from jaxrl_agent.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "calculator_tiny.py"))
    parser.add_argument("--calls", type=int, default=10, help="generate calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant (median reported)")
    args = parser.parse_args()

    config = config_lib.load_config(args.config)
    tokenizer = build.build_tokenizer(config)
    model_config, params = build.build_model(config, build.build_mesh(config))
    engine = build.build_engine(config, model_config, params, tokenizer)
    slots = engine.max_concurrent_decodes
    prompt = np.asarray(tokenizer.encode("Q: 17*23+5=?"), np.int32)
    state = engine.prefill_insert_many([prompt] * slots, [SamplingParams(temperature=1.0)] * slots,
                                       engine.init_decode_state(), list(range(slots)))
    variants = [n for n in (8, 16, 32) if n < slots] + [None]
    for live in variants:  # compile, warm up
        for _ in range(2):
            state, result = engine.generate(None, state, live_slots=live, max_steps=engine.steps_per_call)
            np.asarray(result.data)
    times: dict = {live: [] for live in variants}
    for _ in range(args.repeats):
        for live in variants:
            start = time.perf_counter()
            for _ in range(args.calls):
                state, result = engine.generate(None, state, live_slots=live, max_steps=engine.steps_per_call)
                np.asarray(result.data)
            times[live].append((time.perf_counter() - start) / args.calls)
    full = statistics.median(times[None])
    print(f"{slots} slots, {engine.steps_per_call} decode steps per call; medians of {args.repeats} x {args.calls} calls")
    print("| live slots | slots decoded | ms per call | vs full call |")
    print("|---|---|---|---|")
    for live in variants:
        ms = 1e3 * statistics.median(times[live])
        print(f"| {live or slots} | {engine.decode_rows(live)} | {ms:.1f} | {ms / (1e3 * full):.2f} |")


if __name__ == "__main__":
    main()
