"""Fault isolation of the environment service, locally and over loopback TCP."""

import asyncio
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxrl_agent import envs
from jaxrl_agent.envs import pool as pool_lib, remote, testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = testing.FaultyEnv().sample_task(0, 1)


@pytest.fixture(scope="module")
def local_pool():
    with pool_lib.EnvPool(2, step_timeout_s=2.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        yield p


@pytest.fixture(scope="module")
def remote_pool():
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "env_server.py"), "--port", "0", "--workers", "2",
         "--step_timeout_s", "2", "--worker_memory_mb", "1024", "--import", "jaxrl_agent.envs.testing"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", line).group(1))
    client = remote.RemoteEnvPool("127.0.0.1", port, timeout_s=30)
    yield client
    client.close()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(params=["local", "remote"])
def service(request):
    return request.getfixturevalue(f"{request.param}_pool")


def _open(service, n):
    return [service.reset("faulty", TASK)[0] for _ in range(n)]


def _count(service, episode):
    step = service.step(episode, "count")
    assert not step.done, step.info
    return int(step.observation.text.split("=")[1])


@pytest.mark.parametrize("fault, reason", [("crash", "env_crash"), ("hang", "env_timeout"), ("oom", "env_crash")])
def test_fault_ends_only_that_episode(service, fault, reason):
    episodes = _open(service, 4)  # two per worker
    for e in episodes:
        assert _count(service, e) == 1
    step = service.step(episodes[0], fault)
    assert step.done and step.info["finish_reason"] == reason and not step.info["success"]
    # Every other episode continues with its state intact (replayed where its worker was replaced).
    for e in episodes[1:]:
        assert _count(service, e) == 2
    assert service.num_workers == 2
    with pytest.raises(pool_lib.EnvServiceError, match="unknown or finished episode"):
        service.step(episodes[0], "count")
    for e in episodes[1:]:
        service.close_episode(e)


def test_killing_a_worker_mid_step(service):
    episodes = _open(service, 4)
    for e in episodes:
        _count(service, e)
    pids_before = set(service.worker_pids())
    busy = service.episode_worker_pid(episodes[0])
    result = {}
    slow = threading.Thread(target=lambda: result.setdefault("step", service.step(episodes[0], "sleep:1.5")))
    slow.start()
    time.sleep(0.5)
    os.kill(busy, signal.SIGKILL)  # the worker serving the slow step, mid-step
    slow.join(timeout=10)
    assert result["step"].info["finish_reason"] == "env_crash"
    for e in episodes[1:]:
        assert _count(service, e) == 2
    pids_after = set(service.worker_pids())
    assert len(pids_after) == 2 and busy not in pids_after and pids_after & pids_before


def test_worker_killed_while_idle_is_replaced_without_losing_episodes(service):
    episodes = _open(service, 4)
    for e in episodes:
        _count(service, e)
    for pid in service.worker_pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    for e in episodes:
        assert _count(service, e) == 2  # replayed on fresh workers: nothing lost
    service.ensure_workers()
    assert service.num_workers == 2
    for e in episodes:
        service.close_episode(e)


def test_environment_exception_is_recorded(service):
    (episode,) = _open(service, 1)
    step = service.step(episode, "raise")
    assert step.done and step.info["finish_reason"] == "env_error" and "environment failed" in step.info["error"]


def test_bad_requests_raise_service_errors(service):
    with pytest.raises(pool_lib.EnvServiceError):
        service.reset("no_such_env", TASK)
    with pytest.raises(pool_lib.EnvServiceError):
        service.step("ep_missing", "count")


def test_pool_runs_builtin_envs_with_experts(service):
    env = envs.make("kb_search")
    expert = envs.expert_policy("kb_search")
    for seed in range(3):
        task = env.sample_task(seed, 3)
        episode, first = service.reset("kb_search", task)
        observations, actions = [first.text], []
        while True:
            actions.append(expert(task, observations, actions))
            step = service.step(episode, actions[-1])
            observations.append(step.observation.text)
            if step.done:
                break
        assert step.info["success"]


