"""N training processes on this machine as one `jax.distributed` job: for tests and for trying
several hosts out before a pod slice or a cluster.

  python launch/local_cluster.py -n 2 [--local_devices 4] -- --config configs/calculator_tiny.py [--config.x=y ...]

Every process runs `launch/tpu_run.py` with the arguments after `--`, plus its place in the job
(`--coordinator_address 127.0.0.1:<port> --num_processes N --process_id i`). Process 0's output
is this command's; the others' lines are prefixed with `[i]` (they print only warnings and errors:
metrics and the console come from process 0). `--local_devices D` gives each process D simulated
CPU devices (`--xla_force_host_platform_device_count`).

If one process exits with an error or is killed, the others are stopped (SIGTERM, then SIGKILL
after `--grace_s`) and this command exits with that process's code, naming it — the job never
hangs waiting for a peer that is gone. Restart it the same way (with `--config.resume=True`) to
continue from the last checkpoint. Ctrl-C stops every process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        own, launcher = argv[:at], argv[at + 1:]
    else:
        own, launcher = argv, []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("--local_devices", type=int, default=0, help="simulated CPU devices per process (0 = as is)")
    parser.add_argument("--port", type=int, default=0, help="the coordinator's port (0 = a free one)")
    parser.add_argument("--grace_s", type=float, default=10.0, help="SIGTERM to SIGKILL, when stopping the others")
    parser.add_argument("--launcher", default=os.path.join(ROOT, "launch", "tpu_run.py"))
    args = parser.parse_args(own)
    if args.num_processes < 1:
        parser.error(f"-n {args.num_processes}: expected >= 1")
    if not launcher:
        parser.error("give the launcher's arguments after --, e.g. -- --config configs/calculator_tiny.py")
    port = args.port or free_port()
    env = dict(os.environ)
    if args.local_devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={args.local_devices}").strip()
    processes = []
    for i in range(args.num_processes):
        command = [sys.executable, args.launcher, *launcher, f"--coordinator_address=127.0.0.1:{port}",
                   f"--num_processes={args.num_processes}", f"--process_id={i}"]
        pipe = None if i == 0 else subprocess.PIPE
        p = subprocess.Popen(command, env=env, stdout=pipe, stderr=subprocess.STDOUT if i else None, text=True,
                             start_new_session=True)
        if i:
            threading.Thread(target=_relay, args=(p.stdout, f"[{i}] ", sys.stderr), daemon=True).start()
        processes.append(p)

    def stop(reason: str) -> None:
        alive = [p for p in processes if p.poll() is None]
        if alive:
            print(f"local_cluster: {reason}; stopping {len(alive)} other process(es)", file=sys.stderr, flush=True)
        for p in alive:
            os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + args.grace_s
        for p in alive:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def interrupted(signum, frame):
        stop(f"signal {signum}")
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    while True:
        codes = [p.poll() for p in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            stop(f"process {i} {how}")
            print(f"local_cluster: the job stopped because process {i} {how}; rerun with --config.resume=True "
                  "to continue from the last checkpoint", file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
