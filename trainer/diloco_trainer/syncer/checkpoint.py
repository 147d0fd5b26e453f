"""Atomic syncer checkpoints: a directory per checkpoint, written aside and renamed into place.

Layout of `<root>/ckpt-<seq>/`:
- `params.safetensors`: the global parameters (float32, by leaf name);
- `outer.safetensors`: outer optimizer state, `f<p>/<i>` = i-th leaf of fragment p's optax state;
- `manifest.json` (written last): format, seq, versions, outer step, layout, learner counters,
  free-form `extra`, and the sha256 of both tensor files.

A save writes `<root>/.tmp-<seq>-<pid>/`, fsyncs every file and the directory, renames it to
`ckpt-<seq>` and fsyncs the root; rename is atomic, so a SIGKILL leaves either the old set of
checkpoints or the new one plus a stray `.tmp-*` (removed on the next load). Load takes the newest
checkpoint whose manifest parses and whose checksums match, warning about every one it skips.

`versions.json` (the version journal) holds the highest version of each fragment ever published,
rewritten (write + rename) before each new version is announced. After a crash the syncer resumes
numbering above it, so version numbers never go backwards even when content does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

log = logging.getLogger("diloco.checkpoint")

FORMAT = "diloco-syncer-checkpoint/1"
JOURNAL = "versions.json"
LEASE_JOURNAL = "data-leases.json"  # the data lease book, rewritten on every assignment
# What a freshly formatted volume holds before anyone writes to it (ext4's lost+found): not a
# sign of someone else's data, so a new run may start in it.
FILESYSTEM_ENTRIES = ("lost+found",)
_NAME = re.compile(r"^ckpt-(\d{10})$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected (the message says where and why)."""


@dataclass
class Snapshot:
    """Everything the syncer needs to resume (pending contributions are deliberately not kept:
    learners resend on their next schedule)."""

    params: dict[str, np.ndarray]
    outer_state: list[list[np.ndarray]]
    versions: list[int]
    layout: list[list[str]]
    outer_step: int
    learners: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    seq: int = 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


