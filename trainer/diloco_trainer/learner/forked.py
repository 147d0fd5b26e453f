"""A learner forked from a process that has already imported JAX (the local runtime's fork server).

`diloco-learner` spends most of its start in `import jax` and the trainer (about 5 s of CPU, three
times that on a machine whose cores the other learners keep busy). Nothing in those imports
depends on the unit or the run, so the local runtime imports them once, in a Python
`multiprocessing` fork server, and forks its warm spares from there: a spare then only builds and
compiles its step (the compile from the persistent cache) before it is ready.

`run_forked_learner` is the child's entry point. It makes the fork look like a freshly exec'd
`diloco-learner ARGV` as far as the rest of the system can tell: its own process group (so a signal to
its process group reaches it and nothing else), death with its parent, the log file on stdout and
stderr, the supervisor's pipe on stdin, and exactly the environment the supervisor chose.

This module must stay importable without JAX: the supervisor imports it to name the target.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

from diloco_trainer.learner.lifetime import die_with_parent

# Modules worth importing once in the fork server (everything a learner imports before its step).
PRELOAD = (
    "diloco_trainer.learner.forkserver_preload",  # first: the server dies with the supervisor
    "diloco_trainer.learner.forked",
    "diloco_trainer.learner.main",
    "diloco_trainer.learner.standby",
    "diloco_trainer.learner.loop",
)


def _close_server_fds() -> None:
    """Drop the fork server's and resource tracker's pipe ends that a forked child inherits:
    each waits for every holder to close them before it exits."""
    from multiprocessing import forkserver, resource_tracker

    for owner, name in (
        (forkserver._forkserver, "_forkserver_alive_fd"),
        (resource_tracker._resource_tracker, "_fd"),
    ):
        fd = getattr(owner, name, None)
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(owner, name, None)


def probe() -> None:
    """A child that exits at once: once one has, the fork server has finished its imports."""


def run_forked_learner(
    argv: Sequence[str], env: Mapping[str, str], log_path: str, stdin: Connection
) -> None:
    """Become `diloco-learner ARGV` with environment `env`; exits with the learner's code."""
    os.setpgid(0, 0)  # not setsid(): the supervisor's session, as for spawned children
    die_with_parent()  # the fork server, which itself dies with the supervisor
    _close_server_fds()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.dup2(stdin.fileno(), 0)
    stdin.close()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's stdin)
    os.environ.clear()
    os.environ.update(env)

    import jax

    # JAX read JAX_PLATFORMS when the fork server imported it; XLA_FLAGS and the rest are read
    # when the backend starts, which happens only here, in the child.
    platforms = env.get("JAX_PLATFORMS") or None
    if getattr(jax.config, "jax_platforms", None) != platforms:
        jax.config.update("jax_platforms", platforms)

    from diloco_trainer.learner.main import main

    sys.exit(main(list(argv), env))
