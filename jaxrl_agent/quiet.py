"""Silencing native-library start-up noise (TensorFlow's CUDA and oneDNN probes) unless asked for.

JetStream 0.2.2 imports `seqio`, which imports TensorFlow; TensorFlow's C++ runtime then logs, through
absl's C++ logging (which `TF_CPP_MIN_LOG_LEVEL` no longer reaches), that no CUDA driver was found
and that oneDNN is on. The trainer never uses TensorFlow. `native_stderr_silenced()` sends file
descriptor 2 to /dev/null for the duration of such an import only; Python exceptions still
propagate (and are printed after the descriptor is restored). Set `JAXRL_AGENT_VERBOSE=1` to see
the native logs.
"""

from __future__ import annotations

import contextlib
import os
import sys

VERBOSE_ENV = "JAXRL_AGENT_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def quiet_environment() -> None:
    """Environment defaults read by native libraries when they load (the user's settings win)."""
    if not verbose():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@contextlib.contextmanager
def native_stderr_silenced():
    """Redirects file descriptor 2 (where native libraries log) to /dev/null inside the block (a
    no-op with JAXRL_AGENT_VERBOSE=1)."""
    if verbose():
        yield
        return
    fd = 2  # native code writes to descriptor 2, whatever sys.stderr is (a notebook kernel replaces it)
    try:
        saved = os.dup(fd)
    except OSError:
        yield
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
