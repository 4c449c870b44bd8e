"""The run's heaps: long-lived objects leave the collector's walks, garbage made later is still
collected, and the freeze is undone afterwards; the C heap keeps a step's temporary buffer mapped."""

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import weakref

import pytest

from jaxrl_agent import build, config_lib, heap


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_freezes_what_exists_and_unfreezes_after():
    gc.unfreeze()
    before = _Node()
    with heap.frozen_heap():
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        # Garbage made inside the block is still collected.
        cycle = _Node()
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
        # freeze_built adds what exists now (here: `after`) to the frozen objects.
        after = [_Node() for _ in range(100)]
        heap.freeze_built()
        assert gc.get_freeze_count() >= frozen + len(after)
    assert gc.get_freeze_count() == 0
    # Frozen objects are collectable again once unfrozen.
    alive = weakref.ref(before)
    del before, after
    gc.collect()
    assert alive() is None


def test_a_heap_frozen_by_the_caller_stays_frozen():
    gc.unfreeze()
    gc.freeze()
    try:
        with heap.frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_freeze_built_outside_a_frozen_heap_freezes_nothing():
    gc.unfreeze()
    heap.freeze_built()
    assert gc.get_freeze_count() == 0


# ------------------------------------------------------------------------------ the C heap
_ALLOCATION_PROBE = r'''
import json, resource, sys
from jaxrl_agent import heap
changed = heap.set_host_allocator(sys.argv[1])
import jax, jax.numpy as jnp
x, w = jnp.ones((4096, 2048), jnp.float32), jnp.ones((2048, 8), jnp.float32)

@jax.jit
def f(x, w):
    a = jnp.sin(x) * 2.0  # a 32 MB intermediate (XLA's temporary buffer), read by two products
    return (a @ w).sum() + (a.T @ jnp.ones((4096, 8))).sum()

for _ in range(3):  # compiled, and the heap grown to hold the temporary buffer
    f(x, w).block_until_ready()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"changed": changed, "faults": faults}))
'''


def _page_faults_per_call(allocator: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ALLOCATION_PROBE, allocator], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_reuse_keeps_a_steps_temporary_buffer_mapped_between_calls():
    # The C library's defaults: the 32 MB temporary buffer is mmapped per call and faulted in
    # again, one fault per 4 KiB page (~8,000); `reuse` serves it from memory freed by the calls
    # before (a call now and then still grows the heap: medians). One device, as the launcher runs.
    system = _page_faults_per_call("system")
    reuse = _page_faults_per_call("reuse")
    assert system["changed"] is False and reuse["changed"] is True
    assert statistics.median(system["faults"]) > 4000, system
    assert statistics.median(reuse["faults"]) < 200, reuse


def test_a_bad_host_allocator_is_named():
    with pytest.raises(ValueError, match=r"host_allocator='tcmalloc': expected one of \('reuse', 'system'\)"):
        heap.set_host_allocator("tcmalloc")
    config = config_lib.load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                                 "calculator_tiny.py"))
    assert config.host_allocator == "reuse"
    config.host_allocator = "jemalloc"
    with pytest.raises(build.ConfigError, match=r"host_allocator='jemalloc': expected one of"):
        build.validate_config(config)


_LAUNCHER_PROBE = r'''
import sys
import jax
from jaxrl_agent.cli import train
try:
    train.run(["train", "--mode", "smoke", "--config", "configs/calculator_tiny.py",
               "--config.host_allocator=" + sys.argv[1]])
except SystemExit:
    pass
print("async_dispatch", jax.config.values["jax_cpu_enable_async_dispatch"])
'''


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
@pytest.mark.parametrize("allocator,async_dispatch", [("reuse", False), ("system", True)])
def test_the_launcher_sets_the_configs_host_allocator(allocator, async_dispatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _LAUNCHER_PROBE, allocator], capture_output=True, text=True,
                         timeout=300, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "forward pass ok" in out.stdout, out.stdout[-2000:]
    assert f"async_dispatch {async_dispatch}" in out.stdout, out.stdout[-2000:]
