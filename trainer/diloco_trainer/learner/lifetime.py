"""A child process that cannot outlive its parent (stdlib only: the local runtime, the fork
server and the in-container supervisor all use it before any heavy import)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies. One async-signal-safe system call, so it may
    also run between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
