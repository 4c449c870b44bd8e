"""A baseline kept compiled in a subprocess, timed on request, so that a benchmark can alternate
rounds of its own code with rounds of the baseline on the same (noisy, shared) machine.

The baseline script, run with `--serve`, compiles, prints `ready`, then for each line `N` read from
stdin times N units of work and prints one line `<prefix><v1>,<v2>,...`
(`tunix_learner_baseline.py`, `tunix_sampler_baseline.py`).
"""

from __future__ import annotations

import subprocess


class ServedBaseline:
    """`python script --serve *args` in a subprocess; `request(n)` -> its n measurements."""

    def __init__(self, python: str, script: str, args: list[str], prefix: str):
        self.prefix = prefix
        self.proc = subprocess.Popen([python, script, "--serve", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._read("ready")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.strip()
        raise RuntimeError(f"baseline exited (code {self.proc.wait()}) before printing {prefix!r}")

    def request_raw(self, n: int) -> str:
        """The reply to `n`, after the prefix, as printed."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read(self.prefix)[len(self.prefix):]

    def request(self, n: int) -> list[float]:
        return [float(x) for x in self.request_raw(n).split(",")]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
