"""Where a decode step's time goes: a per-op profile of the engine's decode loop, by model part.

  python benchmarks/decode_profile.py [--rows 8] [--temperature 0] [--options small_batch] [--calls 10] [--top_ops 12]
      [--model default]   # configs/calculator_tiny.py's model instead of the sampler benchmark's

Builds the sampler benchmark's engine (`sampler_throughput.py`: Qwen3-style, 2 layers, d=256,
vocabulary 8192, float32; cache 96, 16 steps per call) with `rows` slots, all decoding, times its
`generate` calls, then records `calls` of them under `jax.profiler` and sums each XLA:CPU op's time
per decode step. Every op is put in a part of the step by the name of the JAX operation it came
from (the HLO's `op_name` metadata): the attention projections (q, k, v, o), the attention products
(scores and the weighted sum over the cache), the cache write, the MLP, the norms, the output head,
sampling (everything of `decoding.sample_tokens`), and the rest (the loop, RoPE, embedding).

An op's trace event does not always cover its work: the output head's product ([8, 256] x
[256, 8192]) showed 43-48 us in its event and then 158-172 us in which no op of the step ran at all
(model 207 host, benchmarks/RESULTS.md) — the product finishing outside its event — and the step was
~0.25 ms shorter with a vocabulary of 1024 instead of 8192. So each op is also charged the
untraced wait that follows it inside the decode loop (until the next op starts, while no other op
runs), and the parts are reported with it; gaps next to the ops before and after the loop (between
`generate` calls: the host's side) are reported apart.

Also printed: how the ops were spread over the host's threads — the busy time of each thread, the
time two threads were busy at once, and the step's span in the trace. Ops run one at a time on one
thread or the other, and the profiler adds a little to each op, so the parts add up to more
than the step's untraced time, which is printed first. Reads nothing from the repository's
configs; needs only jax (the trace is parsed from its Perfetto JSON).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from learner_step import model_config  # noqa: E402
from sampler_throughput import MODEL, _engine  # noqa: E402

from jaxrl_agent import models  # noqa: E402
from jaxrl_agent.sampling import engine as engine_lib  # noqa: E402

# (part, pattern in the op's JAX name), first match wins.
PARTS = (
    ("attention projections", r"/attn/(q_proj|k_proj|v_proj|o_proj)/"),
    ("attention products", r"/attn/bkq"),
    ("attention softmax", r"/attn/.*(reduce_max|exp|reduce_sum|div|add|sub)"),
    ("cache write", r"/attn/(scatter|dynamic_update_slice)"),
    ("q/k norms, RoPE", r"/attn/"),  # RoPE's rotation is a concatenate, fused with the q/k norms
    ("MLP", r"/mlp/"),
    ("norms", r"norm"),
    ("output head", r"h,hv->|output_kernel"),
    ("embedding", r"embed"),
)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX operation name in its metadata ('' when it has none)."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            names.setdefault(m.group(1), op.group(1) if op else "")
    return names


def part_of(jax_name: str) -> str:
    if "sample_tokens" in jax_name or "decoding" in jax_name:
        return "sampling"
    for part, pattern in PARTS:
        if re.search(pattern, jax_name):
            return part
    return "other (the loop, unnamed reductions, copies)"


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def untraced_waits(ops: list[tuple[float, float, str]], in_loop) -> tuple[dict[str, float], float]:
    """Charges each gap in which no op runs to the op that ended last before it, when the ops on
    both sides of the gap belong to the decode loop (`in_loop(name)`): ({op: summed gap}, summed
    other gaps — before and after the loop, between calls: the host's side). `ops`: (start, end,
    name) of every op event, on any thread."""
    waits: dict[str, float] = collections.Counter()
    outside = 0.0
    end, last = None, None
    for start, stop, name in sorted(ops):
        if end is not None and start > end:
            if in_loop(last) and in_loop(name):
                waits[last] += start - end
            else:
                outside += start - end
        if end is None or stop > end:
            end, last = stop, name
    return waits, outside


def profile(rows: int, temperature: float, options: str, calls: int, top_ops: int = 12, model: str = "benchmark") -> None:
    config = models.ModelConfig(**MODEL) if model == "benchmark" else model_config("default")
    params = models.init_params(config, jax.random.PRNGKey(0))
    engine = _engine(config, params, rows, 16, 64, decode_compiler_options=engine_lib.DECODE_OPTION_SETS[options])
    state = engine.init_decode_state()
    state = state.replace(active=jnp.ones_like(state.active), temperature=jnp.full_like(state.temperature, temperature))

    def run(n, state):
        for _ in range(n):
            state, result = engine.generate(None, state, max_steps=engine.steps_per_call)
            np.asarray(result.data)
        return state

    state = run(3, state)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        state = run(2, state)
        times.append((time.perf_counter() - start) / (2 * engine.steps_per_call))
    step_us = statistics.median(times) * 1e6
    with engine._lock:
        weights, kernel, version = engine._params, engine._kernel, engine._version
    fn = engine._generate_small_fn if rows <= engine_lib.SMALL_DECODE_ROWS else engine._generate_fn
    hlo = fn.lower(weights, kernel, state, np.int32(version), np.int32(engine.steps_per_call), rows=rows,
                   window=engine.decode_window(None)).compile().as_text()
    names = op_names(hlo)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        state = run(calls, state)
        jax.profiler.stop_trace()
        path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = calls * engine.steps_per_call
    by_part, by_op, per_thread = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    ops = []
    for e in events:
        if e.get("ph") != "X" or e.get("dur", 0) <= 0 or e["name"] not in names:
            continue
        if e["name"].startswith(("while", "call", "cond")):
            continue  # containers: their ops are counted themselves
        by_part[part_of(names[e["name"]])] += e["dur"]
        by_op[e["name"]] += e["dur"]
        per_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
        ops.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    waits, outside = untraced_waits(ops, lambda name: "/while/" in names[name])
    wait_by_part = collections.Counter()
    for name, us in waits.items():
        wait_by_part[part_of(names[name])] += us
    print(f"\ndecode step, {rows} rows, temperature {temperature}, options {options}: "
          f"{step_us:.0f} us untraced (median of 10 timings of 2 calls x {engine.steps_per_call} steps)\n")
    print("| part of the step | us per step (traced) | untraced wait after it | together | share |\n|---|---|---|---|---|")
    total = sum(by_part.values()) + sum(wait_by_part.values())
    for part, us in sorted(by_part.items(), key=lambda kv: -(kv[1] + wait_by_part[kv[0]])):
        both = us + wait_by_part[part]
        print(f"| {part} | {us / steps:.1f} | {wait_by_part[part] / steps:.1f} | {both / steps:.1f} | {both / total:.0%} |")
    print(f"| all ops | {sum(by_part.values()) / steps:.1f} | {sum(wait_by_part.values()) / steps:.1f} | "
          f"{total / steps:.1f} | |\n\nbetween generate calls (outside the loop, no op running): {outside / steps:.1f} us per step\n")
    print("| op | us per step (traced) | untraced wait after it | JAX operation |\n|---|---|---|---|")
    for name in sorted(by_op, key=lambda n: -(by_op[n] + waits.get(n, 0.0)))[:top_ops]:
        print(f"| {name} | {by_op[name] / steps:.1f} | {waits.get(name, 0.0) / steps:.1f} | {names[name][-80:]} |")
    threads = sorted(per_thread, key=lambda t: -len(per_thread[t]))[:2]
    unions = {t: _union(per_thread[t]) for t in threads}
    busy = [sum(b - a for a, b in unions[t]) / steps for t in threads]
    both = _overlap(unions[threads[0]], unions[threads[1]]) / steps if len(threads) == 2 else 0.0
    whole = _union([iv for t in threads for iv in per_thread[t]])
    print(f"\nthreads running ops: {len(per_thread)}; busiest two busy {', '.join(f'{b:.0f}' for b in busy)} us per step, "
          f"both at once {both:.0f} us; ops' span {(whole[-1][1] - whole[0][0]) / steps:.0f} us per step "
          f"(traced), of which some op runs {sum(b - a for a, b in whole) / steps:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the sampler benchmark's)")
    parser.add_argument("--options", default="small_batch", choices=sorted(engine_lib.DECODE_OPTION_SETS))
    parser.add_argument("--calls", type=int, default=10, help="generate calls traced")
    parser.add_argument("--top_ops", type=int, default=12, help="ops listed in the per-op table")
    parser.add_argument("--model", choices=("benchmark", "default"), default="benchmark",
                        help="benchmark: the sampler benchmark's model; default: configs/calculator_tiny.py's")
    args = parser.parse_args()
    profile(args.rows, args.temperature, args.options, args.calls, args.top_ops, args.model)


if __name__ == "__main__":
    main()
