"""The built-in data source over a token stream (stdlib or memmap), in the API's form
`source(shard, num_shards, *, seed, batch_size, split, position)` (`diloco_trainer.api`).

The train split (corpus.py's layout) is cut into non-overlapping windows of seq_len+1 tokens, and
shard `s` of `num_shards` is every `num_shards`-th window from the `s`-th on (interleaved, so each
shard spans the whole split); its batches are those windows in a seeded random order,
`batch_size` at a time (a last partial batch is left out), so the shard is finite and no window
comes twice. The syncer's leases (syncer/data_leases.py) give each
(epoch, shard) to one unit, and the learner seeds the order with the epoch: within an epoch no
window is read twice anywhere in the run, and the next epoch reads them in another order.

`split="eval"` ignores the shard: the held-out batches of `corpus.eval_batches`, the same in
every process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import (
    DataError,
    TokenStream,
    eval_split,
    open_stream,
    sample_batch,
)

EVAL_SALT = 0xE7A1  # corpus.eval_batches' stream of held-out windows


def shard_windows(train_end: int, window: int, shard: int, num_shards: int) -> np.ndarray:
    """Start offsets of shard `shard`'s windows, ascending: of the non-overlapping windows of the
    train split [0, train_end), every `num_shards`-th one from the `shard`-th on. Interleaved,
    not contiguous, so that every shard samples the whole split: corpora are usually sorted (by
    file, source or date) and a unit reading one contiguous slice for hundreds of steps would
    train on data unlike its peers' (docs/design.md, "Interleaved shards")."""
    if not 0 <= shard < num_shards:
        raise DataError(f"data: shard {shard} outside 0..{num_shards - 1} (data.shards)")
    return window * np.arange(shard, train_end // window, num_shards, dtype=np.int64)


def window_order(starts: np.ndarray, seed: int, shard: int) -> np.ndarray:
    """The shard's window starts in the (seed, shard) order."""
    return np.random.default_rng([seed, shard]).permutation(starts)


class StreamSource:
    """The built-in data source over the config's token stream (opened on first use)."""

    def __init__(self, cfg: TrainingConfig, stream: TokenStream | None = None) -> None:
        self.cfg = cfg
        self._stream = stream

    @property
    def stream(self) -> TokenStream:
        if self._stream is None:
            self._stream = open_stream(self.cfg)
        return self._stream

    def __call__(
        self,
        shard: int,
        num_shards: int,
        *,
        seed: int,
        batch_size: int,
        split: str,
        position: int,
        **args: Any,
    ) -> Iterator[np.ndarray]:
        if args:
            raise DataError(f"data.args: the built-in source takes none, got {sorted(args)}")
        if batch_size < 1 or position < 0:
            raise DataError(f"data: batch_size {batch_size} and position {position} must be >= 1/0")
        if split == "eval":
            return self._eval(seed, batch_size, position)
        if split != "train":
            raise DataError(f"data: split must be 'train' or 'eval', got {split!r}")
        return self._train(shard, num_shards, seed, batch_size, position)

    def tokens_per_batch(self, batch: np.ndarray) -> int:
        """Rows x seqLen: each window of seqLen+1 tokens trains seqLen next-token predictions."""
        return int(np.shape(batch)[0]) * self.cfg.model.context

    def _train(
        self, shard: int, num_shards: int, seed: int, batch_size: int, position: int
    ) -> Iterator[np.ndarray]:
        stream, window = self.stream, self.cfg.model.context + 1
        train_end = eval_split(len(stream), self.cfg.data.eval_fraction).start
        starts = window_order(shard_windows(train_end, window, shard, num_shards), seed, shard)
        if len(starts) < batch_size:
            raise DataError(
                f"data: shard {shard} of {num_shards} holds {len(starts)} windows of {window} "
                f"tokens, fewer than one batch of {batch_size}; use fewer data.shards or more "
                "data (data.maxBytes)"
            )
        return self._windows(starts, batch_size, position)

    def _windows(self, starts: np.ndarray, batch_size: int, position: int) -> Iterator[np.ndarray]:
        stream, window, vocab = self.stream, self.cfg.model.context + 1, self.cfg.model.vocab
        for b in range(position, len(starts) // batch_size):
            chosen = starts[b * batch_size : (b + 1) * batch_size]
            batch = np.stack([stream.read(int(s), window) for s in chosen])
            if int(batch.max()) >= vocab:
                raise DataError(f"data: token id {int(batch.max())} >= model.vocabSize {vocab}")
            yield batch

    def _eval(self, seed: int, batch_size: int, position: int) -> Iterator[np.ndarray]:
        stream, seq_len = self.stream, self.cfg.model.context
        split = eval_split(len(stream), self.cfg.data.eval_fraction)
        if len(split) < seq_len + 1:
            raise DataError(
                f"data: the eval split has {len(split)} tokens, fewer than one window of "
                f"{seq_len + 1} (model.seqLen + 1); use more data (data.maxBytes)"
            )
        rng = np.random.default_rng([seed, EVAL_SALT])
        for _ in range(position):
            sample_batch(stream, split, batch_size, seq_len, rng)
        while True:
            yield sample_batch(stream, split, batch_size, seq_len, rng)
