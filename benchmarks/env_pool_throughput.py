"""Environment steps per second: in-process stepping vs EnvPool, driven by threads and by the
rollout's event loop.

  python benchmarks/env_pool_throughput.py [--seconds 2] [--repeats 3] [--concurrency 16]
      [--tables threads,event_loop] [--episodes 256] [--rounds 7]

Table 1 ("threads"): scripted-expert episodes back to back; the pool is driven by `concurrency`
threads (episodes in flight), with 1, 2 and 4 workers. Medians over repeats; ratios against
in-process stepping in the same run. `calculator` steps cost microseconds (the pool's IPC
dominates); `code` steps run a sandboxed subprocess (~0.1 s), where worker parallelism pays.

Table 2 ("event_loop"): what the rollout does — `episodes` episodes at once as coroutines on one
asyncio loop (reset, expert steps, close), through the same adapters the trainer builds
(`rollout.InProcessEnv`, `rollout.ServiceEnv`). Four ways, rounds alternated: in process on the loop
(the library's pure environments under `env.service='auto'`), in process on a thread with a
watchdog (any other environment in process), the pool through its coroutines (`EnvPool.astep`...:
the pipe read on the loop), and the pool through blocking calls in threads (`asyncio.to_thread`, as
for a service without coroutines). It reports the wall time per batch, this process's CPU time (the
trainer's side: what competes with the sampler's lanes) and the workers' CPU time, medians over
rounds, and each mode's wall time against the loop's.
"""

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import threading
import time

from jaxrl_agent import envs
from jaxrl_agent import rollout
from jaxrl_agent.envs import pool as pool_lib


def _episode_loop(step_fn, reset_fn, env_name, stop, counter, offset):
    env = envs.make(env_name)
    expert = envs.expert_policy(env_name)
    seed = offset
    while not stop.is_set():
        task = env.sample_task(seed, env.difficulties[0])
        seed += 1000
        handle, first = reset_fn(task)
        observations, actions = [first.text], []
        while not stop.is_set():
            actions.append(expert(task, observations, actions))
            step = step_fn(handle, actions[-1])
            counter[offset] += 1
            observations.append(step.observation.text)
            if step.done:
                break


def in_process(env_name, seconds, concurrency):
    del concurrency  # one thread: the GIL makes more threads slower in-process
    env = envs.make(env_name)
    stop, counter = threading.Event(), {0: 0}

    def reset_fn(task):
        return env, env.reset(task)

    timer = threading.Timer(seconds, stop.set)
    timer.start()
    _episode_loop(lambda e, a: e.step(a), reset_fn, env_name, stop, counter, 0)
    return counter[0] / seconds


