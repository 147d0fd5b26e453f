"""Where checkpoints live: a local directory or a `gs://bucket/prefix`, behind one small seam
(the directory: `LocalDir` in checkpoint.py; the bucket: `BucketPrefix` in gcs.py).

`CheckpointStore` (checkpoint.py) owns the format, numbering, pruning and verification; a
location only knows how to make a staged checkpoint visible at once, how to hand back a
checkpoint's files as a local directory, and how to delete one.

Commit differs by medium. A directory is written aside (`.tmp-<seq>-<pid>/`) and renamed into
place: rename is atomic, so a `ckpt-<seq>/` is complete or damaged, never half written. An object
store has no atomic rename, so there every file is uploaded under `ckpt-<seq>/` and
`manifest.json` (which holds the other files' digests) goes last: the manifest is the commit
marker, a `ckpt-<seq>/` without one is an interrupted upload, and deleting starts with it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

MANIFEST = "manifest.json"
GCS_SCHEME = "gs://"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected (the message says where and why)."""


class StorageUnavailable(CheckpointError):
    """The checkpoint location could not be read or written (a network or service failure):
    says nothing about the checkpoints themselves, so a reader must not skip past them."""


class StorageAccessError(StorageUnavailable):
    """The checkpoint location cannot be used at all (no credential, no permission, no bucket,
    no client library): a setting to fix, not damaged data."""


class Superseded(CheckpointError):
    """Another syncer has written this checkpoint location since this one claimed it: two
    syncers on one path. The one that finds out stops serving and writes nothing more."""


class Location(Protocol):
    """One checkpoint root. Names are the root's top-level entries (`ckpt-<seq>`, the journal)."""

    url: str
    # True where `publish` itself proved every byte arrived (checksummed uploads): the store
    # then need not read a fresh checkpoint back to trust it.
    verified_publish: bool

    def check(self) -> None:
        """Raise CheckpointError (StorageAccessError for access) unless the root is usable."""

    def exists(self) -> bool: ...

    def entries(self) -> list[str]:
        """Every top-level name under the root, checkpoint or not."""

    def checkpoints(self) -> list[str]:
        """Names of the committed `ckpt-*` entries (complete as far as the medium can tell)."""

    def strays(self) -> list[str]:
        """Interrupted saves: never valid, removed by the root's owner at start."""

    def remove(self, name: str) -> None: ...

    def stage(self, name: str) -> AbstractContextManager[Path]:
        """An empty local directory to write checkpoint `name` into."""

    def publish(self, staged: Path, name: str) -> Path | str:
        """Make the staged files checkpoint `name` at once; returns where it now is (a local
        path, or a URL)."""

    def fetch(self, name: str) -> AbstractContextManager[Path]:
        """Checkpoint `name`'s files in a local directory."""

    def read_small(self, name: str) -> bytes | None:
        """A small top-level file (the version journal), None if absent."""

    def replace_small(self, name: str, data: bytes) -> None:
        """Replace a small top-level file at once (a reader sees old or new, never a mix).
        Raises Superseded when the location is claimed and another writer got there first."""

    def claim(self) -> list[str]:
        """Make this process the location's one writer, from now on; returns the small files
        changed since this process read them (the caller reads them again)."""


def is_bucket_url(root: str | Path) -> bool:
    return isinstance(root, str) and root.startswith(GCS_SCHEME)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalDir:
    """A directory on a local or mounted filesystem (a PersistentVolume)."""

    verified_publish = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"checkpoint.path {self.root} exists and is not a directory")

    def exists(self) -> bool:
        return self.root.exists()

    def entries(self) -> list[str]:
        return [e.name for e in self.root.iterdir()] if self.root.is_dir() else []

    def checkpoints(self) -> list[str]:
        return [n for n in self.entries() if n.startswith("ckpt-") and (self.root / n).is_dir()]

    def strays(self) -> list[str]:
        return [n for n in self.entries() if n.startswith(".tmp-")]

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[Path]:
        # Beside its final place (same filesystem: the rename is atomic); the pid keeps two
        # writers apart; a crash leaves it for the next start's stray removal.
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{name.removeprefix('ckpt-')}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        yield tmp

    def publish(self, staged: Path, name: str) -> Path | str:
        for path in staged.iterdir():
            _fsync_file(path)
        _fsync_dir(staged)
        final = self.root / name
        os.rename(staged, final)
        _fsync_dir(self.root)
        return final

    @contextmanager
    def fetch(self, name: str) -> Iterator[Path]:
        yield self.root / name

    def read_small(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.exists() else None

    def claim(self) -> list[str]:
        # The serving lock fences a directory (`.serving.lock` on a claim, standby.py); an
        # emptyDir is one pod's own, so no second writer can reach it.
        return []

    def replace_small(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.tmp"
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)
        _fsync_dir(self.root)  # the rename itself survives a power loss