def test_steps_waiting_while_their_worker_is_replaced_never_share_the_new_one():
    """Steps that waited on a worker slot while its process was replaced (after a hang) and steps
    that arrive just after the replacement take turns on the new process: each gets its own
    episode's reply (the counts differ per episode), none a spurious timeout. Three rounds."""
    with pool_lib.EnvPool(1, step_timeout_s=1.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        for round_ in range(3):
            episodes = _open(p, 7)
            for k, episode in enumerate(episodes[1:], start=1):
                for _ in range(k):
                    _count(p, episode)
            results = {}

            def step(index, action):
                results[index] = p.step(episodes[index], action)

            threads = [threading.Thread(target=step, args=(0, "hang"))]
            threads[0].start()
            time.sleep(0.3)
            for index in (1, 2, 3):  # wait out the hang on the slot
                threads.append(threading.Thread(target=step, args=(index, "count")))
                threads[-1].start()
            assert pool_lib.wait_for(lambda: p.stats["worker_restarts"] == round_ + 1, timeout=10, interval=0.002)
            for index in (4, 5, 6):  # arrive as the worker is replaced
                threads.append(threading.Thread(target=step, args=(index, "count")))
                threads[-1].start()
            for thread in threads:
                thread.join(timeout=60)
            assert not any(thread.is_alive() for thread in threads), "a step never returned"
            assert results[0].info["finish_reason"] == "env_timeout"
            for index in range(1, 7):
                assert not results[index].done, results[index].info
                assert results[index].observation.text == f"count={index + 1}", (round_, index)
            for episode in episodes[1:]:
                p.close_episode(episode)


# --------------------------------------------------------------- the pool's calls on an event loop
def _arun(coroutine):
    return asyncio.run(coroutine)


async def _acount(pool, episode):
    step = await pool.astep(episode, "count")
    assert not step.done, step.info
    return int(step.observation.text.split("=")[1])


@pytest.mark.parametrize("fault, reason", [("crash", "env_crash"), ("hang", "env_timeout"), ("oom", "env_crash")])
def test_coroutine_calls_end_only_the_faulting_episode(local_pool, fault, reason):
    async def scenario():
        episodes = [(await local_pool.areset("faulty", TASK))[0] for _ in range(4)]  # two per worker
        assert await asyncio.gather(*(_acount(local_pool, e) for e in episodes)) == [1, 1, 1, 1]
        step = await local_pool.astep(episodes[0], fault)
        assert step.done and step.info["finish_reason"] == reason and not step.info["success"]
        # The others go on with their state (replayed where their worker was replaced), concurrently.
        assert await asyncio.gather(*(_acount(local_pool, e) for e in episodes[1:])) == [2, 2, 2]
        with pytest.raises(pool_lib.EnvServiceError, match="unknown or finished episode"):
            await local_pool.astep(episodes[0], "count")
        for e in episodes[1:]:
            await local_pool.aclose_episode(e)

    _arun(scenario())
    assert local_pool.num_workers == 2


def test_coroutines_and_threads_take_turns_on_one_worker():
    """Steps from coroutines of two event loops and from plain threads, all on one worker's
    episodes at once: every step gets its own episode's reply (each count is its episode's)."""
    with pool_lib.EnvPool(1, step_timeout_s=5.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        episodes = _open(p, 6)
        counts = {e: [] for e in episodes}

        def threaded(episode):
            for _ in range(20):
                counts[episode].append(_count(p, episode))

        def looped(mine):
            async def steps(episode):
                for _ in range(20):
                    counts[episode].append(await _acount(p, episode))
            async def both():
                await asyncio.wait_for(asyncio.gather(*(steps(e) for e in mine)), 60)
            asyncio.run(both())

        workers = [threading.Thread(target=threaded, args=(e,)) for e in episodes[:2]]
        workers += [threading.Thread(target=looped, args=(episodes[2:4],)), threading.Thread(target=looped, args=(episodes[4:],))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers)
        assert all(counts[e] == list(range(1, 21)) for e in episodes), counts
        assert p.stats["worker_restarts"] == 0


def test_a_cancelled_coroutine_step_loses_no_episode_and_keeps_its_worker():
    """A cancelled step's request still runs in the worker; its reply is dropped (the replies after
    it stay in step with their requests), and its episode is rebuilt from its recorded actions
    before its next step, so the cancelled action never counts."""
    with pool_lib.EnvPool(1, step_timeout_s=5.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        episodes = _open(p, 3)
        for e in episodes:
            assert _count(p, e) == 1
        busy = p.worker_pids()[0]

        async def scenario():
            slow = asyncio.ensure_future(p.astep(episodes[0], "sleep:1"))
            await asyncio.sleep(0.3)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            # Sent while the cancelled one is out: they wait for it, then get their own replies.
            return await asyncio.gather(*(_acount(p, e) for e in episodes[1:]))

        assert _arun(scenario()) == [2, 2]
        assert p.worker_pids() == [busy] and p.stats["worker_restarts"] == 0
        assert _count(p, episodes[0]) == 2 and p.stats["replays"] == 1  # replayed from its one recorded action


@pytest.mark.parametrize("fault, reason", [("crash", "env_crash"), ("hang", "env_timeout")])
def test_a_fault_in_the_middle_of_a_batch_ends_only_its_episode(fault, reason):
    """One batch on one worker: steps before the faulting one keep their replies, the faulting one
    ends its episode, the ones after it (never served) go to the replacement, their episodes
    replayed first; every episode's count stays its own."""
    with pool_lib.EnvPool(1, step_timeout_s=1.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        episodes = _open(p, 6)

        async def scenario():
            first = [await _acount(p, e) for e in episodes]  # one at a time: each episode at count 1
            lead = asyncio.ensure_future(p.astep(episodes[0], "sleep:0.2"))  # out alone; the rest queue behind it
            await asyncio.sleep(0.05)
            batch = [p.astep(e, "count") for e in episodes[1:3]] + [p.astep(episodes[3], fault)] \
                + [p.astep(e, "count") for e in episodes[4:]]
            steps = await asyncio.gather(lead, *batch)
            after = await asyncio.gather(*(_acount(p, e) for e in episodes if e != episodes[3]))
            return first, steps, after

        first, steps, after = _arun(scenario())
        assert first == [1] * 6
        assert [s.observation.text for s in steps[:3]] == ["count=2", "count=2", "count=2"]  # 'sleep:S' counts too
        assert steps[3].done and steps[3].info["finish_reason"] == reason
        assert [s.observation.text for s in steps[4:]] == ["count=2", "count=2"]  # requeued, after a replay
        assert after == [3, 3, 3, 3, 3]
        assert p.stats["worker_restarts"] == 1 and p.stats[reason] == 1


def test_closing_the_pool_under_coroutine_steps_ends_them_all():
    """A pool closed while a batch is out and more wait: every awaiting step ends at once (the one
    out gets its reply or a failed step, the waiting ones the pool's error), none waits for the step
    timeout on a worker that will not come back."""
    p = pool_lib.EnvPool(1, step_timeout_s=30.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"])
    episodes = _open(p, 4)

    async def scenario(action):
        steps = [asyncio.ensure_future(p.astep(e, action)) for e in episodes]
        await asyncio.sleep(0.2)
        start = time.monotonic()
        p.close()
        results = await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), 20)
        return results, time.monotonic() - start

    results, seconds = _arun(scenario("hang"))  # the worker does not finish: killed after 2 s
    assert seconds < 6, seconds
    assert results[0].done and results[0].info["finish_reason"] == "env_crash"
    assert all(isinstance(r, pool_lib.EnvServiceError) for r in results[1:]), results
    assert not any(w.alive() for w in p._workers) and all(w.process.stdout.closed for w in p._workers)


def test_coroutine_steps_on_one_worker_go_out_in_batches():
    """Steps of many episodes awaited together on one worker: fewer writes than requests (later
    ones wait for the batch out, then go together), every reply its own episode's, in order."""
    with pool_lib.EnvPool(1, step_timeout_s=5.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        episodes = _open(p, 48)
        writes = []
        real_write = os.write

        def counting_write(fd, data):
            writes.append(len(data))
            return real_write(fd, data)

        async def scenario():
            counts = []
            for _ in range(3):
                counts.append(await asyncio.gather(*(_acount(p, e) for e in episodes)))
            return counts

        os.write = counting_write
        try:
            counts = _arun(scenario())
        finally:
            os.write = real_write
        assert counts == [[1] * 48, [2] * 48, [3] * 48]
        # 144 requests: each round's first goes out alone, the other 47 (arrived meanwhile) together.
        assert len(writes) <= 6, writes
        assert [_count(p, e) for e in episodes] == [4] * 48


def test_a_request_longer_than_the_pipe_goes_through():
    """A request longer than the worker's pipe holds is written on a thread, alone in its batch; the
    requests queued behind it go out after it, with their own replies."""
    with pool_lib.EnvPool(1, step_timeout_s=5.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        first, second = _open(p, 2)
        capacity = p._workers[0].pipe_capacity
        assert capacity >= pool_lib._MIN_PIPE_CAPACITY
        action = "sleep:0" + "0" * (2 * capacity)  # a long action (a float with many zeros)

        async def scenario():
            return await asyncio.gather(p.astep(first, action), p.astep(second, "count"), p.astep(first, "count"))

        steps = _arun(scenario())
        assert [s.observation.text for s in steps] == ["count=1", "count=1", "count=2"]
        assert _count(p, first) == 3


def test_service_env_awaits_a_service_s_coroutines_and_threads_the_rest(monkeypatch):
    """`rollout.ServiceEnv` calls an EnvPool on the event loop (no thread per call) and a service
    without coroutine calls (a remote client) in threads, with the same results."""
    from jaxrl_agent import rollout

    threaded = []
    real_to_thread = asyncio.to_thread

    async def counting_to_thread(fn, *args):
        threaded.append(getattr(fn, "__name__", fn))
        return await real_to_thread(fn, *args)

    monkeypatch.setattr(asyncio, "to_thread", counting_to_thread)

    class BlockingOnly:  # the pool's blocking calls only
        def __init__(self, pool):
            self.reset, self.step, self.close_episode = pool.reset, pool.step, pool.close_episode

    async def episode(service):
        env = rollout.ServiceEnv(service, "faulty")
        first = await env.reset(TASK, 0)
        texts = [first.text.startswith("pid="), (await env.step("count")).observation.text,
                 (await env.step("done")).observation.text]
        await env.close()
        return texts

    with pool_lib.EnvPool(1, step_timeout_s=5.0, worker_memory_mb=1024, imports=["jaxrl_agent.envs.testing"]) as p:
        assert _arun(episode(p)) == [True, "count=1", "count=2"]
        assert threaded == []
        assert _arun(episode(BlockingOnly(p))) == [True, "count=1", "count=2"]
        assert threaded == ["reset", "step", "step", "close_episode"]