class CheckpointStore:
    def __init__(self, root: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint.keep: must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        # What the last load_latest found unusable among newer checkpoints than the one it
        # loaded (one line each): a rollback past them, reported in status and a metric.
        self.skipped: list[str] = []
        self._verified: set[Path] = set()  # checkpoints this process has read back intact

    def _existing(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _NAME.match(entry.name)
            if m and entry.is_dir():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def save(self, snap: Snapshot) -> Path:
        """Write `snap` atomically as the next checkpoint; prune to `keep`. Returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        existing = self._existing()
        seq = (existing[-1][0] + 1) if existing else 1
        tmp = self.root / f".tmp-{seq:010d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        params_path, outer_path = tmp / "params.safetensors", tmp / "outer.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in snap.params.items()}, params_path)
        outer = {
            f"f{p}/{i}": np.ascontiguousarray(leaf)
            for p, leaves in enumerate(snap.outer_state)
            for i, leaf in enumerate(leaves)
        }
        save_file(outer, outer_path)
        manifest = {
            "format": FORMAT,
            "seq": seq,
            "versions": snap.versions,
            "outerStep": snap.outer_step,
            "layout": snap.layout,
            "outerStateLeaves": [len(leaves) for leaves in snap.outer_state],
            "learners": snap.learners,
            "extra": snap.extra,
            "sha256": {
                "params.safetensors": _sha256(params_path),
                "outer.safetensors": _sha256(outer_path),
            },
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for path in (params_path, outer_path, tmp / "manifest.json"):
            _fsync_file(path)
        _fsync_dir(tmp)
        final = self.root / f"ckpt-{seq:010d}"
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def _newest_loadable(self) -> Path | None:
        for _, path in reversed(self._existing()):
            if path in self._verified:
                return path
            try:
                self.verify(path)
            except CheckpointError as exc:
                log.error("event=checkpoint_unreadable path=%s reason=%r", path, str(exc))
                continue
            self._verified.add(path)
            return path
        return None

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints, and in any case the newest one that reads back
        intact: if the ones just written are damaged, the last good one is all a restart has."""
        good = self._newest_loadable()
        for _, old in self._existing()[: -self.keep]:
            if old != good:
                shutil.rmtree(old, ignore_errors=True)
                self._verified.discard(old)

    def record_versions(self, versions: list[int]) -> None:
        """Journal the published versions (atomic replace; survives a process kill)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{JOURNAL}.tmp"
        with tmp.open("w") as f:
            f.write(json.dumps({"versions": versions}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / JOURNAL)
        _fsync_dir(self.root)  # the rename itself survives a power loss

    def record_leases(self, book: dict[str, Any]) -> None:
        """Journal the data lease book (atomic replace, fsynced): a unit is told of a new lease
        only once a restart would remember it."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{LEASE_JOURNAL}.tmp"
        with tmp.open("w") as f:
            f.write(json.dumps(book))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / LEASE_JOURNAL)
        _fsync_dir(self.root)

    def recorded_leases(self) -> Any:
        """The journaled lease book (JSON), or None when absent or unreadable."""
        path = self.root / LEASE_JOURNAL
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("event=lease_journal_unreadable path=%s error=%r", path, str(exc))
            return None

    def recorded_versions(self) -> list[int] | None:
        path = self.root / JOURNAL
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())["versions"]
            return [int(v) for v in raw]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("event=version_journal_unreadable path=%s error=%r", path, str(exc))
            return None

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of one checkpoint directory whose files match their checksums; raises
        CheckpointError otherwise."""
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path}: manifest.json unreadable: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a {FORMAT} checkpoint")
        sums = manifest.get("sha256") or {}
        for name in ("params.safetensors", "outer.safetensors"):
            try:
                actual = _sha256(path / name)
            except OSError as exc:
                raise CheckpointError(f"{path}: {name} unreadable: {exc}") from exc
            if not isinstance(sums, dict) or actual != sums.get(name):
                raise CheckpointError(f"{path}: {name} checksum mismatch (partial or corrupt)")
        return manifest

    @classmethod
    def read(cls, path: Path) -> Snapshot:
        """Read and verify one checkpoint directory; raises CheckpointError if it is unusable."""
        manifest = cls.verify(path)
        try:
            params = dict(load_file(path / "params.safetensors"))
            outer = dict(load_file(path / "outer.safetensors"))
            counts = [int(n) for n in manifest["outerStateLeaves"]]
            snap = Snapshot(
                params=params,
                outer_state=[[outer[f"f{p}/{i}"] for i in range(n)] for p, n in enumerate(counts)],
                versions=[int(v) for v in manifest["versions"]],
                layout=[list(map(str, frag)) for frag in manifest["layout"]],
                outer_step=int(manifest["outerStep"]),
                learners=dict(manifest.get("learners") or {}),
                extra=dict(manifest.get("extra") or {}),
                seq=int(manifest["seq"]),
            )
        except (KeyError, TypeError, ValueError, SafetensorError) as exc:
            raise CheckpointError(f"{path}: inconsistent checkpoint: {exc!r}") from exc
        return snap

    def load_latest(self, remove_stray: bool = True) -> Snapshot | None:
        """The newest valid checkpoint, or None if the directory is absent or empty.

        `remove_stray` deletes `.tmp-*` leftovers of interrupted saves: only the directory's owner
        (the syncer, at start) may do that; an observer reading while a syncer runs would delete
        its save in progress, so observers pass False.

        Corrupt or partial checkpoints are skipped with a warning. A directory that holds other
        things but no valid checkpoint is an error: restarting from scratch there would silently
        throw away a run.
        """
        if not self.root.exists():
            return None
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint.path {self.root} exists and is not a directory")
        for entry in self.root.iterdir() if remove_stray else []:
            if entry.name.startswith(".tmp-"):
                log.warning("event=checkpoint_stray_tmp path=%s action=removed", entry)
                shutil.rmtree(entry, ignore_errors=True)
        problems: list[str] = []
        self.skipped = []
        for seq, path in reversed(self._existing()):
            try:
                snap = self.read(path)
            except CheckpointError as exc:
                # ERROR: loading an older checkpoint than the newest throws work away.
                log.error("event=checkpoint_skipped seq=%d reason=%r", seq, str(exc))
                problems.append(str(exc))
                continue
            self.skipped = problems
            self._verified.add(path)
            log.log(
                logging.ERROR if problems else logging.INFO,
                "event=checkpoint_loaded seq=%d path=%s outer_step=%d rolled_back_past=%d",
                seq, path, snap.outer_step, len(problems),
            )  # fmt: skip
            return snap
        leftovers = sorted(
            e.name
            for e in self.root.iterdir()
            if e.name not in (JOURNAL, f".{JOURNAL}.tmp", LEASE_JOURNAL, f".{LEASE_JOURNAL}.tmp")
            and e.name not in FILESYSTEM_ENTRIES
            and not e.name.startswith(".tmp-")
        )
        if leftovers:
            detail = "; ".join(problems) if problems else f"unexpected entries {leftovers[:5]}"
            raise CheckpointError(
                f"checkpoint.path {self.root} is not empty but holds no valid checkpoint: {detail}"
            )
        return None
