"""Environment steps per second: in-process stepping vs EnvPool with 1, 2 and 4 workers.

  python benchmarks/env_pool_throughput.py [--seconds 2] [--repeats 3] [--concurrency 16]

Scripted-expert episodes run back to back; the pool is driven by `concurrency` threads (episodes in
flight). Medians over repeats; ratios are against in-process stepping measured in the same run.
`calculator` steps cost microseconds (the pool's IPC dominates); `code` steps run a sandboxed
subprocess (~0.1 s), where worker parallelism pays.
"""

import argparse
import statistics
import threading
import time

from jaxrl_agent import envs
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--envs", default="calculator,code")
    args = parser.parse_args()
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
