"""`diloco export`: the global model of a syncer checkpoint, as a file other tools load.

The source is one checkpoint (`ckpt-<seq>/`), a checkpoint directory or `gs://bucket/prefix`
(the syncer's `checkpoint.path`: its newest checkpoint that reads back intact) or a local run's
report folder (its `checkpoints/`). A sharded syncer's path holds one folder per shard
(`shard-I-of-S/`, each shard's own fragments): the export joins every shard's newest checkpoint
into the one model, and refuses when a shard's folder or one of its fragments is missing. Only the global parameters are written; the outer
optimizer's momentum stays behind. The metadata records the run, the outer step, the fragment
versions, the checkpoint's sequence number and the config hash.

Two formats, two namings:
- safetensors (default), leaves under their pytree paths: `safetensors.flax.load_file` /
  `safetensors.numpy.load_file` give a flat dict the user's model unflattens;
- safetensors with Hugging Face GPT-2 names (`--names hf`, the bundled GPT only: `hf_names`),
  with a config.json beside it;
- an orbax checkpoint directory (`--format orbax`), which `training.model.initFrom` reads back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors import SafetensorError

from diloco_trainer.shards import parse_shard_folder
from diloco_trainer.syncer.checkpoint import CheckpointError, CheckpointStore, Snapshot
from diloco_trainer.syncer.hf_names import NAMES as HF_NAMES
from diloco_trainer.syncer.hf_names import HfNamingError, gpt_sizes, hf_config, hf_gpt2_tensors
from diloco_trainer.syncer.storage import is_bucket_url
from diloco_trainer.workload.weights import write_orbax, write_safetensors

EXPORT_FORMAT = "diloco-export/1"
LOCAL_RUN_CHECKPOINTS = "checkpoints"
HF_CONFIG = "config.json"
Names = Literal["pytree", "hf"]
Format = Literal["safetensors", "orbax"]


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


def shard_roots(source: Path) -> list[Path] | None:
    """A sharded syncer's shard folders under `source` in shard order, or None when it has none.
    ExportError when they are of several shard counts or one is missing."""
    if not source.is_dir():
        return None
    found: dict[int, dict[int, Path]] = {}
    for entry in source.iterdir():
        shard = parse_shard_folder(entry.name)
        if shard is not None and entry.is_dir():
            found.setdefault(shard.count, {})[shard.index] = entry
    if not found:
        return None
    if len(found) > 1:
        counts = ", ".join(str(c) for c in sorted(found))
        raise ExportError(f"{source}: shard folders of several shard counts ({counts})")
    ((count, by_index),) = found.items()
    missing = [f"shard-{i}-of-{count}" for i in range(count) if i not in by_index]
    if missing:
        raise ExportError(f"{source}: {', '.join(missing)} missing: every shard's is needed")
    return [by_index[i] for i in range(count)]


def load_shards(roots: list[Path]) -> tuple[Snapshot, str, str]:
    """Every shard's newest checkpoint joined into one snapshot: each fragment's values and
    version from the shard that holds it, the outer steps added up. Also the checkpoints it
    came from and their sequence numbers, comma-separated in shard order."""
    snaps = []
    for root in roots:
        try:
            snap = CheckpointStore(root).load_latest(remove_stray=False)
        except CheckpointError as exc:
            raise ExportError(str(exc)) from exc
        if snap is None:
            raise ExportError(f"{root}: holds no checkpoint yet")
        snaps.append(snap)
    layout = snaps[0].layout
    params: dict[str, np.ndarray] = {}
    versions = []
    for p, names in enumerate(layout):
        holder = next((s for s in snaps if names and names[0] in s.params), None)
        if holder is None or any(n not in holder.params for n in names):
            raise ExportError(f"{roots[0].parent}: no shard's checkpoint holds fragment {p}")
        params.update({n: holder.params[n] for n in names})
        versions.append(holder.versions[p])
    joined = replace(
        snaps[0],
        params=params,
        versions=versions,
        outer_step=sum(s.outer_step for s in snaps),
        outer_state=[],
    )
    paths = ",".join(
        str((r / f"ckpt-{s.seq:010d}").resolve()) for r, s in zip(roots, snaps, strict=True)
    )
    return joined, paths, ",".join(str(s.seq) for s in snaps)


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


def export_metadata(
    snap: Snapshot, checkpoint: Path | str, seq: str | None = None
) -> dict[str, str]:
    return {
        "format": EXPORT_FORMAT,
        "run": str(snap.extra.get("run") or ""),
        "outerStep": str(snap.outer_step),
        "versions": json.dumps(snap.versions),
        "checkpointSeq": seq or str(snap.seq),
        "configHash": str(snap.extra.get("configHash") or "unknown"),
        "checkpoint": str(checkpoint.resolve() if isinstance(checkpoint, Path) else checkpoint),
    }


def _is_our_config(path: Path) -> bool:
    try:
        return "diloco_names" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_out(out: Path, fmt: Format, names: Names) -> None:
    """Refuse an `--out` (or a combination) that cannot be written, before reading anything."""
    if names == "hf" and fmt != "safetensors":
        raise ExportError("--names hf writes safetensors only (the format Hugging Face loads)")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: directory {out.parent} does not exist")
    if fmt == "safetensors" and out.suffix != ".safetensors":
        raise ExportError(f"--out {out}: the file name must end in .safetensors")
    if fmt == "orbax" and out.exists():
        # Not replaced: orbax would delete the whole directory, whatever else it holds.
        raise ExportError(f"--out {out}: exists; an orbax export writes a new directory")
    config = out.with_name(HF_CONFIG)
    if names == "hf" and config.exists() and not _is_our_config(config):
        raise ExportError(
            f"--out {out}: {config} exists and was not written by diloco export (it is "
            "replaced by the model's): export into another directory"
        )


def hf_export(params: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors under Hugging Face names, their config.json); ExportError naming the leaf when
    `params` is not the bundled GPT."""
    try:
        return hf_gpt2_tensors(params), hf_config(gpt_sizes(params))
    except HfNamingError as exc:
        raise ExportError(f"--names hf: {exc}") from exc


