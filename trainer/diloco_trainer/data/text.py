"""Text files to token shards (`diloco data tokenize`), and back (`diloco data inspect`).

A plain file is one document; a ``.jsonl`` file holds one document per line, a JSON object with
a ``"text"`` string. Documents are joined with the end-of-document token (`EOD_TOKEN` unless told
otherwise) into one token stream, written as fixed-size shards with a manifest (shards.py) that
the built-in memmap source reads as it is.

The tokenizer is Hugging Face's `tokenizers`: a byte-level BPE trained here on the same files
(`train_tokenizer`), or any ``tokenizer.json`` (`load_tokenizer`). Files are read in blocks and
encoded in batches, so memory is bounded by the batch, not the corpus. A long document is cut
at line ends into pieces of about `READ_BLOCK` bytes; the byte-level pre-tokenizer rarely joins
anything across a line end, so this changes at most a few token boundaries, never the text.

Output goes to a temporary sibling directory that is renamed into place at the end: a failed or
interrupted run leaves nothing behind.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco_trainer.data.corpus import memmap_stream
from diloco_trainer.data.shards import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    Manifest,
    ManifestError,
    ShardWriter,
    SourceInfo,
    TokenizerInfo,
    mismatch,
    read_manifest,
    token_dtype,
    write_manifest,
)

EOD_TOKEN = "<|endoftext|>"
BYTE_ALPHABET = 256
MIN_VOCAB = BYTE_ALPHABET + 1  # every byte, plus the end-of-document token
MAX_VOCAB = 1 << 20  # the largest training.model.vocabSize
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB per uint16 shard
# Encoding holds ~100 bytes per token while it lives (tokenizers 0.23): 1 MiB of text per
# encode call kept a 28 MB file under ~250 MB of memory, 4 MiB took 650 MB.
READ_BLOCK = 1 << 18
MAX_PIECE_CHARS = 1 << 20  # a line longer than this is cut anyway
BATCH_CHARS = 1 << 20  # text handed to one encode_batch_fast call
JSONL_SUFFIX = ".jsonl"


class TextDataError(ValueError):
    """Input that cannot be tokenised; the message names the argument or the file."""


class Progress(Protocol):
    def start(self, description: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...


class NoProgress:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


@dataclass(frozen=True)
class Piece:
    """Text from one source; `starts_document` marks the first piece of a document, `read` the
    bytes of the file consumed with it (progress)."""

    text: str
    starts_document: bool
    read: int
    source: int


# --- inputs ----------------------------------------------------------------------------------


def find_inputs(
    paths: Sequence[Path], pattern: str = "*", exclude: Path | None = None
) -> list[Path]:
    """Files named directly, plus those under directories matching `pattern` (hidden ones and
    anything under `exclude` skipped); sorted per directory, duplicates dropped."""
    found: dict[Path, None] = {}
    skip = exclude.resolve() if exclude is not None else None
    for path in paths:
        if path.is_file():
            found.setdefault(path, None)
        elif path.is_dir():
            for f in sorted(path.rglob(pattern)):
                hidden = any(part.startswith(".") for part in f.relative_to(path).parts)
                excluded = skip is not None and f.resolve().is_relative_to(skip)
                if f.is_file() and not hidden and not excluded:
                    found.setdefault(f, None)
        else:
            raise TextDataError(f"{path}: no such file or directory")
    files = list(found)
    if not files:
        names = " ".join(str(p) for p in paths) or "(none given)"
        raise TextDataError(f"no input files in {names} (directories are searched for {pattern!r})")
    for f in files:
        if not os.access(f, os.R_OK):
            raise TextDataError(f"{f}: cannot read the file (permission denied)")
    return files


def _text_file_pieces(path: Path, source: int) -> Iterator[Piece]:
    """One document: the file's text in pieces cut after a line end."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, unreported, offset, first = "", 0, 0, True
    with path.open("rb") as f:
        while True:
            block = f.read(READ_BLOCK)
            final = not block
            try:
                text = carry + decoder.decode(block, final=final)
            except UnicodeDecodeError as exc:
                raise TextDataError(
                    f"{path}: not UTF-8 text (near byte {offset + exc.start}: {exc.reason})"
                ) from exc
            offset += len(block)
            unreported += len(block)
            if final:
                cut = len(text)
            else:
                cut = text.rfind("\n") + 1
                if cut == 0 and len(text) < MAX_PIECE_CHARS:
                    carry = text  # no line end yet: read on
                    continue
                cut = cut or len(text)
            piece = text[:cut]
            if piece or unreported:
                yield Piece(piece, first and bool(piece), unreported, source)
                first = first and not piece
            carry, unreported = text[cut:], 0
            if final:
                return


