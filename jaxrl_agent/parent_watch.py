"""Child processes that do not outlive the process that started them.

`exit_with_parent(pid)` starts a daemon thread that ends this process (`os._exit`) once its parent
is no longer `pid` — the parent died, even by SIGKILL, and the child was re-parented. A thread that
polls, rather than the kernel's parent-death signal (`PR_SET_PDEATHSIG`), because that signal fires
when the *thread* that spawned the child exits: a pool that replaces a worker from a short-lived
request thread would have the replacement killed with that thread. Python threads keep running
while the main thread sleeps, waits on I/O or loops in Python code (the interpreter switches
threads every few milliseconds), so a hung environment step still ends.
"""

from __future__ import annotations

import os
import threading


def exit_with_parent(parent_pid: int, *, interval_s: float = 1.0, exit_code: int = 0) -> None:
    """Exit (without cleanup) within `interval_s` of the parent `parent_pid` dying; no-op for pid 0."""
    if not parent_pid:
        return
    if os.getppid() != parent_pid:
        os._exit(exit_code)  # already gone

    def watch():
        stop = threading.Event()
        while not stop.wait(interval_s):
            if os.getppid() != parent_pid:
                os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
