"""Atomic syncer checkpoints under a root: a local directory or `gs://bucket/prefix`.

Layout of `<root>/ckpt-<seq>/` (the same files in both):
- `params.safetensors`: the global parameters (float32, by leaf name);
- `outer.safetensors`: outer optimizer state, `f<p>/<i>` = i-th leaf of fragment p's optax state;
- `manifest.json` (written last): format, seq, versions, outer step, layout, learner counters,
  free-form `extra`, and the sha256 of both tensor files.

A save writes `<root>/.tmp-<seq>-<pid>/`, fsyncs every file and the directory, renames it to
`ckpt-<seq>` and fsyncs the root; rename is atomic, so a SIGKILL leaves either the old set of
checkpoints or the new one plus a stray `.tmp-*` (removed on the next load). In a bucket there is
no rename: the files are uploaded under `ckpt-<seq>/` and the manifest last, as the commit marker
(storage.py). Load takes the newest checkpoint whose manifest parses and whose checksums match,
warning about every one it skips.

`versions.json` (the version journal) holds the highest version of each fragment ever published,
rewritten (write + rename; one object write in a bucket) before each new version is announced. After a crash the syncer resumes
numbering above it, so version numbers never go backwards even when content does.
`fragment-<p>.safetensors` (journal.py) holds the content of fragment p's newest version, written
just before the version journal: a restart serves what the learners already hold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from diloco_trainer.config import SERVING_LOCK_FILE
from diloco_trainer.syncer.gcs import BucketPrefix
from diloco_trainer.syncer.journal import (
    JournaledFragment,
    decode,
    encode,
    fragment_file,
    is_journal_entry,
)
from diloco_trainer.syncer.storage import (
    MANIFEST,
    CheckpointError,
    LocalDir,
    Location,
    StorageAccessError,
    StorageUnavailable,
    Superseded,
    is_bucket_url,
)

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "Snapshot",
    "StorageAccessError",
    "StorageUnavailable",
    "Superseded",
]

log = logging.getLogger("diloco.checkpoint")

FORMAT = "diloco-syncer-checkpoint/1"
JOURNAL = "versions.json"
LEASE_JOURNAL = "data-leases.json"  # the data lease book, rewritten on every assignment
# What a freshly formatted volume holds before anyone writes to it (ext4's lost+found): not a
# sign of someone else's data, so a new run may start in it.
FILESYSTEM_ENTRIES = ("lost+found",)
_NAME = re.compile(r"^ckpt-(\d{10})$")


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


def _seq(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def open_location(root: str | Path, field: str = "checkpoint.path") -> Location:
    """The location for `root`: `gs://bucket/prefix` or a local directory. `field` names the
    setting `root` came from, for messages about access."""
    if is_bucket_url(root):
        return BucketPrefix(str(root), field)
    return LocalDir(Path(root))


class CheckpointStore:
    def __init__(self, root: str | Path, keep: int = 3, field: str = "checkpoint.path") -> None:
        """`root`: a directory or `gs://bucket/prefix`; `field` names the setting it came from
        in messages about access to it."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep: must be >= 1, got {keep}")
        self.location: Location = open_location(root, field)
        self.root: Path | str = self.location.url if is_bucket_url(root) else Path(root)
        self.keep = keep
        # What the last load_latest found unusable among newer checkpoints than the one it
        # loaded (one line each): a rollback past them, reported in status and a metric.
        self.skipped: list[str] = []
        self._verified: set[str] = set()  # checkpoints this process has read back intact

    def _existing(self) -> list[tuple[int, str]]:
        """The committed checkpoints, oldest first."""
        found = ((_seq(name), name) for name in self.location.checkpoints())
        return sorted((seq, name) for seq, name in found if seq is not None)

    def _next_seq(self) -> int:
        # Above every ckpt-* present, committed or not: a new checkpoint never shares a name
        # with the leftovers of an interrupted one.
        seqs = [s for s in map(_seq, self.location.entries()) if s is not None]
        return max(seqs, default=0) + 1

    def save(self, snap: Snapshot) -> Path | str:
        """Write `snap` atomically as the next checkpoint; prune to `keep`. Returns where it is
        (a local path, or a gs:// URL)."""
        seq = self._next_seq()
        name = f"ckpt-{seq:010d}"
        with self.location.stage(name) as tmp:
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
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            where = self.location.publish(tmp, name)
        if self.location.verified_publish:
            self._verified.add(name)
        self._prune()
        return where

    def _newest_loadable(self) -> str | None:
        for _, name in reversed(self._existing()):
            if name in self._verified:
                return name
            try:
                with self.location.fetch(name) as path:
                    self.verify(path)
            except CheckpointError as exc:
                log.error(
                    "event=checkpoint_unreadable path=%s/%s reason=%r",
                    self.location.url,
                    name,
                    str(exc),
                )
                continue
            self._verified.add(name)
            return name
        return None

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints, and in any case the newest one that reads back
        intact: if the ones just written are damaged, the last good one is all a restart has."""
        good = self._newest_loadable()
        for _, old in self._existing()[: -self.keep]:
            if old != good:
                self.location.remove(old)
                self._verified.discard(old)

    def claim(self) -> list[str]:
        """Become the one writer of this location before serving (storage.Location.claim):
        the journal files changed since this process read them, to read again."""
        return self.location.claim()

    def record_versions(self, versions: list[int]) -> None:
        """Journal the published versions (atomic replace; survives a process kill)."""
        self.location.replace_small(JOURNAL, json.dumps({"versions": versions}).encode())

    def record_leases(self, book: dict[str, Any]) -> None:
        """Journal the data lease book (atomic replace, durable): a unit is told of a new lease
        only once a restart would remember it."""
        self.location.replace_small(LEASE_JOURNAL, json.dumps(book).encode())

    def recorded_leases(self) -> Any:
        """The journaled lease book (JSON), or None when absent or unreadable."""
        where = f"{self.location.url}/{LEASE_JOURNAL}"
        try:
            data = self.location.read_small(LEASE_JOURNAL)
            return None if data is None else json.loads(data)
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("event=lease_journal_unreadable path=%s error=%r", where, str(exc))
            return None

    def record_fragment(self, entry: JournaledFragment) -> None:
        """Journal a fragment's newest version (journal.py), before it is announced."""
        self.location.replace_small(fragment_file(entry.index), encode(entry))

    def recorded_fragment(self, index: int) -> JournaledFragment | None:
        """Fragment `index`'s journal entry, or None when absent or unreadable (the checkpoint
        then stands; a storage failure is raised, as for checkpoints)."""
        data = self.location.read_small(fragment_file(index))
        if data is None:
            return None
        try:
            return decode(data, index)
        except ValueError as exc:
            log.warning(
                "event=fragment_journal_unreadable path=%s/%s error=%r",
                self.location.url,
                fragment_file(index),
                str(exc),
            )
            return None

    def recorded_versions(self) -> list[int] | None:
        where = f"{self.location.url}/{JOURNAL}"
        try:
            data = self.location.read_small(JOURNAL)
            if data is None:
                return None
            raw = json.loads(data)["versions"]
            return [int(v) for v in raw]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("event=version_journal_unreadable path=%s error=%r", where, str(exc))
            return None

    @staticmethod
    def verify(path: Path, label: str | None = None) -> dict[str, Any]:
        """The manifest of one checkpoint directory whose files match their checksums; raises
        CheckpointError otherwise (naming `label`, else `path`)."""
        where = label or str(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where}: {MANIFEST} unreadable: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a {FORMAT} checkpoint")
        sums = manifest.get("sha256") or {}
        for name in ("params.safetensors", "outer.safetensors"):
            try:
                actual = _sha256(path / name)
            except OSError as exc:
                raise CheckpointError(f"{where}: {name} unreadable: {exc}") from exc
            if not isinstance(sums, dict) or actual != sums.get(name):
                raise CheckpointError(f"{where}: {name} checksum mismatch (partial or corrupt)")
        return manifest

    @classmethod
    def read(cls, path: Path, label: str | None = None) -> Snapshot:
        """Read and verify one checkpoint directory; raises CheckpointError if it is unusable."""
        manifest = cls.verify(path, label)
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
            raise CheckpointError(f"{label or path}: inconsistent checkpoint: {exc!r}") from exc
        return snap

    def read_named(self, name: str) -> Snapshot:
        """Read and verify checkpoint `name` (`ckpt-<seq>`) of this root."""
        with self.location.fetch(name) as path:
            return self.read(path, f"{self.location.url}/{name}")

    def newest_manifest(self, after: int | None = None) -> dict[str, Any] | None:
        """The manifest of the newest checkpoint if its seq is above `after` (None: any), read
        alone: its tensors are not fetched or checked. For a standby taking over, which has
        every fragment from the journal and needs only the run state."""
        existing = self._existing()
        if not existing or (after is not None and existing[-1][0] <= after):
            return None
        name = existing[-1][1]
        try:
            data = self.location.read_small(f"{name}/{MANIFEST}")
            manifest = json.loads(data) if data is not None else None
        except (OSError, ValueError, RecursionError) as exc:
            log.warning(
                "event=manifest_unreadable path=%s/%s error=%r", self.location.url, name, exc
            )
            return None
        return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None

    def remove_strays(self) -> None:
        """Delete leftovers of interrupted saves (only the location's owner may)."""
        for name in self.location.strays():
            log.warning(
                "event=checkpoint_stray_tmp path=%s/%s action=removed", self.location.url, name
            )
            self.location.remove(name)

    def load_latest(self, remove_stray: bool = True) -> Snapshot | None:
        """The newest valid checkpoint, or None if the location is absent or empty.

        `remove_stray` deletes leftovers of interrupted saves (`.tmp-*` directories, `ckpt-*`
        prefixes without a manifest in a bucket): only the location's owner (the syncer, at
        start) may do that; an observer reading while a syncer runs would delete its save in
        progress, so observers pass False.

        Corrupt or partial checkpoints are skipped with a warning; a storage failure is raised
        (StorageUnavailable), never taken for damage. A location that holds other things but no
        valid checkpoint is an error: restarting from scratch there would silently throw away
        a run.
        """
        self.location.check()
        if not self.location.exists():
            return None
        if remove_stray:
            self.remove_strays()
        problems: list[str] = []
        self.skipped = []
        for seq, name in reversed(self._existing()):
            try:
                snap = self.read_named(name)
            except StorageUnavailable:
                raise
            except CheckpointError as exc:
                # ERROR: loading an older checkpoint than the newest throws work away.
                log.error("event=checkpoint_skipped seq=%d reason=%r", seq, str(exc))
                problems.append(str(exc))
                continue
            self.skipped = problems
            self._verified.add(name)
            log.log(
                logging.ERROR if problems else logging.INFO,
                "event=checkpoint_loaded seq=%d path=%s/%s outer_step=%d rolled_back_past=%d",
                seq,
                self.location.url,
                name,
                snap.outer_step,
                len(problems),
            )
            return snap
        self._refuse_foreign_content(problems)
        return None

    def _refuse_foreign_content(self, problems: list[str]) -> None:
        ignorable = {JOURNAL, f".{JOURNAL}.tmp", LEASE_JOURNAL, f".{LEASE_JOURNAL}.tmp"}
        ignorable |= {SERVING_LOCK_FILE, *FILESYSTEM_ENTRIES, *self.location.strays()}
        leftovers = sorted(
            name
            for name in self.location.entries()
            if name not in ignorable and not name.startswith(".tmp-") and not is_journal_entry(name)
        )
        if leftovers:
            detail = "; ".join(problems) if problems else f"unexpected entries {leftovers[:5]}"
            raise CheckpointError(
                f"checkpoint.path {self.location.url} is not empty but holds no valid "
                f"checkpoint: {detail}"
            )
