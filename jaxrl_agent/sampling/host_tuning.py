"""Choices whose best value depends on the host, measured on the host the first time.

The decode loop's XLA:CPU options (`engine.DECODE_OPTION_SETS`) change speed, never tokens, and
what is fastest differs by CPU: the built-in choice (fast min/max above `SMALL_DECODE_ROWS`
decoded rows; YNNPACK off and single-threaded Eigen at most) was measured on one Intel host, and on
an AMD EPYC host the same benchmark put the engine at 1.0-1.1x tunix's sampler instead of 1.5x
(issue 26). So the run chooses on its own host (`sampler.decode_options`):

  'auto'      on CPU, the choice cached for this host, else measured now (seconds: each option
              set timed at the two row counts the engine decodes, in alternating rounds; per row
              count the set whose fastest round is fastest) and cached; off CPU the built-in one
              (these are XLA:CPU options);
  'builtin'   the built-in choice, nothing measured;
  NAME        one of DECODE_OPTION_SETS for every row count; 'LARGE,SMALL' one for each.

The cache is a JSON file next to the persistent compilation cache (`host_choices_path`), keyed by
what the choice depends on (`host_key`): CPU model and usable cores, backend and device kind,
jaxlib version, and the decode shape (model dimensions, slots, cache length, steps per call).

A measurement made while other processes kept the host busy can cache a worse choice (on the AMD
host, one taken beside other benchmarks chose `xla_defaults` for 64 rows, 5.19 against 6.28 ms,
where a quiet measurement chose `fast_minmax`, 4.11 against 4.92). So each measurement records
the share of the host's CPU time that *other* processes used while it ran (`other_cpu_share`), and
a cached choice measured under load (share > `BUSY_SHARE`) is measured again at a later start
when the host is quieter than it was then (`should_remeasure`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from typing import Any

import jax

from jaxrl_agent.sampling import engine as engine_lib

REGIMES = ("large", "small")  # above SMALL_DECODE_ROWS decoded rows, at most
BUSY_SHARE = 0.25  # other processes' share of the host's CPU time above which a measurement is 'under load'
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """The decode loop's option sets by name, and how they were chosen."""

    large: str
    small: str
    source: str  # 'builtin' | 'config' | 'measured' | 'measured again' | 'cached' | 'builtin (off CPU)'
    milliseconds: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # regime -> name -> ms/step
    seconds: float = 0.0  # spent measuring
    other_cpu_share: float | None = None  # other processes' share of the host's CPU while measured (None: unknown)

    @property
    def options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return engine_lib.DECODE_OPTION_SETS[self.large], engine_lib.DECODE_OPTION_SETS[self.small]

    def describe(self) -> str:
        load = (f", measured under load: other processes {self.other_cpu_share:.0%} of the CPU"
                if self.other_cpu_share is not None and self.other_cpu_share > BUSY_SHARE else "")
        return f"large={self.large} small={self.small} ({self.source}{load})"


