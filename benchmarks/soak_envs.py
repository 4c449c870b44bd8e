"""Environments for the fault-injection soak (`benchmarks/soak.py`): the calculator, where the first
step of one RL task in `HANG_EVERY` (every episode of its group) hangs past any step timeout.
Registered on import (`--config.env.imports=soak_envs`, with benchmarks/ on PYTHONPATH);
$JAXRL_SOAK_HANG_EVERY overrides HANG_EVERY."""

import os
import time

from jaxrl_agent.envs import api
from jaxrl_agent.envs.calculator import CalculatorEnv, expert

HANG_EVERY = int(os.environ.get("JAXRL_SOAK_HANG_EVERY", 400))  # ~1 task in 6 RL iterations of 64
HANG_SECONDS = 60.0


class HangingSometimesCalculator(CalculatorEnv):
    name = "calc_soak"

    def step(self, action):
        seed = int(self.task.id.rsplit("/", 1)[1])
        # RL's own tasks only (seeds below the held-out and demonstration ranges, which start at 10**6).
        if self._turns == 0 and seed < 10**6 and seed % HANG_EVERY == HANG_EVERY - 1:
            time.sleep(HANG_SECONDS)  # the pool's step timeout replaces the worker
        return super().step(action)


api.register("calc_soak", HangingSometimesCalculator, expert=expert, overwrite=True)
