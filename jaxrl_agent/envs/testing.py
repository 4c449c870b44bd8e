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


class ToolLatency(api.Environment):
    """Wraps an environment so that every step that is not the final answer waits a heavy-tailed
    time, as real tools (search, code execution, remote APIs) do: a Pareto(alpha) draw scaled so
    that its median is `median_s`, capped at `max_s`. Deterministic per (task, seed, step).

    Steps block (time.sleep), like a real tool client; episodes run them off the event loop (see
    `rollout.InProcessEnv(executor=...)`).
    """

    def __init__(self, env: api.Environment, median_s: float, alpha: float = 1.2, max_s: float = 10.0):
        if median_s < 0 or alpha <= 0 or max_s < 0:
            raise ValueError(f"ToolLatency needs median_s >= 0, alpha > 0, max_s >= 0; got {median_s}, {alpha}, {max_s}")
        self.env, self.median_s, self.alpha, self.max_s = env, median_s, alpha, max_s
        self.name = env.name
        self.total_sleep_s = 0.0

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        return self.env.sample_task(seed, difficulty)

    def latency(self, u: float) -> float:
        """Pareto quantile for u in (0, 1): median_s * ((1 - u) ** (-1/alpha)) / 2 ** (1/alpha)."""
        scale = self.median_s / 2 ** (1 / self.alpha)
        return min(self.max_s, scale * (1.0 - u) ** (-1.0 / self.alpha))

    def reset(self, task, seed=0):
        import random

        self._rng = random.Random(f"{task.id}/{seed}")
        return self.env.reset(task, seed)

    def step(self, action: str) -> api.Step:
        step = self.env.step(action)
        if not step.done:
            delay = self.latency(self._rng.random())
            self.total_sleep_s += delay
            time.sleep(delay)
        return step

    def close(self) -> None:
        self.env.close()
