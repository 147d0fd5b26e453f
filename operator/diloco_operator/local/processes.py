"""OS processes for the local backend: start, signal, reap and stop them without orphans.

Each child leads its own process group: a signal to the group reaches anything the child
started, and a Ctrl-C on the terminal reaches only the supervisor, which then stops the children in
order instead of having them die mid-write. The group stays in the supervisor's session: a session
per child would also put each in its own scheduler autogroup (Linux CFS, on by default), and
with more autogroups than cores the learners' speeds swing for seconds at a time; phase-locked
merges then wait for whoever is behind (docs/design.md, "The local runtime's rounds").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import psutil
from diloco_trainer.learner.lifetime import die_with_parent

log = logging.getLogger(__name__)


class Child(Protocol):
    """What the table needs of a child: subprocess.Popen, or a learner forked by the fork
    server (forkserver.ForkedChild)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class ManagedProcess:
    """A child process and what the supervisor knows about it."""

    key: str
    argv: list[str]
    popen: Child
    log_path: Path
    started_at: float
    log_file: IO[bytes] | None  # None: the child opened its log itself
    paused: bool = False
    returncode: int | None = None
    # Every pid seen in this child's process tree, to prove afterwards that none survived.
    seen_pids: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.returncode is None


class ProcessTable:
    """The children of one local run, by key (e.g. `syncer`, `unit-2`)."""

    def __init__(self) -> None:
        self._procs: dict[str, ManagedProcess] = {}
        self._finished: list[ManagedProcess] = []
        self._unreported: dict[str, int] = {}  # reaped exits the next poll() returns

    def __contains__(self, key: str) -> bool:
        return key in self._procs

    def get(self, key: str) -> ManagedProcess | None:
        return self._procs.get(key)

    def keys(self) -> list[str]:
        return list(self._procs)

    def spawn(
        self,
        key: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        stdin_pipe: bool = False,
    ) -> ManagedProcess:
        """Start `argv` in a new process group with stdout+stderr appended to `log_path`; its stdin is
        a pipe (for `hand_over`) when `stdin_pipe`, else /dev/null."""
        if key in self._procs and self._procs[key].alive():
            raise RuntimeError(f"process {key} is still running (pid {self._procs[key].pid})")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("ab")
        try:
            popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                process_group=0,
                close_fds=True,
                # SIGKILL the child when the supervisor dies, even by SIGKILL: no orphan.
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        except OSError:
            log_file.close()
            raise
        return self.adopt(key, argv, popen, log_path, log_file)

    def adopt(
        self,
        key: str,
        argv: Sequence[str],
        child: Child,
        log_path: Path,
        log_file: IO[bytes] | None = None,
    ) -> ManagedProcess:
        """Register a child started elsewhere (a fork server's) under `key`."""
        if key in self._procs and self._procs[key].alive():
            raise RuntimeError(f"process {key} is still running (pid {self._procs[key].pid})")
        proc = ManagedProcess(
            key=key,
            argv=list(argv),
            popen=child,
            log_path=log_path,
            started_at=time.monotonic(),
            log_file=log_file,
        )
        proc.seen_pids.add(child.pid)
        self._unreported.pop(key, None)  # the old process under this key is replaced
        if key in self._procs:
            self._finished.append(self._procs[key])
        self._procs[key] = proc
        log.info("process=started key=%s pid=%d log=%s", key, child.pid, log_path)
        return proc

    def hand_over(self, key: str, new_key: str, line: bytes, log_path: Path) -> bool:
        """Write `line` to the stdin pipe of the waiting process `key` and close it; the process
        is `new_key` from then on (signals, polls, stops). False, and nothing renamed, when it
        has died or cannot take the line."""
        proc = self._procs.get(key)
        if proc is None or not proc.alive() or proc.popen.stdin is None:
            return False
        if new_key in self._procs and self._procs[new_key].alive():
            raise RuntimeError(
                f"process {new_key} is still running (pid {self._procs[new_key].pid})"
            )
        try:
            proc.popen.stdin.write(line)
            proc.popen.stdin.close()
        except (BrokenPipeError, OSError):
            return False
        if proc.popen.poll() is not None:
            return False  # the next poll() reports its exit under the old key
        self.rename(key, new_key, log_path)
        log.info("process=handed-over key=%s new_key=%s pid=%d", key, new_key, proc.pid)
        return True

    def rename(self, key: str, new_key: str, log_path: Path | None = None) -> ManagedProcess:
        """The running process `key` is `new_key` from now on (a dead `new_key` is retired)."""
        proc = self._procs.pop(key)
        if new_key in self._procs:
            self._finished.append(self._procs[new_key])
        proc.key, proc.started_at = new_key, time.monotonic()
        proc.log_path = log_path or proc.log_path
        self._procs[new_key] = proc
        return proc

    def any_exited(self) -> bool:
        """Whether a child exited since the last `poll` (which will report it); cheap enough to
        call between ticks, so a death is acted on at once, as a watch event would be."""
        return any(
            p.returncode is None and p.popen.poll() is not None for p in self._procs.values()
        )

    def poll(self) -> dict[str, int]:
        """Children that exited since the last poll, reaped now or by a `stop` since; returns
        key -> exit code (negative: killed by that signal)."""
        self._reap()
        exited, self._unreported = self._unreported, {}
        return exited

    def _reap(self) -> None:
        for key, proc in self._procs.items():
            if proc.returncode is not None:
                continue
            self._note_tree(proc)
            code = proc.popen.poll()
            if code is not None:
                proc.returncode = code
                _close_files(proc)
                self._unreported[key] = code
                log.info("process=exited key=%s pid=%d code=%d", key, proc.pid, code)

    def signal(self, key: str, sig: signal.Signals) -> bool:
        """Send `sig` to the process group of `key`; False when it is not running."""
        proc = self._procs.get(key)
        if proc is None or not proc.alive():
            return False
        self._note_tree(proc)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGSTOP:
            proc.paused = True
        elif sig == signal.SIGCONT:
            proc.paused = False
        return True

    def stop(self, keys: Iterable[str], grace_seconds: float = 5.0) -> None:
        """Stop children together: SIGCONT (a stopped process cannot handle SIGTERM), SIGTERM
        to each group, then SIGKILL whatever is left after `grace_seconds`."""
        keys = [k for k in keys if k in self._procs]
        _terminate_groups([self._procs[k] for k in keys], grace_seconds)
        self._reap()
        # Stopped on purpose: not an exit to act on. Any other child that died meanwhile is
        # reported by the next poll().
        for key in keys:
            self._unreported.pop(key, None)

    def stop_all(self, grace_seconds: float = 5.0, batches: Iterable[Iterable[str]] = ()) -> None:
        """Stop every child. Each batch of keys is stopped together (one shared grace period)
        before the next; children in no batch go last."""
        done: set[str] = set()
        for batch in batches:
            procs = [self._procs[k] for k in batch if k in self._procs and k not in done]
            done.update(p.key for p in procs)
            _terminate_groups(procs, grace_seconds)
        _terminate_groups([p for k, p in self._procs.items() if k not in done], grace_seconds)
        self._reap()

    def survivors(self) -> list[int]:
        """Pids from any child's tree that are still alive (not zombies): should be empty
        after `stop_all`."""
        alive: list[int] = []
        for proc in [*self._finished, *self._procs.values()]:
            for pid in sorted(proc.seen_pids):
                if _pid_alive(pid):
                    alive.append(pid)
        return alive

    def _note_tree(self, proc: ManagedProcess) -> None:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(proc.pid)
            proc.seen_pids.update(child.pid for child in parent.children(recursive=True))


