"""Running untrusted Python (the policy's code) in an isolated, unprivileged process.

Isolation (`isolation='bwrap'`, the default) comes from bubblewrap (Debian's `bubblewrap` package),
a tool made for this, and fails closed: if `bwrap` is missing or cannot create the namespaces,
`run_python` raises `SandboxUnavailableError` naming what is missing (and `validate_config` stops a
run that needs the sandbox before it starts). `isolation='none'` runs without it, after a warning,
only when asked for (`sandbox.isolation` in the config, or `JAXRL_AGENT_SANDBOX_ISOLATION`).

Layers, each a backstop for the others:
  1. bubblewrap: new user, PID, mount, network, IPC, UTS and cgroup namespaces; uid and gid 65534
     inside; only loopback networking; a root file system holding nothing but the read-only system
     and interpreter directories (no /etc, no /home, no project, no host /tmp), a private /proc; a
     writable tmpfs of `disk_mb` as the working directory, the script and its files bound into it
     read-only; no capabilities; the whole namespace dies with the worker (`--die-with-parent`:
     bwrap is the PID namespace's init). bwrap binds its processes to their parents only as it
     sets the sandbox up, so a worker killed in the first milliseconds of a launch can leave one
     running (bwrap's window; the CPU-seconds limit still ends a program that computes).
  2. A seccomp filter (classic BPF, built here) that refuses what an audit hook cannot see:
     ptrace, process_vm_*, pidfd_*, prlimit on another process, kcmp, mount and namespace calls,
     keyctl, bpf, perf_event_open, userfaultfd, io_uring, module and reboot calls, sockets, and any
     new process (fork, vfork, clone without CLONE_THREAD, clone3).
  3. In the child, before the untrusted code: resource limits (CPU seconds, address space, file
     size, no core files) and a `sys.addaudithook` guard that refuses sockets, subprocesses,
     fork/exec, ctypes and writes outside the working directory.
  4. The parent kills the sandbox at the wall-clock limit and caps output size.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings

NOBODY = 65534
ISOLATIONS = ("bwrap", "none")
ISOLATION_ENV = "JAXRL_AGENT_SANDBOX_ISOLATION"
WORKDIR = "/sandbox"  # the writable tmpfs inside the sandbox (its cwd); the script and its files
# are bound into it read-only


class SandboxUnavailableError(RuntimeError):
    """The isolation the sandbox was asked for cannot be set up on this machine."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_mb: int = 512
    max_file_mb: int = 8
    max_output_bytes: int = 64 * 1024
    disk_mb: int = 16  # size of the writable tmpfs (bwrap isolation)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: 'ok' (exit 0), 'error' (exception / non-zero exit), 'timeout' (CPU or wall limit),
    'memory_limit' (MemoryError under the address-space cap), 'refused' (the guard or the seccomp
    filter blocked an operation: network, process creation, writes outside the sandbox),
    'sandbox_error' (the isolation itself failed to set up: nothing of the code ran)."""

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
mem = cfg["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1))
fsize = cfg["max_file_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

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
sys.path.insert(0, cfg["input_dir"])  # the script's own directory, for its helper files
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


# ----------------------------------------------------------------------------- seccomp (classic BPF)
# Syscalls refused with EPERM, by architecture. Numbers: the kernel's syscall tables
# (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h for aarch64).
_DENIED = {
    "x86_64": {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_open": 434,
               "pidfd_send_signal": 424, "pidfd_getfd": 438, "kcmp": 312, "mount": 165, "umount2": 166,
               "unshare": 272, "setns": 308, "pivot_root": 155, "chroot": 161, "keyctl": 250, "add_key": 248,
               "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246,
               "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
               "reboot": 169, "swapon": 167, "swapoff": 168, "open_by_handle_at": 304,
               "name_to_handle_at": 303, "personality": 135, "io_uring_setup": 425, "io_uring_enter": 426,
               "io_uring_register": 427, "socket": 41, "socketpair": 53, "fork": 57, "vfork": 58,
               "clone3": 435, "move_mount": 429, "fsopen": 430, "fsmount": 432, "open_tree": 428},
    "aarch64": {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_open": 434,
                "pidfd_send_signal": 424, "pidfd_getfd": 438, "kcmp": 272, "mount": 40, "umount2": 39,
                "unshare": 97, "setns": 268, "pivot_root": 41, "chroot": 51, "keyctl": 219, "add_key": 217,
                "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104,
                "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
                "reboot": 142, "swapon": 224, "swapoff": 225, "open_by_handle_at": 265,
                "name_to_handle_at": 264, "personality": 92, "io_uring_setup": 425, "io_uring_enter": 426,
                "io_uring_register": 427, "socket": 198, "socketpair": 199, "clone3": 435, "move_mount": 429,
                "fsopen": 430, "fsmount": 432, "open_tree": 428},
}
# clone (a new process unless CLONE_THREAD) and prlimit64 (allowed on pid 0, this process, only).
_CLONE = {"x86_64": 56, "aarch64": 220}
_PRLIMIT64 = {"x86_64": 302, "aarch64": 261}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
# BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38


def _assemble(program: list[tuple]) -> bytes:
    """Classic BPF from (opcode, jump-if-true label, jump-if-false label, k) and ('label', name)
    entries; a label of None falls through."""
    labels, index = {}, 0
    for entry in program:
        if entry[0] == "label":
            labels[entry[1]] = index
        else:
            index += 1
    out, index = [], 0
    for entry in program:
        if entry[0] == "label":
            continue
        opcode, jt, jf, k = entry
        offsets = [0 if label is None else labels[label] - index - 1 for label in (jt, jf)]
        if not all(0 <= o <= 255 for o in offsets):
            raise ValueError(f"seccomp jump out of range at instruction {index}: {offsets}")
        out.append(struct.pack("=HBBI", opcode, offsets[0], offsets[1], k))
        index += 1
    return b"".join(out)


def seccomp_program(arch: str | None = None) -> bytes:
    """The sandbox's seccomp filter as `struct sock_filter[]` bytes (what `bwrap --seccomp` reads):
    a foreign architecture is killed; the syscalls in `_DENIED`, `clone` without CLONE_THREAD (a
    new process; threads stay allowed), `prlimit64` on another process and, on x86_64, every x32-ABI
    call fail with EPERM; `clone3` fails with ENOSYS (so that the C library falls back to `clone`,
    where the flags can be checked); everything else is allowed."""
    arch = arch or platform.machine()
    if arch not in _DENIED:
        raise SandboxUnavailableError(f"the sandbox's seccomp filter has no syscall table for {arch!r} "
                                      f"(known: {sorted(_DENIED)}); set sandbox.isolation='none' to run without it")
    denied = {name: nr for name, nr in _DENIED[arch].items() if name != "clone3"}
    program: list[tuple] = [
        (_LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ_K, "nr", "kill", _AUDIT_ARCH[arch]),
        ("label", "kill"), (_RET_K, None, None, _RET_KILL_PROCESS),
        ("label", "nr"), (_LD_W_ABS, None, None, 0),  # seccomp_data.nr
    ]
    if arch == "x86_64":
        program.append((_JGE_K, "deny", None, _X32_BIT))
    program += [(_JEQ_K, "deny", None, nr) for nr in sorted(denied.values())]
    program += [
        (_JEQ_K, "nosys", None, _DENIED[arch]["clone3"]),
        (_JEQ_K, "clone", "not_clone", _CLONE[arch]),
        ("label", "clone"), (_LD_W_ABS, None, None, 16),  # args[0] (flags), low word
        (_JSET_K, "allow", "deny", _CLONE_THREAD),
        ("label", "not_clone"), (_JEQ_K, "prlimit", "allow", _PRLIMIT64[arch]),
        ("label", "prlimit"), (_LD_W_ABS, None, None, 16),  # args[0] (pid), low word
        (_JEQ_K, "allow", "deny", 0),
        ("label", "allow"), (_RET_K, None, None, _RET_ALLOW),
        ("label", "deny"), (_RET_K, None, None, _RET_ERRNO | _EPERM),
        ("label", "nosys"), (_RET_K, None, None, _RET_ERRNO | _ENOSYS),
    ]
    return _assemble(program)


def _interpreter_paths() -> tuple[str, list[str]]:
    """(the real interpreter binary, the directories it needs: its prefix and the system's)."""
    executable = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    return executable, sorted(prefixes)


def isolated_command(argv: list[str], *, input_dir: str, limits: SandboxLimits, seccomp_fd: int | None) -> list[str]:
    """The bubblewrap command that runs `argv` isolated (layer 1 and 2 of the module docstring): a
    `limits.disk_mb` tmpfs at WORKDIR as the working directory, `input_dir`'s files bound into it
    read-only."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError(
            "the code sandbox needs bubblewrap, which is not installed: apt-get install bubblewrap (or set "
            f"sandbox.isolation='none' / {ISOLATION_ENV}=none to run policy code without isolation)")
    command = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY), "--gid",
               str(NOBODY), "--hostname", "sandbox", "--cap-drop", "ALL"]
    for directory in ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(directory):
            command += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            command += ["--ro-bind", directory, directory]
    _, prefixes = _interpreter_paths()
    for prefix in prefixes:
        if not prefix.startswith("/usr/"):
            command += ["--ro-bind", prefix, prefix]
    command += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(limits.disk_mb * 1024 * 1024), "--tmpfs", WORKDIR]
    for name in sorted(os.listdir(input_dir)):  # the script and its files, read-only, in the working directory
        command += ["--ro-bind", os.path.join(input_dir, name), f"{WORKDIR}/{name}"]
    command += ["--remount-ro", "/", "--chdir", WORKDIR]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return command + ["--", *argv]


@functools.lru_cache(maxsize=None)
def _probe_bwrap() -> str | None:
    """None when bubblewrap can set up the sandbox here, else why not (checked once per process)."""
    try:
        with tempfile.TemporaryDirectory(prefix="jaxrl_sandbox_probe_") as probe:
            os.chmod(probe, 0o755)
            read, write = os.pipe()
            os.write(write, seccomp_program())
            os.close(write)
            try:
                command = isolated_command([os.path.realpath(sys.executable), "-I", "-S", "-c",
                                            "import os; print(os.getuid())"],
                                           input_dir=probe, limits=SandboxLimits(), seccomp_fd=read)
                done = subprocess.run(command, capture_output=True, text=True, timeout=30, pass_fds=(read,))
            finally:
                os.close(read)
    except SandboxUnavailableError as err:
        return str(err)
    except (OSError, subprocess.SubprocessError) as err:
        return f"bubblewrap could not be started: {err}"
    if done.returncode != 0 or done.stdout.strip() != str(NOBODY):
        return (f"bubblewrap could not create the sandbox (exit {done.returncode}: "
                f"{(done.stderr.strip() or done.stdout.strip())[-300:]}); user namespaces may be disabled "
                f"(kernel.unprivileged_userns_clone, user.max_user_namespaces) — or set sandbox.isolation='none'")
    return None


def default_isolation() -> str:
    isolation = os.environ.get(ISOLATION_ENV, "") or "bwrap"
    if isolation not in ISOLATIONS:
        raise SandboxUnavailableError(f"{ISOLATION_ENV}={isolation!r}: expected one of {ISOLATIONS}")
    return isolation


def check_isolation(isolation: str | None = None) -> None:
    """Raises SandboxUnavailableError, naming what is missing, when `isolation` cannot be used here."""
    isolation = isolation or default_isolation()
    if isolation not in ISOLATIONS:
        raise SandboxUnavailableError(f"sandbox isolation {isolation!r}: expected one of {ISOLATIONS}")
    if isolation == "bwrap":
        problem = _probe_bwrap()
        if problem is not None:
            raise SandboxUnavailableError(problem)


@functools.lru_cache(maxsize=None)
def _warn_unisolated() -> None:
    warnings.warn("sandbox.isolation='none': policy code runs without namespaces or seccomp, guarded only by "
                  "resource limits and an audit hook — for trusted code only", RuntimeWarning, stacklevel=3)


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None, isolation: str | None = None) -> SandboxResult:
    """Runs `code` as a script in the sandbox; `files` are written beside it first (read-only for
    it under bwrap). Raises SandboxUnavailableError when the isolation cannot be set up."""
    isolation = isolation or default_isolation()
    check_isolation(isolation)
    if isolation == "none":
        _warn_unisolated()
    workdir = tempfile.mkdtemp(prefix="jaxrl_sandbox_")
    try:
        input_dir = os.path.join(workdir, "in")
        os.mkdir(input_dir)
        with open(os.path.join(input_dir, "main.py"), "w") as f:
            f.write(code)
        for name, content in (files or {}).items():
            if os.path.basename(name) != name or name in ("main.py", "in"):
                raise ValueError(f"sandbox file name {name!r} must be a plain file name other than main.py")
            with open(os.path.join(input_dir, name), "w") as f:
                f.write(content)
        out_path, err_path = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        pass_fds: tuple[int, ...] = ()
        if isolation == "bwrap":
            os.chmod(workdir, 0o755)
            os.chmod(input_dir, 0o755)
            cfg = {"memory_mb": limits.memory_mb, "cpu_seconds": limits.cpu_seconds,
                   "max_file_mb": limits.max_file_mb, "input_dir": WORKDIR}
            read, write = os.pipe()
            os.write(write, seccomp_program())
            os.close(write)
            pass_fds = (read,)
            command = isolated_command([os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _GUARD,
                                        json.dumps(cfg), f"{WORKDIR}/main.py"],
                                       input_dir=input_dir, limits=limits, seccomp_fd=read)
            cwd = workdir
        else:
            cfg = {"memory_mb": limits.memory_mb, "cpu_seconds": limits.cpu_seconds,
                   "max_file_mb": limits.max_file_mb, "input_dir": input_dir}
            command = [sys.executable, "-I", "-S", "-B", "-c", _GUARD, json.dumps(cfg),
                       os.path.join(input_dir, "main.py")]
            cwd = input_dir
        start = time.perf_counter()
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                                        start_new_session=True, pass_fds=pass_fds)
                timed_out = False
                try:
                    proc.communicate(stdin.encode(), timeout=limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # bwrap (its namespace dies with it), or the group
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
        finally:
            for fd in pass_fds:
                os.close(fd)
        wall = time.perf_counter() - start
        stdout = _read_capped(out_path, limits.max_output_bytes)
        stderr = _read_capped(err_path, limits.max_output_bytes)
        rc = proc.returncode
        # A signal ends the child with -N; under bwrap its init reports the child's death as 128 + N.
        if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif isolation == "bwrap" and stderr.startswith("bwrap:"):
            status = "sandbox_error"
        elif "MemoryError" in stderr:
            status = "memory_limit"
        elif "PermissionError: sandbox:" in stderr or "Operation not permitted" in stderr:
            status = "refused"
        else:
            status = "error"
        return SandboxResult(status, rc, stdout, stderr, wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
