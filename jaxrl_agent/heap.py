"""The Python heap during a run: the long-lived objects kept out of the cyclic garbage collector.

A run builds a large, long-lived heap before its loops start (JAX and Flax, compiled functions,
environments, the replay buffer), and CPython's cyclic collector walks all of it at every
oldest-generation collection. On the tiny default that was 0.2-0.36 s a collection, one every
~13 s of RL (every ~8 iterations: the iterations whose sampling took ~0.4 s longer), ~3% of
RL's wall time (benchmarks/RESULTS.md). `frozen_heap()` collects once and then freezes what
exists (`gc.freeze`), so later collections walk only the objects made since: the loops' own
garbage is still collected as before. Inside it, `freeze_built()` adds what a stage built before
its loop (the learner, the rollout source) to the frozen objects.
"""

from __future__ import annotations

import contextlib
import gc


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
