"""Token sources: stdlib corpus, disjoint shards, held-out eval split, memmap shards."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import (
    DataError,
    TokenStream,
    eval_batches,
    eval_split,
    open_stream,
    stdlib_corpus,
    train_batches,
    train_shard,
)


def _cfg(**data: object) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {"totalSteps": 10, "model": {"seqLen": 32}, "data": {"batchSize": 4, **data}}
    )


def test_stdlib_corpus_is_python_source_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path))
    first = stdlib_corpus(1 << 16)
    assert first.dtype == np.uint8 and len(first) == 1 << 16
    assert b"import" in first.tobytes()
    assert len(list(tmp_path.glob("stdlib-*-65536.npy"))) == 1
    np.testing.assert_array_equal(stdlib_corpus(1 << 16), first)  # read back from the cache


def test_shards_are_disjoint_cover_train_and_exclude_eval() -> None:
    total, frac, units = 10_007, 0.05, 3
    held = eval_split(total, frac)
    shards = [train_shard(total, frac, u, units) for u in range(units)]
    assert shards[0].start == 0 and shards[-1].stop == held.start
    for a, b in itertools.pairwise(shards):
        assert a.stop == b.start
    assert held.stop == total and len(held) == int(total * frac)
    with pytest.raises(DataError, match="unit index 3"):
        train_shard(total, frac, 3, units)


def test_batches_stay_inside_the_unit_shard_and_are_seeded() -> None:
    # A stream whose token at position i is i % 251 lets a window name where it came from.
    stream = TokenStream([(np.arange(20_000) % 251).astype(np.uint16)])
    cfg = _cfg(source="memmap", path="unused")
    shard = train_shard(len(stream), cfg.data.eval_fraction, 1, 2)
    batches = train_batches(cfg, unit=1, num_units=2, stream=stream)
    for _ in range(20):
        batch = next(batches)
        assert batch.shape == (4, 33) and batch.dtype == np.int32
        for row in batch:
            assert np.all(np.diff(row) % 251 == 1)  # contiguous windows
    again = next(train_batches(cfg, unit=1, num_units=2, stream=stream))
    other = next(train_batches(cfg, unit=1, num_units=2, attempt=1, stream=stream))
    first = next(train_batches(cfg, unit=1, num_units=2, stream=stream))
    np.testing.assert_array_equal(again, first)
    assert not np.array_equal(first, other)
    # Starts are drawn from the shard only: check with a stream of positions.
    positions = TokenStream([np.arange(20_000, dtype=np.uint32)])
    wide = _cfg(source="memmap", path="unused")
    wide.model.vocab_size = 1 << 20
    for batch in [next(train_batches(wide, 1, 2, stream=positions)) for _ in range(10)]:
        assert batch.min() >= shard.start and batch.max() < shard.stop


def test_eval_batches_are_deterministic_and_held_out() -> None:
    stream = TokenStream([np.arange(50_000, dtype=np.uint32)])
    cfg = _cfg(source="memmap", path="unused")
    cfg.model.vocab_size = 1 << 20
    a, b = eval_batches(cfg, 3, stream), eval_batches(cfg, 3, stream)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert min(int(x.min()) for x in a) >= eval_split(50_000, cfg.data.eval_fraction).start


def test_memmap_directory_of_npy_and_bin_shards(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(0, 1000, dtype=np.uint16))
    np.arange(1000, 3000, dtype=np.uint16).tofile(tmp_path / "b.bin")
    (tmp_path / "notes.txt").write_text("ignored")
    cfg = _cfg(source="memmap", path=str(tmp_path), dtype="uint16")
    stream = open_stream(cfg)
    assert len(stream) == 3000
    np.testing.assert_array_equal(stream.read(990, 20), np.arange(990, 1010))  # crosses files
    cfg.model.vocab_size = 4096
    assert next(train_batches(cfg, 0, 1)).shape == (4, 33)


def test_memmap_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.path: .* does not exist"):
        open_stream(_cfg(source="memmap", path=str(tmp_path / "missing")))
    with pytest.raises(DataError, match=r"data\.path: .* no \.npy or \.bin"):
        open_stream(_cfg(source="memmap", path=str(tmp_path)))
    np.arange(1000, 1100, dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match="vocabSize"):
        next(train_batches(_cfg(source="memmap", path=str(tmp_path)), 0, 1))