def pooled(env_name, seconds, concurrency, workers):
    with pool_lib.EnvPool(workers, step_timeout_s=60) as pool:
        pool.reset(env_name, envs.make(env_name).sample_task(0, 1))  # workers are up
        stop = threading.Event()
        counter = {i: 0 for i in range(concurrency)}
        reset_fn = lambda task: pool.reset(env_name, task)
        threads = [threading.Thread(target=_episode_loop, args=(pool.step, reset_fn, env_name, stop, counter, i))
                   for i in range(concurrency)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return sum(counter.values()) / seconds


class _BlockingCallsOnly:
    """A service's blocking calls without its coroutines: `rollout.ServiceEnv` then runs each call
    in a thread (`asyncio.to_thread`), as it does for a service that has no coroutines."""

    def __init__(self, service):
        self.reset, self.step, self.close_episode = service.reset, service.step, service.close_episode


def _process_cpu_seconds(pids) -> float:
    """User + system CPU seconds of processes `pids`, from /proc (Linux)."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _loop_episode(make_adapter, env_name, local_env, expert, seed) -> int:
    task = local_env.sample_task(seed, local_env.difficulties[seed % len(local_env.difficulties)])
    adapter = make_adapter()
    first = await adapter.reset(task, seed)
    observations, actions = [first.text], []
    while True:
        actions.append(expert(task, observations, actions))
        step = await adapter.step(actions[-1])
        observations.append(step.observation.text)
        if step.done:
            break
    await adapter.close()
    return len(actions)


def event_loop_table(env_name: str, episodes: int, rounds: int, workers: int):
    """Rows (mode, wall s, trainer CPU s, worker CPU s, steps) per batch of `episodes`, medians of
    `rounds` alternated rounds."""
    local_env, expert = envs.make(env_name), envs.expert_policy(env_name)
    executor = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="env")
    pool = pool_lib.EnvPool(workers, step_timeout_s=60)
    modes = {
        "in process, on the loop": (lambda: rollout.InProcessEnv(envs.make(env_name)), False),
        "in process, thread + watchdog": (
            lambda: rollout.InProcessEnv(envs.make(env_name), executor=executor, step_timeout_s=60), False),
        f"pool ({workers} workers), coroutine calls": (lambda: rollout.ServiceEnv(pool, env_name), True),
        f"pool ({workers} workers), calls in threads": (
            lambda: rollout.ServiceEnv(_BlockingCallsOnly(pool), env_name), True),
    }
    loop = asyncio.new_event_loop()

    async def batch(make_adapter, base):
        steps = await asyncio.gather(*(_loop_episode(make_adapter, env_name, local_env, expert, base + i)
                                       for i in range(episodes)))
        return sum(steps)

    samples = {name: [] for name in modes}
    try:
        for name, (make_adapter, _) in modes.items():  # warm-up: workers up, code paths imported
            loop.run_until_complete(batch(make_adapter, 0))
        for r in range(rounds):
            order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
            for name, (make_adapter, in_pool) in order:
                pids = pool.worker_pids() if in_pool else []
                cpu0, workers0, t0 = time.process_time(), _process_cpu_seconds(pids), time.perf_counter()
                steps = loop.run_until_complete(batch(make_adapter, 10_000 * (r + 1)))
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                # Workers' CPU: none in process; unknown if a worker was replaced during the round.
                worker_cpu = (_process_cpu_seconds(pids) - workers0 if pids and pids == pool.worker_pids()
                              else float("nan"))
                samples[name].append((wall, cpu, worker_cpu, steps))
    finally:
        loop.close()
        pool.close()
        executor.shutdown(wait=False)
    return [(name, *(statistics.median(s[i] for s in rows) for i in range(4))) for name, rows in samples.items()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--envs", default="calculator,code")
    parser.add_argument("--tables", default="threads,event_loop", help="which tables: threads, event_loop")
    parser.add_argument("--episodes", type=int, default=256, help="event_loop table: episodes at once")
    parser.add_argument("--rounds", type=int, default=7, help="event_loop table: alternated rounds")
    parser.add_argument("--workers", type=int, default=2, help="event_loop table: pool workers")
    parser.add_argument("--loop_envs", default="calculator", help="event_loop table: environments")
    args = parser.parse_args()
    tables = set(args.tables.split(","))
    if not tables <= {"threads", "event_loop"}:
        parser.error(f"--tables={args.tables!r}: expected a comma-separated subset of threads,event_loop")
    if "threads" in tables:
        threads_table(args)
    if "event_loop" in tables:
        print(f"\n| env | mode (event loop, {args.episodes} episodes at once) | wall ms per batch | "
              f"trainer CPU ms | worker CPU ms | steps | wall vs on the loop |")
        print("|---|---|---|---|---|---|---|")
        for env_name in args.loop_envs.split(","):
            rows = event_loop_table(env_name, args.episodes, args.rounds, args.workers)
            base = rows[0][1]
            for name, wall, cpu, worker_cpu, steps in rows:
                worker = "-" if worker_cpu != worker_cpu else f"{1e3 * worker_cpu:.0f}"
                print(f"| {env_name} | {name} | {1e3 * wall:.1f} | {1e3 * cpu:.1f} | {worker} | {steps:.0f} | "
                      f"{wall / base:.2f} |", flush=True)


def threads_table(args):
    print(f"| env | mode | steps/s (median of {args.repeats}) | vs in-process |")
    print("|---|---|---|---|")
    for env_name in args.envs.split(","):
        base = statistics.median(in_process(env_name, args.seconds, args.concurrency) for _ in range(args.repeats))
        print(f"| {env_name} | in-process | {base:,.0f} | 1.00 |", flush=True)
        for workers in (1, 2, 4):
            rate = statistics.median(pooled(env_name, args.seconds, args.concurrency, workers)
                                     for _ in range(args.repeats))
            print(f"| {env_name} | pool, {workers} worker{'s' if workers > 1 else ''} | {rate:,.0f} | "
                  f"{rate / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
