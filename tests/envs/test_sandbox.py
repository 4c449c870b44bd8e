"""The code sandbox stops or refuses hostile code, and the pool keeps serving other episodes.

Run as root (as here), each escape below succeeded on the earlier sandbox (a `python -I` child
with an audit hook, whose privilege drop was skipped when the interpreter lived under a 0700 home).
"""

import os
import pathlib
import subprocess
import sys
import time

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


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(code, **kwargs):
    return sandbox.run_python(code, limits=LIMITS, **kwargs)


# ------------------------------------------------------------------------------ escapes, one by one
def test_policy_code_runs_unprivileged_with_only_loopback():
    result = _run("import os\nprint(os.getuid(), os.getgid())\nprint(open('/proc/net/dev').read())\n")
    assert result.status == "ok", result.stderr
    ids, _, table = result.stdout.partition("\n")
    assert ids == f"{sandbox.NOBODY} {sandbox.NOBODY}"
    interfaces = [line.split(":")[0].strip() for line in table.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


def test_a_dir_fd_write_cannot_leave_the_sandbox():
    target = "/jaxrl_sandbox_escape_dirfd"
    try:
        result = _run("import os\nfd = os.open('/', os.O_RDONLY)\n"
                      "os.close(os.open('jaxrl_sandbox_escape_dirfd', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
                      "print('wrote')\n")
        assert result.status != "ok" and "wrote" not in result.stdout
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


def test_pidfd_cannot_signal_the_trainer():
    result = _run(f"import os, signal\nfd = os.pidfd_open({os.getpid()})\nsignal.pidfd_send_signal(fd, 0)\n"
                  "print('signalled')\n")
    assert result.status == "refused" and "signalled" not in result.stdout, result.stderr[-300:]


@pytest.mark.parametrize("path", ["/etc/passwd", "/proc/<trainer>/environ", str(ROOT / "README.md"),
                                  os.path.expanduser("~/.bashrc")])
def test_host_files_are_not_readable(path):
    path = path.replace("<trainer>", str(os.getpid()))
    result = _run(f"print(len(open({path!r}, 'rb').read()))\n")
    assert result.status == "error" and "FileNotFoundError" in result.stderr, (result.status, result.stdout)


def test_the_working_directory_has_a_disk_quota():
    result = _run("for i in range(6):\n    open(f'f{i}', 'wb').write(b'0' * (8 * 2**20 - 1))\n")
    assert result.status == "error" and "No space left on device" in result.stderr


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root):
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(parent, []).append(int(pid))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _cmdline(pid) -> bytes:
    """A process's command line; b'' once it has exited (reading a gone process's raises ESRCH)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_sandboxed_processes_die_with_their_worker():
    """SIGKILL the worker process running a sandbox: nothing of the sandbox survives it."""
    worker = subprocess.Popen([sys.executable, "-c", (
        "from jaxrl_agent.envs import sandbox\n"
        "sandbox.run_python('import time\\ntime.sleep(60)\\n', limits=sandbox.SandboxLimits(cpu_seconds=60, "
        "wall_seconds=120))\n")], cwd=ROOT)
    deadline = time.monotonic() + 30
    sandboxed = []
    while time.monotonic() < deadline:
        # Started: the sandboxed interpreter itself runs (not only the bwrap launcher, whose argv also
        # names main.py). bwrap binds each process to its parent (PR_SET_PDEATHSIG) only once it has
        # set up the sandbox; a worker killed in those first milliseconds can leave a launcher behind
        # (bwrap's own window, see sandbox.py's docstring).
        sandboxed = [pid for pid in _descendants(worker.pid) if b"/sandbox/main.py" in _cmdline(pid)
                     and _cmdline(pid).split(b"\0")[0] == os.path.realpath(sys.executable).encode()]
        if sandboxed:
            break
        time.sleep(0.1)
    assert sandboxed, "the sandbox never started"
    tree = _descendants(worker.pid)
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 20  # the kills are immediate; tearing a process down on a loaded host is not
    while any(map(_alive, tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = {pid: pathlib.Path(f"/proc/{pid}/status").read_text()[:300] for pid in tree if _alive(pid)}
    assert not survivors, survivors


def test_the_seccomp_filter_refuses_what_an_audit_hook_cannot_see(tmp_path):
    """Without the audit hook (raw Python under bwrap and the filter): ptrace, a new process, prlimit
    on another process and a socket fail with EPERM; threads and prlimit on itself still work."""
    probe = ("import ctypes, os, resource, socket, threading\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "print('ptrace', libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"
             "def refused(fn):\n"
             "    try:\n        fn()\n        return 'allowed'\n"
             "    except PermissionError:\n        return 'EPERM'\n"
             "print('fork', refused(os.fork))\n"
             "print('prlimit other', refused(lambda: resource.prlimit(1, resource.RLIMIT_NOFILE)))\n"
             "print('prlimit self', refused(lambda: resource.prlimit(0, resource.RLIMIT_NOFILE)))\n"
             "print('socket', refused(lambda: socket.socket()))\n"
             "t = threading.Thread(target=lambda: None); t.start(); t.join(); print('thread ok')\n")
    read, write = os.pipe()
    os.write(write, sandbox.seccomp_program())
    os.close(write)
    try:
        command = sandbox.isolated_command([os.path.realpath(sys.executable), "-I", "-c", probe], input_dir=str(tmp_path),
                                           limits=LIMITS, seccomp_fd=read)
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, pass_fds=(read,))
    finally:
        os.close(read)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ptrace -1 1", "fork EPERM", "prlimit other EPERM", "prlimit self allowed",
                                        "socket EPERM", "thread ok"]


def test_without_bubblewrap_the_sandbox_refuses_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox._probe_bwrap.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailableError, match="needs bubblewrap.*apt-get install bubblewrap"):
            sandbox.run_python("print(1)\n")
        with pytest.warns(RuntimeWarning, match="without namespaces or seccomp"):
            sandbox._warn_unisolated.cache_clear()
            result = sandbox.run_python("print(1)\n", isolation="none")
        assert result.status == "ok" and result.stdout.strip() == "1"
    finally:
        sandbox._probe_bwrap.cache_clear()


def test_a_run_with_the_code_env_stops_before_it_starts_without_isolation(monkeypatch):
    from jaxrl_agent import build, config_lib

    config = config_lib.load_config(str(ROOT / "configs" / "calculator_tiny.py"))
    config.env.name, config.sft.steps = "code", 0
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox._probe_bwrap.cache_clear()
    try:
        with pytest.raises(build.ConfigError, match=r"\['code'\] run policy code in the sandbox.*bubblewrap"):
            build.validate_config(config)
        config.sandbox.isolation = "none"
        build.validate_config(config)
    finally:
        sandbox._probe_bwrap.cache_clear()


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