def parse_setting(setting: str) -> tuple[str, str] | None:
    """`sampler.decode_options` as (large, small) names; None for 'auto'. Raises ValueError naming
    the value and what is expected."""
    value = str(setting).strip()
    if value == "auto":
        return None
    if value == "builtin":
        return engine_lib.BUILTIN_DECODE_OPTIONS
    names = [n.strip() for n in value.split(",")]
    if len(names) in (1, 2) and all(n in engine_lib.DECODE_OPTION_SETS for n in names):
        return (names[0], names[-1])
    raise ValueError(f"sampler.decode_options={setting!r}: expected 'auto', 'builtin', one of "
                     f"{sorted(engine_lib.DECODE_OPTION_SETS)} or 'LARGE,SMALL' of them")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_busy_seconds() -> float | None:
    """CPU seconds all processes on the host have used since boot (/proc/stat: all but idle and
    iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuShareOfOthers:
    """Measures, between `start()` and `share()`, the fraction of the host's CPU time used by
    processes other than this one:

        share = (host busy seconds - this process's CPU seconds) / (wall seconds x host CPUs),

    clipped to [0, 1]; None where /proc/stat is unavailable. A measurement of speed is disturbed by
    exactly this (this process's own threads are what is being timed)."""

    def start(self) -> CpuShareOfOthers:
        self._host, self._own, self._wall = _host_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
        return self

    def share(self) -> float | None:
        host = _host_busy_seconds()
        if host is None or self._host is None:
            return None
        wall = time.perf_counter() - self._wall
        if wall <= 0:
            return None
        others = (host - self._host) - (_own_cpu_seconds() - self._own)
        return min(max(others / (wall * (os.cpu_count() or 1)), 0.0), 1.0)


def other_cpu_share(seconds: float = 0.25) -> float | None:
    """Other processes' share of the host's CPU over the next `seconds` (this process sleeping)."""
    probe = CpuShareOfOthers().start()
    time.sleep(seconds)
    return probe.share()


def should_remeasure(cached_share: float | None, current_share: float | None, busy: float = BUSY_SHARE) -> bool:
    """Whether a cached choice is measured again: it was measured under load (others' share of
    the CPU above `busy`) and the host is now quieter than it was then (at most half that share,
    and under `busy`). Unknown loads never trigger a new measurement."""
    if cached_share is None or current_share is None:
        return False
    return cached_share > busy and current_share <= min(cached_share / 2, busy)


def host_key(engine) -> str:
    """What the fastest option set depends on: the host, the XLA build and the decode shape."""
    import jaxlib

    c = engine.config
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "|".join(str(x) for x in (
        _cpu_model(), f"{cores} cores", jax.default_backend(), jax.local_devices()[0].device_kind,
        f"jaxlib {jaxlib.__version__}", f"L{c.num_layers} d{c.hidden_size} h{c.num_heads}/{c.num_kv_heads}x{c.head_dim}"
        f" mlp{c.intermediate_size} v{c.vocab_size} {c.dtype}", f"slots {engine.max_concurrent_decodes}",
        f"cache {engine.max_cache_length}", f"steps {engine.steps_per_call}-{engine.max_steps_per_call}"))


def host_choices_path(compilation_cache_dir: str | None) -> str | None:
    """The cache of host choices: `host_choices.json` beside the compilation cache's folder
    (JAX_COMPILATION_CACHE_DIR wins, as for the compilation cache); None = no cache."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or compilation_cache_dir
    if not folder:
        return None
    folder = os.path.abspath(os.path.expanduser(folder)).rstrip(os.sep)
    return os.path.join(os.path.dirname(folder), "host_choices.json")


def _read_cache(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as err:  # a damaged cache is measured again, not fatal
        _log.warning("host choices cache %s unreadable (%s); measuring again", path, err)
        return {}


def _write_cache(path: str | None, key: str, entry: dict) -> None:
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    except OSError as err:  # the choice stands for this run; only the cache is lost
        _log.warning("could not write the host choices cache %s: %s", path, err)


def measure(engine, *, rounds: int = 3, calls: int = 2) -> dict[str, dict[str, float]]:
    """{regime: {option set: fastest round's ms per decode step}} on this host: 'small' at the
    fewest rows the engine decodes, 'large' at all its slots (when that is more than
    SMALL_DECODE_ROWS); the sets alternate within each round, so drift in the machine's state falls
    on all alike, and the fastest round of each counts (other work on the machine only ever adds
    time, so the minimum is the least disturbed estimate of what a set costs)."""
    rows = {"small": engine.decode_rows(1)}
    if engine.max_concurrent_decodes > engine_lib.SMALL_DECODE_ROWS:
        rows["large"] = engine.max_concurrent_decodes
    times: dict[str, dict[str, list[float]]] = {r: {n: [] for n in engine_lib.DECODE_OPTION_SETS} for r in rows}
    for _ in range(rounds):
        for regime, n_rows in rows.items():
            for name, options in engine_lib.DECODE_OPTION_SETS.items():
                times[regime][name].append(1e3 * engine.decode_step_seconds(options, n_rows, calls=calls))
    return {regime: {name: min(ts) for name, ts in by_name.items()} for regime, by_name in times.items()}


def choose_decode_options(engine, setting: str = "auto", *, cache_path: str | None = None,
                          rounds: int = 3) -> DecodeChoice:
    """The decode option sets for `engine` by `setting` (see the module docstring)."""
    names = parse_setting(setting)
    if names is not None:
        return DecodeChoice(*names, source="builtin" if str(setting).strip() == "builtin" else "config")
    if jax.default_backend() != "cpu":
        return DecodeChoice(*engine_lib.BUILTIN_DECODE_OPTIONS, source="builtin (off CPU)")
    key = host_key(engine)
    cached = _read_cache(cache_path).get(key)
    source = "measured"
    if isinstance(cached, dict) and all(cached.get(r) in engine_lib.DECODE_OPTION_SETS for r in REGIMES):
        share = cached.get("other_cpu_share")
        share = float(share) if isinstance(share, (int, float)) else None
        if not (share is not None and share > BUSY_SHARE and should_remeasure(share, other_cpu_share())):
            return DecodeChoice(cached["large"], cached["small"], source="cached",
                                milliseconds=cached.get("milliseconds", {}), other_cpu_share=share)
        source = "measured again"  # the cached choice was measured under load
    start = time.perf_counter()
    probe = CpuShareOfOthers().start()
    ms = measure(engine, rounds=rounds)
    share = probe.share()
    best = {regime: min(by_name, key=by_name.get) for regime, by_name in ms.items()}
    choice = DecodeChoice(best.get("large", engine_lib.BUILTIN_DECODE_OPTIONS[0]), best["small"], source=source,
                          milliseconds=ms, seconds=time.perf_counter() - start, other_cpu_share=share)
    _write_cache(cache_path, key, {"large": choice.large, "small": choice.small, "milliseconds": ms,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": choice.seconds,
                                   "other_cpu_share": share})
    return choice


def tune_engine(engine, setting: str = "auto", *, cache_path: str | None = None) -> DecodeChoice:
    """Chooses the decode option sets (`choose_decode_options`), puts them into the engine, and
    records the choice on it (`engine.decode_choice`); logged once."""
    choice = choose_decode_options(engine, setting, cache_path=cache_path)
    engine.set_decode_compiler_options(*choice.options)
    engine.decode_choice = choice
    _log.info("decode options: %s%s", choice.describe(),
              f", measured in {choice.seconds:.1f} s: {choice.milliseconds}" if choice.source.startswith("measured") else "")
    return choice
