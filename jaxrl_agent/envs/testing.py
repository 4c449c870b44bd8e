"""`faulty`: a fault-injection environment for testing environment services (not registered by
default; `import jaxrl_agent.envs.testing` or pass it in `EnvPool(imports=...)`).

Actions: 'count' -> the number of steps so far (state that a replay must restore); 'crash' ->
the process exits; 'hang' -> sleeps forever; 'oom' -> allocates 64 GiB; 'raise' -> the
environment raises; 'sleep:S' -> sleeps S seconds, then counts; 'done' -> ends the episode.
"""

from __future__ import annotations

import os
import time

from jaxrl_agent.envs import api


class FaultyEnv(api.Environment):
    name = "faulty"

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        return api.Task(id=f"faulty/{seed}", env=self.name, prompt="fault injection", tools=(), verifier={},
                        difficulty=difficulty)

    def reset(self, task, seed=0):
        self._steps = 0
        return api.Observation(text=f"pid={os.getpid()}", role="user")

    def step(self, action: str) -> api.Step:
        if action == "crash":
            os._exit(1)
        if action == "hang":
            while True:
                time.sleep(1)
        if action == "oom":
            blob = bytearray(64 * 1024**3)
            return api.Step(api.Observation(str(len(blob))), 0.0, False, {})
        if action == "raise":
            raise RuntimeError("the environment failed")
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        self._steps += 1
        done = action == "done"
        info = {"finish_reason": "answer", "success": True} if done else {}
        return api.Step(api.Observation(f"count={self._steps}"), 1.0 if done else 0.0, done, info)


api.register(FaultyEnv.name, FaultyEnv, overwrite=True)