def _jsonl_pieces(path: Path, source: int) -> Iterator[Piece]:
    """One document per line: {"text": "..."}; blank lines are skipped."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                yield Piece("", False, len(raw), source)
                continue
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                raise TextDataError(f"{path}:{lineno}: not a JSON line: {exc}") from exc
            text = doc.get("text") if isinstance(doc, dict) else None
            if not isinstance(text, str):
                raise TextDataError(f'{path}:{lineno}: expected a JSON object with a "text" string')
            yield Piece(text, bool(text), len(raw), source)


def read_pieces(files: Sequence[Path]) -> Iterator[Piece]:
    for index, path in enumerate(files):
        try:
            if path.name.endswith(JSONL_SUFFIX):
                yield from _jsonl_pieces(path, index)
            else:
                yield from _text_file_pieces(path, index)
        except OSError as exc:
            raise TextDataError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def total_bytes(files: Iterable[Path]) -> int:
    return sum(f.stat().st_size for f in files)


# --- tokenizer -------------------------------------------------------------------------------


def train_tokenizer(
    files: Sequence[Path],
    vocab_size: int,
    eod_token: str = EOD_TOKEN,
    progress: Progress | None = None,
) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (the text may support fewer merges)
    learned from `files`; `eod_token` is a special token."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TextDataError(
            f"--train-vocab {vocab_size}: must be between {MIN_VOCAB} (the {BYTE_ALPHABET} "
            f"bytes and the end-of-document token) and {MAX_VOCAB}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sink = progress or NoProgress()
    sink.start("learning the BPE vocabulary", total_bytes(files))

    def texts() -> Iterator[str]:
        for piece in read_pieces(files):
            sink.advance(piece.read)
            if piece.text:
                yield piece.text

    tokenizer.train_from_iterator(texts(), trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception for any bad file
        raise TextDataError(f"--tokenizer {path}: not a tokenizers JSON file: {exc}") from exc


def eod_id(tokenizer: Tokenizer, eod_token: str) -> int:
    found = tokenizer.token_to_id(eod_token)
    if found is None:
        raise TextDataError(
            f"--eod-token {eod_token!r}: the tokenizer has no such token; name its "
            "end-of-document token with --eod-token"
        )
    return found


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """One more than the largest id (ids need not be dense)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def encoder(tokenizer_json: str) -> Tokenizer:
    """The tokenizer for encoding documents: special tokens written in a document are encoded
    as text, so only the joins between documents carry the end-of-document id."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True
    return tokenizer


# --- shards ----------------------------------------------------------------------------------


def _batches(pieces: Iterable[Piece], chars: int) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_files(
    files: Sequence[Path], tokenizer: Tokenizer, eod: int, writer: ShardWriter, progress: Progress
) -> list[SourceInfo]:
    """Encode every document of `files` into `writer`, `eod` between documents."""
    documents = [0] * len(files)
    progress.start("tokenising", total_bytes(files))
    started = False
    for batch in _batches(read_pieces(files), BATCH_CHARS):
        encodings = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
        for piece, encoding in zip(batch, encodings, strict=True):
            if piece.starts_document:
                documents[piece.source] += 1
                if started:
                    writer.write([eod])
                started = True
            writer.write(encoding.ids)
            progress.advance(piece.read)
    return [
        SourceInfo(str(f.resolve()), f.stat().st_size, n)
        for f, n in zip(files, documents, strict=True)
    ]


def check_out_dir(out: Path) -> None:
    """`out` may be absent, empty, or a previous output of ours (replaced when done)."""
    if not out.parent.is_dir():
        raise TextDataError(f"--out {out}: the parent directory {out.parent} does not exist")
    if out.exists() and not out.is_dir():
        raise TextDataError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not _is_ours(out):
        raise TextDataError(
            f"--out {out}: exists, is not empty and was not written by diloco data tokenize; "
            "choose a new directory"
        )


def _is_ours(directory: Path) -> bool:
    try:
        manifest = read_manifest(directory)
    except ManifestError:
        return False
    if manifest is None:
        return False
    known = {MANIFEST_NAME, manifest.tokenizer.file, *(s.file for s in manifest.shards)}
    return all(entry.name in known for entry in directory.iterdir())


def _publish(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)


@dataclass(frozen=True)
class ShardJob:
    files: list[Path]
    out: Path
    tokenizer_json: str
    eod_token: str
    shard_tokens: int = DEFAULT_SHARD_TOKENS


def write_shards(job: ShardJob, progress: Progress | None = None) -> Manifest:
    """Tokenise `job.files` into `job.out`: shards, a copy of the tokenizer and the manifest."""
    if job.shard_tokens < 1:
        raise TextDataError(f"--shard-tokens {job.shard_tokens}: must be at least 1")
    check_out_dir(job.out)
    tokenizer = encoder(job.tokenizer_json)
    eod = eod_id(tokenizer, job.eod_token)
    vocab = vocab_size_of(tokenizer)
    dtype = token_dtype(vocab)
    tmp = Path(tempfile.mkdtemp(prefix=f".{job.out.name}.tmp-", dir=job.out.parent))
    try:
        tokenizer_bytes = job.tokenizer_json.encode()
        (tmp / TOKENIZER_NAME).write_bytes(tokenizer_bytes)
        writer = ShardWriter(tmp, dtype, job.shard_tokens)
        try:
            sources = tokenize_files(job.files, tokenizer, eod, writer, progress or NoProgress())
        finally:
            shards = writer.close()
        manifest = Manifest(
            vocab_size=vocab,
            dtype=dtype,
            tokenizer=TokenizerInfo(
                TOKENIZER_NAME, hashlib.sha256(tokenizer_bytes).hexdigest(), job.eod_token, eod
            ),
            shard_tokens=job.shard_tokens,
            shards=shards,
            sources=sources,
            documents=sum(s.documents for s in sources),
        )
        if manifest.tokens == 0:
            raise TextDataError("the input files hold no text: nothing to tokenise")
        write_manifest(tmp, manifest)
        tmp.chmod(0o755)  # mkdtemp makes it private; the shards are meant to be shared
        _publish(tmp, job.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# --- inspect ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inspection:
    manifest: Manifest
    problems: list[str]
    first_ids: list[int]
    first_text: str


def inspect_shards(directory: Path, count: int = 64) -> Inspection:
    """The manifest, what does not match it, and the first `count` tokens decoded."""
    if not directory.is_dir():
        raise TextDataError(f"{directory}: no such directory")
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise TextDataError(str(exc)) from exc
    if manifest is None:
        raise TextDataError(
            f"{directory}: no {MANIFEST_NAME}; not a directory written by diloco data tokenize"
        )
    problems = []
    tokenizer_path = directory / manifest.tokenizer.file
    if not tokenizer_path.is_file():
        problems.append(f"{tokenizer_path}: missing")
    elif hashlib.sha256(tokenizer_path.read_bytes()).hexdigest() != manifest.tokenizer.sha256:
        problems.append(f"{tokenizer_path}: its sha256 differs from the manifest's")
    shard_problem = mismatch(manifest, directory, manifest.vocab_size, manifest.dtype)
    if shard_problem:
        problems.append(shard_problem)
    if problems:
        return Inspection(manifest, problems, [], "")
    stream = memmap_stream(str(directory), manifest.dtype)
    ids = stream.read(0, min(max(0, count), len(stream))).tolist()
    text = load_tokenizer(tokenizer_path).decode(ids, skip_special_tokens=False)
    return Inspection(manifest, problems, ids, text)
