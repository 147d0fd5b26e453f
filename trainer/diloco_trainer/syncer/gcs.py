"""Checkpoints in Google Cloud Storage (`gs://bucket/prefix`), through google-cloud-storage.

Credentials are Application Default Credentials: on GKE, Workload Identity through the metadata
server (no key file); elsewhere `gcloud auth application-default login` or
GOOGLE_APPLICATION_CREDENTIALS. `STORAGE_EMULATOR_HOST` (honoured by the library) points
everything at a GCS-compatible server without credentials, as the tests do.

Every object of a checkpoint is created with `ifGenerationMatch=0` (create only): two writers
never overwrite each other's objects, and the library may retry an upload safely. Uploads carry
a CRC32C the server checks, and downloads are checked the same way, on top of the manifest's
SHA-256 that the store verifies on load.

The small objects (the version, fragment and lease journals) are rewritten in place, so they are
the fence between two syncers on one path (a pod left running on a partitioned node beside its
replacement): once a syncer claims the path (`claim`, before it serves), each of its rewrites is
conditional on the generation it last saw (`ifGenerationMatch`), and a checkpoint is committed
only while no small object has moved under it. Another syncer's write in between makes the next
one fail as `Superseded`, and that syncer stands down. The syncer that claimed last wins.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from diloco_trainer.syncer.storage import (
    GCS_SCHEME,
    MANIFEST,
    CheckpointError,
    StorageAccessError,
    StorageUnavailable,
    Superseded,
)

T = TypeVar("T")
# Resumable uploads go in chunks of this size (a multiple of 256 KiB); a dropped connection
# resends from the last chunk the server holds, not from the start.
CHUNK_BYTES = 32 * 1024 * 1024
LIST = "list objects"
# Custom metadata of each small object: the process that wrote it and its how-manieth write, so
# that a conditional write refused after a retry can tell its own first attempt (which landed)
# from another syncer's write.
WRITER_KEY = "diloco-writer"
WRITE_KEY = "diloco-write"
EXTRA_HINT = "install the gcs extra: pip install 'elastic-diloco[gcs]'"
CREDENTIAL_HINT = (
    "on GKE, run the syncer under a Kubernetes ServiceAccount that Workload Identity maps to a "
    "principal with roles/storage.objectUser on the bucket (docs/gke.md); elsewhere use "
    "`gcloud auth application-default login` or GOOGLE_APPLICATION_CREDENTIALS"
)


def split_url(url: str, field: str) -> tuple[str, str]:
    """(bucket, prefix ending in '/' or empty) of `gs://bucket/prefix`."""
    rest = url.removeprefix(GCS_SCHEME)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StorageAccessError(f"{field} {url}: no bucket name after gs://")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _client_library(where: str) -> tuple[Any, Any, Any, Any]:
    """(google.cloud.storage, google.api_core.exceptions, google.auth.exceptions,
    google.cloud.storage.exceptions)."""
    try:
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth
        from google.cloud import storage
        from google.cloud.storage import exceptions as transfer
    except ImportError as exc:
        raise StorageAccessError(
            f"{where}: gs:// checkpoints need google-cloud-storage: {EXTRA_HINT}"
        ) from exc
    return storage, api, auth, transfer


class BucketPrefix:
    """A `gs://bucket/prefix` checkpoint root."""

    verified_publish = True

    def __init__(self, url: str, field: str = "checkpoint.path") -> None:
        self.bucket_name, self.prefix = split_url(url, field)
        self.url = f"{GCS_SCHEME}{self.bucket_name}/{self.prefix}".rstrip("/")
        self.field = field
        self._local = threading.local()  # one client per thread: the HTTP session is not shared
        self.writer = secrets.token_hex(8)
        self._writes = 0
        # Each small object's generation as this process last read or wrote it (0: absent).
        self._generations: dict[str, int] = {}
        self._claimed = False
        # Held over a small write and its bookkeeping, and over the commit check, which runs in
        # another thread: the check must never see this process's own write half recorded.
        self._fence = threading.Lock()

    # ------------------------------------------------------------------ access and errors
    def _bucket(self) -> Any:
        bucket = getattr(self._local, "bucket", None)
        if bucket is None:
            storage = _client_library(f"{self.field} {self.url}")[0]
            client = self._call("open a client", lambda: storage.Client(project=None))
            bucket = self._local.bucket = client.bucket(self.bucket_name)
        return bucket

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        """Run one storage call; its failure becomes a CheckpointError that names the setting:
        StorageAccessError for a missing or refused credential and a missing bucket,
        StorageUnavailable for the service or network failing, plain CheckpointError for bytes
        that arrived damaged or an object that vanished."""
        where = f"{self.field} {self.url}"
        _, api, auth, transfer = _client_library(where)
        try:
            return fn()
        except auth.DefaultCredentialsError as exc:
            raise StorageAccessError(
                f"{where}: no Google Cloud credential found ({CREDENTIAL_HINT}): {exc}"
            ) from exc
        except (auth.RefreshError, auth.TransportError) as exc:
            raise StorageAccessError(
                f"{where}: the Google Cloud credential cannot be used ({CREDENTIAL_HINT}): {exc}"
            ) from exc
        except (api.Unauthorized, api.Forbidden) as exc:
            raise StorageAccessError(
                f"{where}: access denied to bucket {self.bucket_name} while trying to {action} "
                f"({CREDENTIAL_HINT}): {exc}"
            ) from exc
        except api.PreconditionFailed as exc:
            raise StorageUnavailable(
                f"{where}: {action}: the object exists already (another syncer writing to the "
                f"same path?): {exc}"
            ) from exc
        except api.NotFound as exc:
            if action == LIST:  # a listing finds nothing only when the bucket is not there
                raise StorageAccessError(
                    f"{where}: bucket {self.bucket_name} does not exist (or is not visible to "
                    f"this credential): {exc}"
                ) from exc
            # An object listed a moment ago is gone (a concurrent prune): that checkpoint is
            # not intact any more, like a damaged one.
            raise CheckpointError(f"{where}: {action}: not found: {exc}") from exc
        except transfer.DataCorruption as exc:
            raise CheckpointError(f"{where}: {action}: checksum mismatch: {exc}") from exc
        except (api.GoogleAPIError, transfer.InvalidResponse, OSError) as exc:
            # OSError covers the HTTP library's connection errors
            raise StorageUnavailable(f"{where}: {action} failed: {exc!r}") from exc

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def _list(self, sub: str, delimiter: str | None = None) -> tuple[list[str], list[str]]:
        """(object names, sub-prefixes) under `prefix + sub`, relative to the prefix."""
        start = len(self.prefix)

        def run() -> tuple[list[str], list[str]]:
            pages = self._bucket().list_blobs(prefix=self._key(sub), delimiter=delimiter)
            names = [blob.name[start:] for blob in pages]  # consuming fills `.prefixes`
            return names, [p[start:] for p in pages.prefixes]

        return self._call(LIST, run)

    # ------------------------------------------------------------------ Location
    def check(self) -> None:
        self._call(LIST, lambda: list(self._bucket().list_blobs(max_results=1)))

    def exists(self) -> bool:
        return True  # a prefix has no existence of its own: an empty one is a fresh start

    def entries(self) -> list[str]:
        names, dirs = self._list("", delimiter="/")
        return sorted({*names, *(d.rstrip("/") for d in dirs)})

    def _checkpoint_files(self) -> dict[str, set[str]]:
        """The files under each `ckpt-*/`."""
        found: dict[str, set[str]] = {}
        for rel in self._list("ckpt-")[0]:
            top, _, rest = rel.partition("/")
            if rest:
                found.setdefault(top, set()).add(rest)
        return found

    def checkpoints(self) -> list[str]:
        return sorted(n for n, files in self._checkpoint_files().items() if MANIFEST in files)

    def strays(self) -> list[str]:
        return sorted(n for n, files in self._checkpoint_files().items() if MANIFEST not in files)

    def remove(self, name: str) -> None:
        """The manifest first: from then on no reader takes the rest for a checkpoint."""
        self._delete(f"{name}/{MANIFEST}")
        for rel in self._list(f"{name}/")[0]:
            self._delete(rel)

    def _delete(self, rel: str) -> None:
        api = _client_library(self.url)[1]

        def delete() -> None:
            with contextlib.suppress(api.NotFound):  # already gone: what a delete wants
                self._bucket().blob(self._key(rel)).delete()

        self._call(f"delete {rel}", delete)

    @contextmanager
    def stage(self, name: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=f"diloco-{name}-") as tmp:
            yield Path(tmp)

    def _upload(self, path: Path, rel: str) -> None:
        blob = self._bucket().blob(self._key(rel), chunk_size=CHUNK_BYTES)
        self._call(
            f"upload {rel}",
            lambda: blob.upload_from_filename(str(path), if_generation_match=0, checksum="crc32c"),
        )

    def publish(self, staged: Path, name: str) -> str:
        files = sorted(p for p in staged.iterdir() if p.name != MANIFEST)
        for path in files:
            self._upload(path, f"{name}/{path.name}")
        self._check_fence()  # a syncer that was superseded meanwhile commits nothing
        self._upload(staged / MANIFEST, f"{name}/{MANIFEST}")  # the commit
        return f"{self.url}/{name}"

    @contextmanager
    def fetch(self, name: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=f"diloco-{name}-") as tmp:
            for rel in self._list(f"{name}/")[0]:
                file = rel.removeprefix(f"{name}/")
                if "/" not in file:  # deeper objects are not part of the format
                    self._download(rel, Path(tmp) / file)
            yield Path(tmp)

    def objects(self, sub: str) -> list[str]:
        """Every object whose name starts with `prefix + sub`, at any depth, relative to the
        prefix (for readers of other files than checkpoints: `initFrom` weights)."""
        return self._list(sub)[0]

    def download(self, rel: str, local: Path) -> None:
        """One object into the local file `local`, its CRC32C checked."""
        self._download(rel, local)

    def _download(self, rel: str, local: Path) -> None:
        blob = self._bucket().blob(self._key(rel))
        self._call(
            f"download {rel}", lambda: blob.download_to_filename(str(local), checksum="crc32c")
        )

    def read_small(self, name: str) -> bytes | None:
        api = _client_library(self.url)[1]

        def read() -> tuple[bytes | None, int]:
            blob = self._bucket().blob(self._key(name))
            try:
                data = bytes(blob.download_as_bytes())
            except api.NotFound:
                return None, 0
            if blob.generation is None:  # the download's x-goog-generation header
                raise StorageUnavailable(f"{self.url}: read {name}: no object generation sent")
            return data, int(blob.generation)

        data, generation = self._call(f"read {name}", read)
        if "/" not in name:  # a top-level small object (not a checkpoint's manifest)
            with self._fence:
                self._generations[name] = generation
        return data

    def replace_small(self, name: str, data: bytes) -> None:
        from google.cloud.storage.retry import DEFAULT_RETRY

        api = _client_library(self.url)[1]
        kind = "application/json" if name.endswith(".json") else "application/octet-stream"
        with self._fence:
            # Claimed: nothing is written once any small object moved under this process (the
            # fragment journal goes before the version journal, so its own generation alone
            # would let a stale syncer overwrite one fragment's entry before it finds out),
            # and each write is on the generation last seen; an object never seen must still
            # be absent. Unclaimed (a tool, a test): unconditional unless this process read it.
            if self._claimed:
                self._raise_if_moved(f"write {name}")
            expected = self._generations.get(name, 0 if self._claimed else None)
            self._writes += 1
            tag = {WRITER_KEY: self.writer, WRITE_KEY: str(self._writes)}

            def write() -> int:
                blob = self._bucket().blob(self._key(name))
                blob.metadata = tag
                try:
                    # One object write is atomic, and conditional on the generation it replaces,
                    # so the library's retry of it can never put an older value back.
                    blob.upload_from_string(
                        data, content_type=kind, if_generation_match=expected, retry=DEFAULT_RETRY
                    )
                except api.PreconditionFailed:
                    return self._landed_anyway(name, tag)
                return int(blob.generation)

            self._generations[name] = self._call(f"write {name}", write)

    def _landed_anyway(self, name: str, tag: dict[str, str]) -> int:
        """A conditional write was refused: the generation of this very write when a retry of
        it was refused because its first attempt had landed; otherwise Superseded."""
        current = self._bucket().get_blob(self._key(name))
        meta = dict((current.metadata or {}) if current is not None else {})
        if current is not None and all(meta.get(k) == v for k, v in tag.items()):
            return int(current.generation)
        who = meta.get(WRITER_KEY, "unknown") if current is not None else "a delete"
        raise Superseded(
            f"{self.field} {self.url}: {name} was changed by another writer ({who}) since this "
            f"syncer (writer {self.writer}) last read or wrote it: two syncers on one checkpoint "
            "path; this one stands down"
        )

    # ------------------------------------------------------------------ the fence
    def _small_generations(self) -> dict[str, int]:
        """Generation of every top-level object under the prefix."""
        start = len(self.prefix)

        def run() -> dict[str, int]:
            pages = self._bucket().list_blobs(prefix=self.prefix, delimiter="/")
            return {blob.name[start:]: int(blob.generation) for blob in pages}

        return self._call(LIST, run)

    def _moved(self, listed: dict[str, int]) -> list[str]:
        """The small objects whose listed generation is not the one this process last saw."""
        return sorted(n for n, g in self._generations.items() if listed.get(n, 0) != g)

    def claim(self) -> list[str]:
        listed = self._small_generations()
        with self._fence:
            changed = self._moved(listed)
            self._generations, self._claimed = listed, True
        return changed

    def _raise_if_moved(self, action: str) -> None:
        """Superseded unless every small object is where this process last saw it (the caller
        holds the fence lock)."""
        moved = self._moved(self._small_generations())
        if moved:
            raise Superseded(
                f"{self.field} {self.url}: {action}: {', '.join(moved)} changed by another "
                f"writer since this syncer (writer {self.writer}) last read or wrote it: two "
                "syncers on one checkpoint path; this one writes nothing more and stands down"
            )

    def _check_fence(self) -> None:
        if self._claimed:
            with self._fence:
                self._raise_if_moved("commit a checkpoint")