def write_json(data: Mapping[str, Any], target: Path) -> None:
    """`target` replaced at once (temp file beside it, then renamed)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_export(
    tensors: Mapping[str, np.ndarray],
    target: Path,
    metadata: dict[str, str],
    fmt: Format,
    config: Mapping[str, Any] | None,
) -> None:
    try:
        if fmt == "orbax":
            write_orbax(tensors, target, metadata)
        else:
            write_safetensors(tensors, target, metadata)
        if config is not None:
            write_json(config, target.with_name(HF_CONFIG))
    except ImportError as exc:
        raise ExportError(
            f"--format orbax needs the orbax-checkpoint package ({exc}): install "
            "orbax-checkpoint, or export to safetensors"
        ) from exc
    except (OSError, SafetensorError, ValueError) as exc:  # ValueError: orbax, pytree names
        raise ExportError(f"--out {target}: cannot write: {exc}") from exc


def export_checkpoint(
    source: str | Path, out: str | Path, names: Names = "pytree", fmt: Format = "safetensors"
) -> Exported:
    """Write the global parameters of `source`'s checkpoint to `out` (atomically)."""
    target = Path(out)
    check_out(target, fmt, names)
    shards = None if is_bucket_url(source) else shard_roots(Path(source))
    if shards is not None:
        snap, where, seqs = load_shards(shards)
        metadata = export_metadata(snap, where, seqs)
        checkpoint: Path | str = where
    else:
        snap, checkpoint = load_checkpoint(source)
        metadata = export_metadata(snap, checkpoint)
    tensors, config = snap.params, None
    if names == "hf":
        tensors, config = hf_export(snap.params)
        # transformers' loader refuses a safetensors file whose "format" is not a framework's;
        # the tensors are laid out as GPT-2's PyTorch modules hold them.
        metadata = {**metadata, "format": "pt", "exportFormat": EXPORT_FORMAT, "names": HF_NAMES}
    write_export(tensors, target, metadata, fmt, config)
    return Exported(target, checkpoint, len(tensors), snap.outer_step, metadata)
