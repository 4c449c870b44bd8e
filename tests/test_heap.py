"""The run's heap freezing: long-lived objects leave the collector's walks, garbage made later is
still collected, and the freeze is undone afterwards."""

import gc
import weakref

from jaxrl_agent import heap


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
