"""`diloco export`: the global model of a syncer checkpoint as one safetensors file.

The source is one checkpoint (`ckpt-<seq>/`), a checkpoint directory or `gs://bucket/prefix`
(the syncer's `checkpoint.path`: its newest checkpoint that reads back intact) or a local run's
report folder (its `checkpoints/`). Only the global parameters are written, under their leaf names (pytree
paths), so `safetensors.flax.load_file` / `safetensors.numpy.load_file` give a flat dict the
user's model unflattens; the outer optimizer's momentum stays behind. `__metadata__` records the
run, the outer step, the fragment versions, the checkpoint's sequence number and the config hash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

from diloco_trainer.syncer.checkpoint import CheckpointError, CheckpointStore, Snapshot
from diloco_trainer.syncer.storage import is_bucket_url
from diloco_trainer.workload.weights import write_safetensors

EXPORT_FORMAT = "diloco-export/1"
LOCAL_RUN_CHECKPOINTS = "checkpoints"


class ExportError(Exception):
    """An export that cannot be made; the message says which input and why."""


@dataclass(frozen=True)
class Exported:
    out: Path
    checkpoint: Path | str  # a local directory or a gs:// URL
    leaves: int
    outer_step: int
    metadata: dict[str, str]


def checkpoint_root(source: Path) -> tuple[Path, bool]:
    """Where the checkpoints of `source` are, and whether `source` is one checkpoint itself."""
    if not source.exists():
        raise ExportError(f"{source}: no such file or directory")
    if not source.is_dir():
        raise ExportError(
            f"{source}: not a directory (expected a checkpoint, a checkpoint directory or a "
            "local run's report folder)"
        )
    if (source / "manifest.json").is_file():
        return source, True
    if any(entry.name.startswith("ckpt-") for entry in source.iterdir()):
        return source, False
    local = source / LOCAL_RUN_CHECKPOINTS
    if local.is_dir():
        return local, False
    raise ExportError(
        f"{source}: holds no checkpoint (no manifest.json, no ckpt-* directories, no "
        f"{LOCAL_RUN_CHECKPOINTS}/ folder of a local run)"
    )


def load_bucket_checkpoint(url: str) -> tuple[Snapshot, str]:
    """The snapshot at `gs://...`: one `ckpt-<seq>` or the newest valid one under a prefix."""
    parent, _, last = url.rstrip("/").rpartition("/")
    try:
        if re.fullmatch(r"ckpt-\d{10}", last) and parent != "gs:/":
            return CheckpointStore(parent, field="source").read_named(last), url.rstrip("/")
        store = CheckpointStore(url, field="source")
        snap = store.load_latest(remove_stray=False)  # an observer, as below
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    if snap is None:
        raise ExportError(f"{url}: holds no checkpoint yet")
    return snap, f"{store.location.url}/ckpt-{snap.seq:010d}"


def load_checkpoint(source: str | Path) -> tuple[Snapshot, Path | str]:
    """The snapshot to export and the checkpoint (directory or URL) it came from."""
    if is_bucket_url(source):
        return load_bucket_checkpoint(str(source))
    root, single = checkpoint_root(Path(source))
    try:
        if single:
            return CheckpointStore.read(root), root
        # An observer: never delete a running syncer's save in progress.
        snap = CheckpointStore(root).load_latest(remove_stray=False)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    if snap is None:
        raise ExportError(f"{root}: holds no checkpoint yet")
    return snap, root / f"ckpt-{snap.seq:010d}"


def export_metadata(snap: Snapshot, checkpoint: Path | str) -> dict[str, str]:
    return {
        "format": EXPORT_FORMAT,
        "run": str(snap.extra.get("run") or ""),
        "outerStep": str(snap.outer_step),
        "versions": json.dumps(snap.versions),
        "checkpointSeq": str(snap.seq),
        "configHash": str(snap.extra.get("configHash") or "unknown"),
        "checkpoint": str(checkpoint.resolve() if isinstance(checkpoint, Path) else checkpoint),
    }


def export_checkpoint(source: str | Path, out: str | Path) -> Exported:
    """Write the global parameters of `source`'s checkpoint to `out` (atomically)."""
    target = Path(out)
    if target.suffix != ".safetensors":
        raise ExportError(f"--out {target}: the file name must end in .safetensors")
    if not target.parent.is_dir():
        raise ExportError(f"--out {target}: directory {target.parent} does not exist")
    snap, checkpoint = load_checkpoint(source)
    metadata = export_metadata(snap, checkpoint)
    try:
        write_safetensors(snap.params, target, metadata)
    except (OSError, SafetensorError) as exc:
        raise ExportError(f"--out {target}: cannot write: {exc}") from exc
    return Exported(target, checkpoint, len(snap.params), snap.outer_step, metadata)
