"""Fault-injection soak: the default config on pool environments and two sampler servers, while a
chaos thread, at seeded random moments, kills env workers, kills a sampler server, SIGKILLs the
trainer and restarts it with --config.resume=True, sends garbage, oversize and unauthenticated
requests to both kinds of server, and runs hostile code in the sandbox (the escapes of
tests/envs/test_sandbox.py, a fork bomb, a 10 GB allocation, a socket, a write outside its
directory, a kill of its parent); and env steps hang (soak_envs: the first step of one RL task in
--hang_every).

  python benchmarks/soak.py --minutes 10 [--seed 0] [--workdir /tmp/soak]

At the end it checks that the run completed; that the task stream continued exactly across the
restarts (per RL iteration, the kept record's stream position advances by the tasks of one
iteration: nothing lost, nothing trained twice); that no sandbox escape succeeded (no file outside,
no process left, the trainer alive until the chaos killed it); that metrics are continuous (every
iteration 1..N has a record); and prints a table of faults injected against faults survived.
Exit status 0 only if every fault was survived and every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ESCAPE_FILE = "/jaxrl_soak_escape"
HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "10 GB allocation": "blob = bytearray(10 * 1024**3)\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22))\n",
    "write outside": f"open({ESCAPE_FILE!r}, 'w').write('x')\n",
    "dir_fd write": "import os\nfd = os.open('/', os.O_RDONLY)\nos.open('jaxrl_soak_escape', os.O_CREAT | os.O_WRONLY, dir_fd=fd)\n",
    "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "pidfd on the trainer": "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({trainer}), signal.SIGKILL)\n",
    "read /etc/passwd": "print(open('/etc/passwd').read())\n",
}


def _pids(*markers: bytes) -> list[int]:
    """Processes whose command line holds every marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if all(m in cmdline for m in markers):
            found.append(int(pid))
    return found


