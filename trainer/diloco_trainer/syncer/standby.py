"""A warm standby syncer: `diloco-syncer --lock PATH`.

Two syncers given the same lock file, port and checkpoint path: the first to lock the file
serves; the other loads the checkpoint, compiles its merge, and waits on the lock while it follows
the fragment journal (journal.py). The kernel releases a lock the moment its holder dies, SIGKILL
included, so the standby starts serving within a second: it reads only the journal entries and
the newest checkpoint's manifest it has not seen, binds the port the dead one held, and serves the
very versions the learners hold (docs/design.md, "A syncer kill costs neither versions nor
time").

The lock must be on a filesystem local to both processes (one machine, or one pod's emptyDir):
flock over a network filesystem is not to be trusted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_trainer.syncer.storage import CheckpointError

if TYPE_CHECKING:
    from diloco_trainer.syncer.core import Syncer

log = logging.getLogger("diloco.syncer")
FOLLOW_SECONDS = 0.5


class ServingLock:
    """An exclusive lock on a local file, held by the serving syncer for as long as it lives."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children

    def try_acquire(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def acquire(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def announce(self) -> None:
        """Write the holder's pid into the file: who serves, for a supervisor to read."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)


def serving_pid(path: Path) -> int | None:
    """The pid the lock file names (its holder, if the holder is alive), else None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def wait_as_standby(
    syncer: Syncer, lock: ServingLock, stop: threading.Event, every: float = FOLLOW_SECONDS
) -> bool:
    """Follow the journal until the lock is ours (the serving syncer died or stopped): True.
    False once `stop` is set (SIGTERM), even with the lock ours: on Kubernetes the kubelet
    stops both containers of the pod at once, and a standby that took over from a syncer told
    to stop would serve on, from a pod on its way out, next to the replacement pod's syncer."""
    ours = threading.Event()

    def acquire() -> None:
        lock.acquire()
        ours.set()

    threading.Thread(target=acquire, name="serving-lock", daemon=True).start()
    while not stop.is_set() and not ours.wait(every):
        try:
            syncer.follow()
        except (CheckpointError, ValueError) as exc:  # the next look may do better
            log.warning("event=standby_follow_failed error=%r", str(exc))
    return not stop.is_set()
