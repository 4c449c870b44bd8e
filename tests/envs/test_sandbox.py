"""The code sandbox stops or refuses hostile code, and the pool keeps serving other episodes."""

import os

import pytest

from jaxrl_agent import envs
from jaxrl_agent.envs import pool as pool_lib, sandbox, tool_protocol as tp

LIMITS = sandbox.SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_mb=256)

HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "sleep forever": ("import time\ntime.sleep(3600)\n", "timeout"),
    "10 GB allocation": ("blob = bytearray(10 * 1024**3)\n", "memory_limit"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "refused"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "refused"),
    "network socket": ("import socket\nsocket.create_connection(('127.0.0.1', 80))\n", "refused"),
    "write outside": ("open('/tmp/jaxrl_sandbox_escape.txt', 'w').write('x')\n", "refused"),
    "os.open outside": ("import os\nos.open('/tmp/jaxrl_sandbox_escape2', os.O_WRONLY | os.O_CREAT)\n", "refused"),
    "delete outside": ("import os\nos.remove('/etc/hostname')\n", "refused"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_code_is_stopped_or_refused(case):
    code, status = HOSTILE[case]
    result = sandbox.run_python(code, limits=LIMITS)
    assert result.status == status, (result.status, result.stderr[-300:])
    assert result.wall_seconds < LIMITS.wall_seconds + 2
    assert not os.path.exists("/tmp/jaxrl_sandbox_escape.txt")
    assert not os.path.exists("/tmp/jaxrl_sandbox_escape2")
    assert os.path.exists("/etc/hostname") or case != "delete outside"


def test_ordinary_code_runs_and_may_use_its_directory():
    result = sandbox.run_python("open('x.txt', 'w').write('hi')\nprint(open('x.txt').read(), sum(range(5)))\n")
    assert result.status == "ok" and result.stdout.strip() == "hi 10"


def test_output_is_capped():
    result = sandbox.run_python("print('x' * 100000)\n", limits=sandbox.SandboxLimits(max_output_bytes=1000))
    assert len(result.stdout) < 1100 and result.stdout.endswith("[output truncated]")


def test_pool_keeps_serving_while_hostile_code_runs():
    code_env = envs.make("code")
    calc_env = envs.make("calculator")
    calc_expert = envs.expert_policy("calculator")
    with pool_lib.EnvPool(2, step_timeout_s=30) as pool:
        hostile = {}
        for i, (code, _) in enumerate(HOSTILE.values()):
            episode, _ = pool.reset("code", code_env.sample_task(i, 1))
            hostile[episode] = code
        calc_tasks = [calc_env.sample_task(s, 2) for s in range(6)]
        calc_episodes = [pool.reset("calculator", t) for t in calc_tasks]
        for episode, code in hostile.items():
            step = pool.step(episode, tp.format_answer(code))
            assert step.done and not step.info["success"] and step.info["finish_reason"] == "answer"
        for (episode, first), task in zip(calc_episodes, calc_tasks):
            observations, actions = [first.text], []
            while True:
                action = calc_expert(task, observations, actions)
                actions.append(action)
                step = pool.step(episode, action)
                observations.append(step.observation.text)
                if step.done:
                    break
            assert step.info["success"]
        assert pool.stats["worker_restarts"] == 0
