"""The process's heaps during a run: Python's long-lived objects kept out of the cyclic garbage
collector, and the C heap kept mapped between steps.

A run builds a large, long-lived heap before its loops start (JAX and Flax, compiled functions,
environments, the replay buffer), and CPython's cyclic collector walks all of it at every
oldest-generation collection. On the tiny default that was 0.2-0.36 s a collection, one every
~13 s of RL (every ~8 iterations: the iterations whose sampling took ~0.4 s longer), ~3% of
RL's wall time (benchmarks/RESULTS.md). `frozen_heap()` collects once and then freezes what
exists (`gc.freeze`), so later collections walk only the objects made since: the loops' own
garbage is still collected as before. Inside it, `freeze_built()` adds what a stage built before
its loop (the learner, the rollout source) to the frozen objects.

XLA:CPU allocates each execution's temporary buffer (all of a program's intermediates, 40-400 MB
for the default's learner and SFT steps) with `malloc` and frees it when the execution ends.
glibc serves every request over its mmap threshold (at most 32 MB) from a fresh `mmap` and
returns it at `free`, so each step first-touches its whole temporary buffer again, one page fault
per 4 KiB page: ~39,000 faults a step on the learner benchmark's shape, 16-22% of the learner
and SFT steps on this project's hosts (benchmarks/RESULTS.md). `reuse_freed_memory()` makes
glibc keep freed memory for the next request instead (no mmap, no trim of the main heap), and
`set_host_allocator('reuse')` also runs CPU computations on the thread that calls them (JAX's
`jax_cpu_enable_async_dispatch=False`): the trainer's steps are called from the main thread, whose
heap (glibc's main arena) can hold buffers of any size, where a worker thread's arena would
still mmap anything over 64 MB. (One arena for all threads, `M_ARENA_MAX=1`, did the same for the
learner but slowed the sampler by ~20%: its threads then contend for one lock.)
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import platform
import sys


_open_blocks = 0  # `frozen_heap` blocks being run (in this process)


@contextlib.contextmanager
def frozen_heap():
    """Collects, then freezes every object that exists now for the duration of the block and
    unfreezes them after it (they become collectable again). A heap the caller had already frozen
    is left frozen."""
    global _open_blocks
    already_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    _open_blocks += 1
    try:
        yield
    finally:
        _open_blocks -= 1
        if not already_frozen:
            gc.unfreeze()


def freeze_built() -> None:
    """Inside `frozen_heap()`: collects, then freezes every object that exists now as well (the
    parts a stage built before its loop); `frozen_heap` unfreezes them with the rest. Outside one
    (e.g. `trainer.run_rl` called on its own) it does nothing: nothing would unfreeze them."""
    if _open_blocks > 0:
        gc.collect()
        gc.freeze()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_INT_MAX = 2**31 - 1
HOST_ALLOCATORS = ("reuse", "system")


def reuse_freed_memory() -> bool:
    """Sets glibc's malloc to serve requests of the main heap (the main thread's) without mmap and
    never to trim it: a freed buffer is reused by the next request of its size instead of being
    unmapped and faulted in again page by page (`mallopt(M_MMAP_MAX, 0)`,
    `mallopt(M_TRIM_THRESHOLD, INT_MAX)`). Memory a step frees stays resident for the next one.
    Returns False, changing nothing, where the C library is not glibc (macOS, musl) or a setting
    is refused."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX)))


def set_host_allocator(kind: str) -> bool:
    """`config.host_allocator`. 'reuse': `reuse_freed_memory()` and, where it took effect, CPU
    computations run on the thread that calls them (`jax_cpu_enable_async_dispatch=False`), so
    the main thread's steps allocate from the main heap; call it before the first computation.
    'system': the C library's and JAX's defaults (nothing changed). Returns whether anything
    was changed."""
    if kind not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={kind!r}: expected one of {HOST_ALLOCATORS}")
    if kind == "system" or not reuse_freed_memory():
        return False
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
