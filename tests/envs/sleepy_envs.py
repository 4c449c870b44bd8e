"""A test environment whose steps hang (`sleepy`: each step sleeps SLEEP_SECONDS), registered on
import; env-server subprocesses import it with `--import sleepy_envs` (tests/envs on PYTHONPATH)."""

import time

from jaxrl_agent.envs import api
from jaxrl_agent.envs.calculator import CalculatorEnv, expert

SLEEP_SECONDS = 20.0


class SleepyCalculator(CalculatorEnv):
    name = "sleepy"

    def step(self, action):
        time.sleep(SLEEP_SECONDS)
        return super().step(action)


api.register("sleepy", SleepyCalculator, expert=expert, overwrite=True)
