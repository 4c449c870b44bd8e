"""Running untrusted Python (the policy's code) in a locked-down subprocess.

Layers, each a backstop for the others:
  1. A fresh `python -I -S` in its own session and a private temporary directory as cwd.
  2. Before the untrusted code runs, the child itself (no `preexec_fn`, which is unsafe in a
     threaded parent such as a JAX process) sets resource limits — CPU seconds, address space,
     file size, no core files, few processes — detaches from the network with
     `unshare(CLONE_NEWNET)` when the kernel allows, and drops root to `nobody`.
  3. A `sys.addaudithook` guard refuses sockets, subprocesses, fork/exec, ctypes, and any write,
     rename or delete outside the temporary directory.
  4. The parent kills the whole process group at the wall-clock limit, and caps output size.
This is defence in depth for generated code on a trainer's machine, not a hardened jail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_mb: int = 512
    max_file_mb: int = 8
    max_output_bytes: int = 64 * 1024


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: 'ok' (exit 0), 'error' (exception / non-zero exit), 'timeout' (CPU or wall limit),
    'memory_limit' (MemoryError under the address-space cap), 'refused' (the guard blocked an
    operation: network, process creation, writes outside the sandbox)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float


# Runs inside the child, before the untrusted code. Kept dependency-free (stdlib only).
_GUARD = r'''
import os, sys, resource, json
cfg = json.loads(sys.argv[1])
root = os.path.realpath(os.getcwd())
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare(0x40000000)  # CLONE_NEWNET: an empty network namespace, if permitted
    del libc, ctypes
except Exception:
    pass
sys.modules.pop("ctypes", None); sys.modules.pop("_ctypes", None)
mem = cfg["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1))
fsize = cfg["max_file_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
def world_readable(path):
    # nobody must still be able to import the standard library after the drop.
    while True:
        mode = os.stat(path).st_mode
        if not mode & 0o001:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent

if os.getuid() == 0 and world_readable(os.path.dirname(os.__file__)):
    try:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    except OSError:
        pass
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
except (ValueError, OSError):
    pass

BLOCKED_MODULES = {"socket", "_socket", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
                   "multiprocessing", "_multiprocessing", "pty", "ssl", "_ssl", "asyncio"}
BLOCKED_EVENTS = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn",
                  "os.spawn", "os.system", "os.kill", "os.killpg", "os.setuid", "ctypes.", "resource.setrlimit",
                  "sys.addaudithook", "os.putenv", "os.unsetenv")
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
               "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

def inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else root)
    except Exception:
        return False
    return p == root or p.startswith(root + os.sep)

def hook(event, args):
    if event == "import" and args[0].split(".")[0] in BLOCKED_MODULES:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
    if event.startswith(BLOCKED_EVENTS):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
        writing = bool(isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            isinstance(flags, int) and flags & write_flags)
        if writing and not isinstance(path, int) and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
    if event in PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the sandbox directory is not allowed")

sys.addaudithook(hook)
del hook
import runpy
sys.path.insert(0, root)  # the script's own directory, for its helper files
sys.argv = [sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return ""
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `code` as a script in the sandbox; `files` are written into its directory first."""
    workdir = tempfile.mkdtemp(prefix="jaxrl_sandbox_")
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write(code)
        for name, content in (files or {}).items():
            if os.path.basename(name) != name:
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
            with open(os.path.join(workdir, name), "w") as f:
                f.write(content)
        if os.getuid() == 0:
            os.chmod(workdir, 0o777)  # the child drops to nobody and must still write here
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        cfg = json.dumps({"memory_mb": limits.memory_mb, "cpu_seconds": limits.cpu_seconds,
                          "max_file_mb": limits.max_file_mb})
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", _GUARD, cfg, "main.py"],
                cwd=workdir, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env, start_new_session=True,
            )
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole group, whatever it spawned
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.perf_counter() - start
        stdout = _read_capped(out_path, limits.max_output_bytes)
        stderr = _read_capped(err_path, limits.max_output_bytes)
        rc = proc.returncode
        if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif "MemoryError" in stderr:
            status = "memory_limit"
        elif "PermissionError: sandbox:" in stderr:
            status = "refused"
        else:
            status = "error"
        return SandboxResult(status, rc, stdout, stderr, wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
