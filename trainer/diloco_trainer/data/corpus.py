"""Token sources, the held-out split, per-unit shards and batch sampling (numpy only, no JAX).

A source is one long virtual token stream (`TokenStream`), possibly made of several files.
Layout of the stream, identical in every process for the same config:

    [ train split ......................................... | eval split ]
                                                              last evalFraction

Learners read the train split through the syncer's data leases (`data/tokens.py`, the built-in
data source). `train_shard`/`train_batches` below (one contiguous range per unit index, random
windows) remain for the benchmarks, which run a fixed set of in-process learners, and for
the batch a warm spare compiles its train step with.

Sources:
- ``stdlib``: the bytes of the running Python's standard library ``*.py`` files (sorted paths,
  site-/dist-packages excluded), byte-level tokens (vocab 256). Assembled once and cached as
  ``~/.cache/diloco/stdlib-<python>-<cap>.npy`` so later starts just memory-map it.
- ``memmap``: a ``.npy`` file, a raw ``.bin`` file of ``data.dtype`` tokens, or a directory of
  such shards (sorted by name, concatenated in that order). A directory written by
  ``diloco data tokenize`` has a ``manifest.json`` (shards.py); the config is checked against it.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.shards import ManifestError, mismatch, read_manifest

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "DILOCO_CACHE_DIR"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """A data source that cannot be used; the message names the config field."""


class TokenStream:
    """Read-only concatenation of 1-D token arrays (usually memory maps) without copying them."""

    def __init__(self, segments: list[np.ndarray]) -> None:
        self.segments = [s for s in segments if len(s)]
        if not self.segments:
            raise DataError("data: the token source is empty")
        self.offsets = np.cumsum([0] + [len(s) for s in self.segments])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) as int32, crossing segment boundaries if needed."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside stream of {len(self)}")
        out = np.empty(length, np.int32)
        filled = 0
        seg = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while filled < length:
            local = start + filled - int(self.offsets[seg])
            take = min(length - filled, len(self.segments[seg]) - local)
            out[filled : filled + take] = self.segments[seg][local : local + take]
            filled += take
            seg += 1
        return out


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "diloco")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        f
        for f in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(f.relative_to(root).parts) and f.is_file()
    )


def _assemble_stdlib(max_bytes: int | None) -> np.ndarray:
    chunks: list[bytes] = []
    size = 0
    for f in stdlib_files():
        chunk = f.read_bytes()
        chunks.append(chunk)
        size += len(chunk)
        if max_bytes is not None and size >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return corpus[:max_bytes] if max_bytes is not None else corpus


def stdlib_corpus(max_bytes: int | None = None) -> np.ndarray:
    """The embedded corpus as uint8 tokens, from the on-disk cache when present."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    path = cache_dir() / f"stdlib-{version}-{max_bytes or 'all'}.npy"
    if path.exists():
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError):
            log.warning("event=corpus_cache_unreadable path=%s", path)
    corpus = _assemble_stdlib(max_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several learners may start at once: write to a private temp file, then rename atomically.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy.tmp", delete=False) as tmp:
        np.save(tmp, corpus)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)
    log.info("event=corpus_cached path=%s tokens=%d", path, len(corpus))
    return corpus


def _open_memmap_file(path: Path, dtype: str) -> np.ndarray:
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise DataError(
                f"data.path: {path} must hold a 1-D integer array, got {arr.dtype}{arr.shape}"
            )
        return arr
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def memmap_stream(path: str, dtype: str) -> TokenStream:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".npy", ".bin") and f.is_file())
        if not files:
            raise DataError(f"data.path: directory {p} has no .npy or .bin shards")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"data.path: {p} does not exist")
    return TokenStream([_open_memmap_file(f, dtype) for f in files])


def check_shard_manifest(cfg: TrainingConfig) -> None:
    """A tokenised directory's manifest against the model vocabulary and data dtype."""
    assert cfg.data.path is not None
    directory = Path(cfg.data.path)
    if not directory.is_dir():
        return
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise DataError(f"data.path: {exc}") from exc
    problem = manifest and mismatch(manifest, directory, cfg.model.vocab, cfg.data.dtype)
    if problem:
        raise DataError(problem)


def open_stream(cfg: TrainingConfig) -> TokenStream:
    if cfg.data.source == "stdlib":
        return TokenStream([stdlib_corpus(cfg.data.max_bytes)])
    assert cfg.data.path is not None  # the config validator guarantees it
    check_shard_manifest(cfg)
    return memmap_stream(cfg.data.path, cfg.data.dtype)


@dataclass(frozen=True)
class Split:
    """A contiguous range [start, stop) of a stream."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def eval_split(total: int, eval_fraction: float) -> Split:
    return Split(total - max(1, int(total * eval_fraction)), total)


def train_shard(total: int, eval_fraction: float, unit: int, num_units: int) -> Split:
    """Unit `unit`'s disjoint share of the train split."""
    if not 0 <= unit < num_units:
        raise DataError(f"unit index {unit} outside 0..{num_units - 1}")
    train_end = eval_split(total, eval_fraction).start
    bounds = np.linspace(0, train_end, num_units + 1).astype(np.int64)
    return Split(int(bounds[unit]), int(bounds[unit + 1]))


def _check_window_fits(split: Split, window: int, what: str) -> None:
    if len(split) < window:
        raise DataError(
            f"data: {what} has {len(split)} tokens, fewer than one window of {window} "
            "(model.seqLen + 1); use more data (data.maxBytes) or fewer units"
        )


def sample_batch(
    stream: TokenStream, split: Split, batch_size: int, seq_len: int, rng: np.random.Generator
) -> np.ndarray:
    """`batch_size` random windows of seq_len+1 tokens inside `split`, int32 (B, T+1)."""
    window = seq_len + 1
    starts = rng.integers(split.start, split.stop - window + 1, size=batch_size)
    return np.stack([stream.read(int(s), window) for s in starts])


def train_batches(
    cfg: TrainingConfig,
    unit: int,
    num_units: int,
    attempt: int = 0,
    process: int = 0,
    batch_size: int | None = None,
    stream: TokenStream | None = None,
) -> Iterator[np.ndarray]:
    """Endless training batches from the unit's shard, seeded by (seed, unit, attempt, process)."""
    stream = stream or open_stream(cfg)
    shard = train_shard(len(stream), cfg.data.eval_fraction, unit, num_units)
    window = cfg.model.context + 1
    _check_window_fits(shard, window, f"the shard of unit {unit}")
    rng = np.random.default_rng([cfg.seed, unit, attempt, process])
    size = batch_size or cfg.data.batch_size
    vocab = cfg.model.vocab
    while True:
        batch = sample_batch(stream, shard, size, cfg.model.context, rng)
        if int(batch.max()) >= vocab:
            raise DataError(f"data: token id {int(batch.max())} >= model.vocabSize {vocab}")
        yield batch


def eval_batches(
    cfg: TrainingConfig, count: int, stream: TokenStream | None = None
) -> list[np.ndarray]:
    """The same `count` held-out batches on every call and in every process."""
    stream = stream or open_stream(cfg)
    split = eval_split(len(stream), cfg.data.eval_fraction)
    _check_window_fits(split, cfg.model.context + 1, "the eval split")
    rng = np.random.default_rng([cfg.seed, 0xE7A1])
    return [
        sample_batch(stream, split, cfg.data.batch_size, cfg.model.context, rng)
        for _ in range(count)
    ]
