"""`training.model.initFrom: gs://...`: starting weights kept in a bucket.

The URL names either one object, a safetensors file, or a prefix holding an orbax checkpoint
(every object below it). Either is downloaded into a temporary directory and read there as a
local path would be: safetensors and orbax read local files, and a model's weights are read
once, at the syncer's start (the syncer alone reads initFrom, so this lives with its storage
code and hands `workload.weights` local paths). The download goes through the checkpoint code's `BucketPrefix`, so
credentials (Application Default Credentials, Workload Identity), `STORAGE_EMULATOR_HOST`,
CRC32C checks and the wording of access errors are the same as for `checkpoint.path`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import numpy as np

from diloco_trainer.syncer.gcs import BucketPrefix
from diloco_trainer.syncer.storage import (
    GCS_SCHEME,
    CheckpointError,
    StorageAccessError,
    is_bucket_url,
)
from diloco_trainer.workload.weights import FIELD, WeightsError, WeightsUnavailable, read_weights


class BucketWeightsError(ValueError):
    """The URL names nothing readable; `unavailable` when the storage service failed (worth
    a retry) rather than the setting being wrong."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


def split_object_url(url: str) -> tuple[str, str]:
    """(`gs://bucket/dir`, `name`) of `gs://bucket/dir/name`; ValueError for a bare bucket."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent in ("gs:", "gs:/") or not name:
        raise ValueError("name an object or a prefix in the bucket: gs://BUCKET/PATH")
    return parent, name


def local_path(root: Path, rel: str) -> Path:
    """Where object `rel` goes under `root`; ValueError for a name that would leave it."""
    parts = PurePosixPath(rel).parts
    if not parts or parts[0] == "/" or ".." in parts:
        raise ValueError(f"object name {rel!r} does not stay inside the prefix")
    return root.joinpath(*parts)


def _below(store: BucketPrefix, name: str, into: Path) -> Path:
    """Download `name` (one object, or every object under `name/`) into `into`; the local
    file or directory that now holds it. FileNotFoundError when there is neither."""
    found = store.objects(name)
    if name in found:
        store.download(name, into / name)
        return into / name
    tree = [rel for rel in found if rel.startswith(f"{name}/") and not rel.endswith("/")]
    if not tree:
        raise FileNotFoundError("no such object, and no objects under it")
    for rel in tree:
        target = local_path(into, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download(rel, target)
    return into / name


def download(url: str, field: str, into: Path) -> Path:
    """The object or prefix at `url` downloaded into `into`: the local file or directory."""
    try:
        parent, name = split_object_url(url)
        return _below(BucketPrefix(parent, field=field), name, into)
    except (ValueError, FileNotFoundError) as exc:
        raise BucketWeightsError(f"{field}: {url}: {exc}") from exc
    except CheckpointError as exc:
        # Its message starts "<field> gs://bucket/dir: ": say the field once, with the full URL.
        reason = str(exc)
        if reason.startswith(f"{field} {GCS_SCHEME}"):
            reason = reason.split(": ", 1)[-1]
        # As for checkpoint.path: access (credential, permission, bucket) is a setting to fix;
        # anything else (the service failing, a damaged download) may pass on a retry.
        transient = not isinstance(exc, StorageAccessError)
        raise BucketWeightsError(f"{field}: {url}: {reason}", unavailable=transient) from exc


@contextmanager
def fetched(url: str, field: str) -> Iterator[Path]:
    """The object or prefix at `url` as a temporary local file or directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="diloco-init-from-") as tmp:
        yield download(url, field, Path(tmp))


def read_weights_anywhere(path: str | Path, field: str = FIELD) -> dict[str, np.ndarray]:
    """`workload.weights.read_weights` for a local path, or for the object or orbax prefix at a
    `gs://` URL (fetched to a temporary copy first)."""
    if not is_bucket_url(path):
        return read_weights(path, field)
    url = str(path)
    try:
        with fetched(url, field) as local:
            return read_weights(local, field, shown=url)
    except BucketWeightsError as exc:
        raise (WeightsUnavailable if exc.unavailable else WeightsError)(str(exc)) from exc