def _close_files(proc: ManagedProcess) -> None:
    if proc.log_file is not None and not proc.log_file.closed:
        proc.log_file.close()
    if proc.popen.stdin is not None and not proc.popen.stdin.closed:
        with contextlib.suppress(OSError):
            proc.popen.stdin.close()


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate_groups(procs: Sequence[ManagedProcess], grace_seconds: float) -> None:
    """SIGTERM each process group, wait up to `grace_seconds` for the leaders and their groups,
    SIGKILL whatever is left, and reap the leaders."""
    live = [p for p in procs if p.popen.poll() is None or _group_alive(p.pid)]
    for proc in live:
        with contextlib.suppress(psutil.Error):
            proc.seen_pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        proc.paused = False
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if all(p.popen.poll() is not None and not _group_alive(p.pid) for p in live):
            break
        time.sleep(0.05)
    for proc in live:
        if proc.popen.poll() is None or _group_alive(proc.pid):
            log.info("process=kill key=%s pid=%d reason=grace-expired", proc.key, proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        # Group members outside the group (a child that called setsid) are killed by pid.
        for pid in proc.seen_pids:
            if pid != proc.pid and _pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)
        if proc.returncode is None and proc.popen.returncode is not None:
            proc.returncode = proc.popen.returncode
        _close_files(proc)
