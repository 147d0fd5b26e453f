"""Token shard directories: the files `diloco data tokenize` writes and the memmap source reads.

A directory holds raw little-endian token files ``shard-000000.bin``, ``shard-000001.bin``, ...
(at most ``shardTokens`` tokens each, ``uint16`` when the vocabulary fits, else ``uint32``), a
copy of the tokenizer (``tokenizer.json``) and ``manifest.json``, which says what the shards are:

    {"format": "diloco-token-shards", "version": 1, "vocabSize": 4096, "dtype": "uint16",
     "tokenizer": {"file": "tokenizer.json", "sha256": "...", "eodToken": "<|endoftext|>",
                   "eodId": 0},
     "shardTokens": 67108864, "tokens": 123456, "documents": 42,
     "shards": [{"file": "shard-000000.bin", "tokens": 123456}],
     "sources": [{"path": "/abs/a.txt", "bytes": 5120, "documents": 1}]}

The memmap source reads the ``.bin`` files as it reads any others (sorted by name); the manifest
only lets a run check, before training, that its config fits the shards (`mismatch`).
numpy only: a run reads shards without the `tokenizers` package.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = "diloco-token-shards"
VERSION = 1
UINT16_VOCAB = 1 << 16


class ManifestError(ValueError):
    """A manifest.json that is not one of ours or cannot be read."""


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype the memmap source reads that holds every id below `vocab_size`."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.bin"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int


@dataclass(frozen=True)
class SourceInfo:
    path: str
    bytes: int
    documents: int


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    sha256: str
    eod_token: str
    eod_id: int


@dataclass(frozen=True)
class Manifest:
    vocab_size: int
    dtype: str
    tokenizer: TokenizerInfo
    shard_tokens: int
    shards: list[ShardInfo]
    sources: list[SourceInfo] = field(default_factory=list)
    documents: int = 0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "vocabSize": self.vocab_size,
            "dtype": self.dtype,
            "tokenizer": {
                "file": self.tokenizer.file,
                "sha256": self.tokenizer.sha256,
                "eodToken": self.tokenizer.eod_token,
                "eodId": self.tokenizer.eod_id,
            },
            "shardTokens": self.shard_tokens,
            "tokens": self.tokens,
            "documents": self.documents,
            "shards": [asdict(s) for s in self.shards],
            "sources": [asdict(s) for s in self.sources],
        }

    @classmethod
    def from_json(cls, doc: Any) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"not a {FORMAT} manifest")
        if doc.get("version") != VERSION:
            raise ManifestError(f"manifest version {doc.get('version')!r}, expected {VERSION}")
        try:
            tok = doc["tokenizer"]
            return cls(
                vocab_size=int(doc["vocabSize"]),
                dtype=str(doc["dtype"]),
                tokenizer=TokenizerInfo(
                    str(tok["file"]), str(tok["sha256"]), str(tok["eodToken"]), int(tok["eodId"])
                ),
                shard_tokens=int(doc["shardTokens"]),
                shards=[ShardInfo(str(s["file"]), int(s["tokens"])) for s in doc["shards"]],
                sources=[
                    SourceInfo(str(s["path"]), int(s["bytes"]), int(s["documents"]))
                    for s in doc.get("sources", [])
                ],
                documents=int(doc.get("documents", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc


def read_manifest(directory: Path) -> Manifest | None:
    """The directory's manifest, None when it has none (plain shards from elsewhere)."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: cannot read: {exc}") from exc
    try:
        return Manifest.from_json(doc)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from exc


def write_manifest(directory: Path, manifest: Manifest) -> None:
    text = json.dumps(manifest.to_json(), indent=1)
    (directory / MANIFEST_NAME).write_text(text + "\n")


def mismatch(manifest: Manifest, directory: Path, vocab_size: int, dtype: str) -> str | None:
    """Why a run with this model vocabulary and data dtype cannot read the shards, or None.
    The messages name the config fields to change."""
    if vocab_size < manifest.vocab_size:
        return (
            f"training.model.vocabSize {vocab_size} is smaller than the tokenizer's vocabulary "
            f"of {manifest.vocab_size} tokens ({directory / MANIFEST_NAME}); set "
            f"training.model.vocabSize: {manifest.vocab_size} (or larger)"
        )
    if dtype != manifest.dtype:
        return (
            f"training.data.dtype {dtype} does not match the shards' {manifest.dtype} "
            f"({directory / MANIFEST_NAME}); set training.data.dtype: {manifest.dtype}"
        )
    itemsize = np.dtype(manifest.dtype).itemsize
    for shard in manifest.shards:
        path = directory / shard.file
        size = path.stat().st_size if path.is_file() else None
        if size != shard.tokens * itemsize:
            found = "missing" if size is None else f"{size} bytes"
            return (
                f"data.path: shard {path} is {found}, the manifest says {shard.tokens} "
                f"{manifest.dtype} tokens ({shard.tokens * itemsize} bytes): an incomplete copy?"
            )
    return None


class ShardWriter:
    """Appends token ids to fixed-size shard files in `directory`; memory stays at one write."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError("shard_tokens must be at least 1")
        self.directory = directory
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.shards: list[ShardInfo] = []
        self._file: BinaryIO | None = None
        self._in_shard = 0

    def write(self, ids: list[int] | np.ndarray) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        while len(tokens):
            if self._file is None:
                self._file = (self.directory / shard_name(len(self.shards))).open("wb")
                self._in_shard = 0
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            self._file.write(tokens[:take].tobytes())
            self._in_shard += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._file is not None
        self._file.close()
        self.shards.append(ShardInfo(shard_name(len(self.shards)), self._in_shard))
        self._file = None

    def close(self) -> list[ShardInfo]:
        if self._file is not None:
            self._finish_shard()
        return self.shards