def _records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = args.workdir
        self.injected: dict[str, int] = {}
        self.survived: dict[str, int] = {}
        self.failures: list[str] = []
        self.env_stats: dict = {}
        self.trainer = None
        self.env_server = None
        self.env_port = None
        self.done = threading.Event()
        self.lock = threading.Lock()
        os.environ.setdefault("JAXRL_AGENT_TOKEN", os.urandom(16).hex())  # the servers', and this process's
        # benchmarks/soak_envs.py as `soak_envs` (an installed package already owns the name `benchmarks`).
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "benchmarks"), ROOT]),
                    "JAXRL_SOAK_HANG_EVERY": str(args.hang_every)}

    # ------------------------------------------------------------------------------ processes
    def start_env_server(self):
        self.env_server = subprocess.Popen(
            [sys.executable, "-m", "jaxrl_agent.cli", "env-server", "--port", "0", "--workers", "2",
             "--step_timeout_s", "5", "--import", "soak_envs"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env)
        self.env_port = int(self.env_server.stdout.readline().strip().rsplit(":", 1)[1])

    def start_trainer(self, resume: bool):
        flags = {"workdir": self.workdir, "env.imports": "soak_envs", "env.name": "calc_soak",
                 "env.service": f"127.0.0.1:{self.env_port}", "sampler.num_servers": 2,
                 # The run ends by itself after the chaos: its budget counts SFT, the chaos and a tail
                 # of fault-free iterations (and the time of killed segments since their last
                 # checkpoint is not counted).
                 "rl.time_budget_minutes": self.args.minutes + self.args.sft_minutes + self.args.tail_minutes,
                 "rl.iterations": self.args.iterations, "checkpoint.every": 5,
                 "eval.every": 0, "metrics.progress": "off", "resume": resume}
        flags.update(dict(kv.split("=", 1) for kv in self.args.override))
        command = [sys.executable, "-m", "jaxrl_agent.cli", "train", "--config",
                   os.path.join(ROOT, "configs", "calculator_tiny.py"), *[f"--config.{k}={v}" for k, v in flags.items()]]
        log = open(os.path.join(self.args.logdir, f"trainer_{int(time.time())}.log"), "w")
        self.trainer = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def every_kind_injected(self, with_hangs: bool = False) -> bool:
        """Whether every kind of fault has been injected at least once (the hangs, injected by the
        environment itself, are known only from the env server's counters at the end)."""
        with self.lock:
            injected = set(self.injected)
        kinds = {kind.split(":")[0] for kind in injected}
        wanted = {"kill env worker", "kill sampler server", "SIGKILL trainer + resume", "bad requests", "hostile code"}
        return kinds >= (wanted | {"hang env step"} if with_hangs else wanted) and \
            {"bad requests: env server", "bad requests: sampler server"} <= injected

    def _count(self, kind: str, survived: bool | None = None):
        with self.lock:
            if survived is None:
                self.injected[kind] = self.injected.get(kind, 0) + 1
            elif survived:
                self.survived[kind] = self.survived.get(kind, 0) + 1
            else:
                self.failures.append(kind)

    # ------------------------------------------------------------------------------ faults
    def kill_env_worker(self):
        workers = _pids(b"jaxrl_agent.envs.worker")
        if workers:
            os.kill(self.rng.choice(workers), signal.SIGKILL)
            return True
        return None

    def kill_sampler_server(self):
        servers = _pids(b"sampler-server", self.workdir.encode())
        if servers:
            os.kill(self.rng.choice(servers), signal.SIGKILL)
            return True
        return None

    def kill_trainer(self):
        if self.trainer is None or self.trainer.poll() is not None:
            return None
        if not any(r["stage"] == "rl" for r in _records(self.workdir)):
            return None  # before RL there is nothing to resume into
        self.trainer.send_signal(signal.SIGKILL)
        self.trainer.wait()
        time.sleep(3)  # its sampler servers notice their parent is gone and exit (checked at the end)
        self.start_trainer(resume=True)
        return True

    def bad_requests_env_server(self):
        """Garbage, an unauthenticated and a 17 MiB request to the env server; it must still serve a
        proper request afterwards."""
        from jaxrl_agent.envs import remote

        for payload in (b"\x00\xffgarbage\n", b'{"method": "stats", "token": "wrong"}\n',
                        b'{"method": "stats", "params": {"x": "' + b"a" * (17 * 2**20) + b'"}}\n'):
            with socket.create_connection(("127.0.0.1", self.env_port), timeout=30) as sock:
                sock.sendall(payload)  # the server reads an over-long line through before it answers
                reply = sock.makefile("rb").readline()
                assert b'"error"' in reply, reply[:200]
        client = remote.RemoteEnvPool("127.0.0.1", self.env_port, timeout_s=60)
        client.stats  # noqa: B018 - a proper request is served
        client.close()
        return True

    def bad_requests_sampler_server(self):
        """A wrong token through our client and garbage without a token through a raw channel, to
        one of the trainer's sampler servers: both refused as UNAUTHENTICATED. None (not injected)
        while that server is down (killed by the chaos, or the trainer is between segments)."""
        import asyncio

        import grpc

        from jaxrl_agent.sampling.client import SamplerClient

        path = os.path.join(self.workdir, "sampler_servers.json")
        if not os.path.exists(path):
            return None
        address = self.rng.choice(json.load(open(path))["addresses"])

        async def intrude():
            intruder = SamplerClient([address], token="wrong", timeout_s=30, max_attempts=1)
            refused = await intruder.update_weights({"junk": [1.0]}, 10**9)
            await intruder.close()
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    await channel.stream_unary("/jaxrl_agent.Sampler/StreamWeights")(iter([b"\x00" * 64]), timeout=30)
                    raw = None
                except grpc.aio.AioRpcError as err:
                    raw = err.code()
            return [e.code() for e in refused.values()] + [raw]

        codes = asyncio.run(intrude())
        if grpc.StatusCode.UNAVAILABLE in codes:
            return None  # the server is down right now: try again later
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2, codes
        return True

    def hostile_code(self):
        """Every program of HOSTILE, each counted as its own fault."""
        from jaxrl_agent.envs import sandbox

        for name in self.rng.sample(sorted(HOSTILE), len(HOSTILE)):
            kind = f"hostile code: {name}"
            self._count(kind)
            code = HOSTILE[name].format(trainer=self.trainer.pid if self.trainer else os.getpid())
            result = sandbox.run_python(code, limits=sandbox.SandboxLimits(wall_seconds=5))
            escaped = result.status == "ok" or "root:" in result.stdout or os.path.exists(ESCAPE_FILE)
            alive = self.trainer is None or self.trainer.poll() is None
            if escaped or not alive:
                self._count(f"{kind}: escaped (status {result.status}, trainer alive {alive})", survived=False)
            else:
                self._count(kind, survived=True)
        return "counted"

    # ------------------------------------------------------------------------------ the run
    def chaos(self):
        faults = [("kill env worker", self.kill_env_worker), ("kill sampler server", self.kill_sampler_server),
                  ("SIGKILL trainer + resume", self.kill_trainer),
                  ("bad requests: env server", self.bad_requests_env_server),
                  ("bad requests: sampler server", self.bad_requests_sampler_server),
                  ("hostile code", self.hostile_code)]
        # Every kind in each round, in a seeded random order: a short soak still injects them all.
        due: list = []
        while not self.done.wait(self.rng.uniform(*self.args.interval)):
            if not due:
                due = self.rng.sample(faults, len(faults))
            kind, fault = due[0]
            if kind == "SIGKILL trainer + resume" and self.injected.get(kind, 0) >= self.args.max_trainer_kills:
                due.pop(0)
                continue
            try:
                outcome = fault()
                if outcome is None:
                    due.append(due.pop(0))  # nothing to inject it into yet: later in this round
                    continue
                due.pop(0)
                if outcome != "counted":
                    self._count(kind)
                    self._count(kind, survived=True)
            except Exception as err:  # noqa: BLE001 - a fault the system did not survive
                due.pop(0)
                self._count(kind)
                self._count(f"{kind}: {type(err).__name__}: {err}"[:200], survived=False)

    def run(self) -> int:
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.makedirs(self.args.logdir, exist_ok=True)
        started = time.monotonic()
        self.start_env_server()
        self.start_trainer(resume=False)
        chaos = threading.Thread(target=self.chaos, daemon=True)
        chaos.start()
        deadline = started + 60 * self.args.minutes
        finished = False
        while time.monotonic() < deadline + 600:
            code = self.trainer.poll()
            if code is not None:
                if code == 0:
                    finished = True
                    break
                if code != -signal.SIGKILL:
                    self.failures.append(f"trainer exited with {code}")
                    break
            # The chaos ends at the deadline once every kind was injected: on a slow host RL (which
            # the trainer kill needs) may start only after --minutes.
            if time.monotonic() > deadline and not self.done.is_set() and self.every_kind_injected():
                self.done.set()  # no more faults; let the run finish
            time.sleep(1.0)
        self.done.set()
        chaos.join(timeout=60)
        if self.trainer.poll() is None:
            self.failures.append("the run did not finish within 10 minutes of the chaos ending")
            self.trainer.kill()
            self.trainer.wait()
        time.sleep(3)  # the trainer's sampler servers exit when it is gone
        self.env_stats = self.env_server_stats()
        self.env_server.kill()
        return self.report(finished, time.monotonic() - started)

    def env_server_stats(self) -> dict:
        from jaxrl_agent.envs import remote

        try:
            client = remote.RemoteEnvPool("127.0.0.1", self.env_port, timeout_s=60)
            stats = dict(client.stats)
            client.close()
            return stats
        except Exception as err:  # noqa: BLE001 - reported as a failure
            self.failures.append(f"env server stats: {type(err).__name__}: {err}")
            return {}

    def report(self, finished: bool, seconds: float) -> int:
        records = _records(self.workdir)
        kept = {}
        for r in records:
            if r["stage"] == "rl":
                kept[r["step"]] = r  # a re-run iteration (after a resume) replaces the killed segment's
        steps = sorted(kept)
        checks = {
            "run completed (summary record)": finished and any(r["stage"] == "summary" for r in records),
            "metrics continuous (iterations 1..N)": steps == list(range(1, len(steps) + 1)) and len(steps) > 0,
            "task stream exact across restarts": len(steps) > 1 and len({kept[s]["task_position"] - kept[s - 1]
                                                                         ["task_position"] for s in steps[1:]}) == 1,
            "no file outside the sandbox": not os.path.exists(ESCAPE_FILE),
            "no sandbox process left": not _pids(b"/sandbox/main.py"),
            "no sampler server left": not _pids(b"sampler-server", self.workdir.encode()),
        }
        # Hanging steps are injected by the environment itself (soak_envs): the env server's pool
        # counts each as a timeout and replaces the worker; the run survived them if it completed.
        hangs = int(self.env_stats.get("env_timeout", 0))
        if hangs:
            self.injected["hang env step"] = hangs
            self.survived["hang env step"] = hangs if finished else 0
        checks["every kind of fault injected"] = self.every_kind_injected(with_hangs=True)
        checks["env worker kills seen by the pool"] = (
            self.env_stats.get("env_crash", 0) + self.env_stats.get("worker_restarts", 0)
            >= self.injected.get("kill env worker", 0))
        print(f"\nsoak: {seconds / 60:.1f} min ({self.args.minutes:g} of chaos), {len(steps)} RL iterations, "
              f"seed {self.args.seed}\n")
        print("| fault | injected | survived |\n|---|---|---|")
        for kind in sorted(self.injected):
            print(f"| {kind} | {self.injected[kind]} | {self.survived.get(kind, 0)} |")
        print(f"\nenv server: {json.dumps(self.env_stats, sort_keys=True)}")
        print("\n| check | holds |\n|---|---|")
        for name, ok in checks.items():
            print(f"| {name} | {'yes' if ok else 'NO'} |")
        if len(steps) < 2:
            print(f"FAILED: {len(steps)} RL iteration(s): too few to check the task stream (raise --tail_minutes "
                  f"on a slow host)")
        for failure in self.failures:
            print(f"FAILED: {failure}")
        return 0 if all(checks.values()) and not self.failures else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="How long the chaos lasts (longer, until every kind of fault was injected).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_minutes", type=float, default=4.0,
                        help="Added to --minutes for rl.time_budget_minutes (which counts SFT and evaluations).")
    parser.add_argument("--tail_minutes", type=float, default=1.0,
                        help="Also added to rl.time_budget_minutes: the run goes on this long after the chaos, so "
                             "that on a slow host (the first iteration after each resume compiles) it still has "
                             "several RL iterations whose task stream can be checked.")
    parser.add_argument("--iterations", type=int, default=100000, help="rl.iterations (the run ends after the chaos).")
    parser.add_argument("--interval", type=float, nargs=2, default=(10.0, 30.0), help="Seconds between faults.")
    parser.add_argument("--hang_every", type=int, default=400, help="One RL task in this many hangs (soak_envs).")
    parser.add_argument("--max_trainer_kills", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/jaxrl_soak")
    parser.add_argument("--logdir", default="/tmp/jaxrl_soak_logs")
    parser.add_argument("--override", action="append", default=[], help="key=value config override (repeatable).")
    return Soak(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
