"""Learners forked from one pre-imported process, so a warm spare is ready in seconds.

A spare learner exec'd from scratch spends most of its warm-up importing JAX and the trainer,
which on a machine whose cores the learners keep busy takes 15-20 s; kills that come closer
together than that find no ready spare and pay a cold start. Python's `multiprocessing` fork
server imports those modules once (`diloco_trainer.learner.forked.PRELOAD`); each spare is then a fork
of it that only builds and compiles its step.

Forking is asynchronous: the first request waits for the server's own imports, and the
supervisor's loop must not stall meanwhile, so requests go to one worker thread and come back as
futures. A forked child looks to the `ProcessTable` like a `subprocess.Popen` (`ForkedChild`):
pid, stdin pipe, poll, wait, with the same exit code convention (negative: killed by signal).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO

from diloco_trainer.learner.forked import PRELOAD, probe, run_forked_learner

# A forked child calls setpgid(0, 0) first thing; a signal to its group before that would miss it.
GROUP_WAIT_SECONDS = 5.0


class ForkedChild:
    """A learner forked by the fork server, behind the part of Popen's interface the process
    table uses."""

    def __init__(self, process: BaseProcess, stdin: IO[bytes]) -> None:
        self._process = process
        self.stdin: IO[bytes] | None = stdin

    @property
    def pid(self) -> int:
        assert self._process.pid is not None  # set by start()
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"forked learner {self.pid}", timeout or 0.0)
        return code


def _wait_for_group(pid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return
        except ProcessLookupError:
            return  # died already: the table's poll reports it
        time.sleep(0.01)


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ as `env` while the fork server starts (it inherits the environment then: JAX
    reads JAX_PLATFORMS at import, OpenBLAS its thread count), restored afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class ForkServer:
    """One multiprocessing fork server per local run, and the thread that talks to it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(PRELOAD))
        with _environ(env):
            multiprocessing.forkserver.ensure_running()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkserver")
        self._ready = self._pool.submit(self._probe)

    @property
    def ready(self) -> bool:
        """Whether the server has finished its imports (forks take milliseconds from then)."""
        return self._ready.done() and self._ready.exception() is None

    def wait_ready(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            self._ready.result(timeout)
        return self.ready

    def _probe(self) -> None:
        process = self._ctx.Process(target=probe, name="diloco-forkserver-probe", daemon=True)
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"fork server probe exited with {process.exitcode}")

    def fork(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> Future[ForkedChild]:
        """Fork `diloco-learner ARGV` (ARGV without the program) with `env`, logging to
        `log_path`; the future holds the started child (its stdin: a pipe to it)."""
        return self._pool.submit(self._fork, list(argv), dict(env), log_path)

    def _fork(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedChild:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        reader, writer = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=run_forked_learner,
            args=(argv, env, str(log_path), reader),
            name="diloco-learner",
            daemon=True,
        )
        try:
            process.start()
        finally:
            reader.close()
        stdin = os.fdopen(os.dup(writer.fileno()), "wb", buffering=0)
        writer.close()
        _wait_for_group(process.pid or 0, time.monotonic() + GROUP_WAIT_SECONDS)
        return ForkedChild(process, stdin)

    def finish_pending(self) -> None:
        """Wait for the forks requested so far (their children are the caller's to stop); no
        new ones after this."""
        self._pool.shutdown(wait=True)

    def close(self) -> None:
        """Stop the fork server (a forked child still alive dies with it: PDEATHSIG)."""
        self._pool.shutdown(wait=True)
        # multiprocessing has no public way to stop its fork server; these private names are
        # what its own tests use. Without them the server would exit with this process anyway.
        server = multiprocessing.forkserver._forkserver
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            getattr(server, "_stop")()  # noqa: B009 (private, see above)
        _stop_resource_tracker()


def _stop_resource_tracker(timeout: float = 5.0) -> None:
    """The fork server started multiprocessing's resource tracker too; it exits once every
    holder of its pipe has closed it (forked learners close their copy at start). Close ours and
    reap it, so it does not outlive the run; SIGKILL it if something still holds the pipe."""
    tracker = resource_tracker._resource_tracker
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    tracker._fd = tracker._pid = None  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] != 0:
                return
        except ChildProcessError:
            return  # not our child (any more)
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
