"""Running a call in an already-compiled larger shape instead of compiling its own (ski rental).

Every distinct shape of a jitted program compiles once, and on a cold start those compiles are a
large part of a short run (120 RL iterations of the default run on a 2-core AMD EPYC compiled 82 s
of programs, ~3.6 s per learner-step shape; benchmarks/RESULTS.md). Many shapes are wanted only a
few times in a run (a row count that one RL minibatch in fifty packs into, an extend of a rare
length). `ShapeReuse` pads such a call up to a compiled shape at least as large in every
dimension, and keeps account of what the padding costs: in calls of the wanted shape,
(work(padded) / work(wanted) - 1) per call, work being the product of the dimensions. Once a
wanted shape has spent `compile_calls` calls' worth of padding, it is compiled like any other (the
ski-rental rule: the padding paid never exceeds one compile's cost, set in calls, so a shape
wanted often costs at most twice what compiling it at once would, and one wanted rarely is never
compiled).

The choice depends on the sequence of wanted shapes alone, never on timing: a run's shapes are
reproducible, and processes that see the same (agreed) shapes choose alike. Callers pad with
what trains or samples nothing: the learner's padding rows and target columns
(`learner.global_batch`), the engine's dropped rows, tokens past a prompt and cache positions past
the live requests (`AgentEngine._program_shape`).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence


class ShapeReuse:
    """Chooses the shape to run a call in.

    Args:
      compile_calls: what compiling a new shape costs, in calls of that shape: a shape is run
        padded (in the cheapest compiled shape that holds it) until its padding has cost this many
        calls, then compiled. 0 = every wanted shape is its own (compiled on first use).
    """

    def __init__(self, compile_calls: float):
        if not compile_calls >= 0:
            raise ValueError(f"compile_calls={compile_calls}: expected >= 0 (0 = compile every shape)")
        self.compile_calls = float(compile_calls)
        self.compiled: set[tuple[int, ...]] = set()
        self.padding: dict[tuple[int, ...], float] = {}  # calls' worth of padding spent per wanted shape
        self.padded_calls = 0  # calls run in a larger shape than wanted
        self._lock = threading.Lock()

    @staticmethod
    def work(shape: Sequence[int]) -> int:
        """A call's cost in a shape, up to a constant: the product of its dimensions (0 counts as 1:
        an absent dimension)."""
        return math.prod(max(int(d), 1) for d in shape)

    def choose(self, wanted: Sequence[int]) -> tuple[int, ...]:
        """The shape to run a call that needs `wanted` in: `wanted` itself, or a compiled shape at
        least as large in every dimension (the least work of those) while `wanted`'s padding so far
        plus this call's stays below `compile_calls` calls of it."""
        wanted = tuple(int(d) for d in wanted)
        with self._lock:
            if wanted in self.compiled:
                return wanted
            holders = [s for s in self.compiled if len(s) == len(wanted) and all(a >= b for a, b in zip(s, wanted))]
            if holders:
                best = min(holders, key=lambda s: (self.work(s), s))
                spent = self.padding.get(wanted, 0.0) + self.work(best) / self.work(wanted) - 1.0
                if spent < self.compile_calls:
                    self.padding[wanted] = spent
                    self.padded_calls += 1
                    return best
            self.compiled.add(wanted)
            return wanted
