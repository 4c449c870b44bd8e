"""Environments for the fault-injection soak (`benchmarks/soak.py`): the calculator, with one step in
`HANG_EVERY` hanging past any step timeout. Registered on import (`--config.env.imports=soak_envs`,
with benchmarks/ on PYTHONPATH)."""

import time

from jaxrl_agent.envs import api
from jaxrl_agent.envs.calculator import CalculatorEnv, expert

HANG_EVERY = 40
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
