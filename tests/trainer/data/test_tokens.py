"""The built-in data source in the API form: finite, non-overlapping, seeded shards."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import DataError, TokenStream, eval_batches, eval_split
from diloco_trainer.data.tokens import StreamSource

SEQ = 7  # windows of 8 tokens


def _cfg(**data: object) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {
            "model": {"preset": "tiny", "seqLen": SEQ, "vocabSize": 1 << 16},
            "data": {"batchSize": 4, "evalFraction": 0.1, **data},
            "totalSteps": 10,
        }
    )


def _positions(n: int) -> TokenStream:
    """A stream whose token i is i: a batch's values say where it was read."""
    return TokenStream([np.arange(n, dtype=np.int64) % (1 << 16)])


def _train(source: StreamSource, shard: int, shards: int, seed: int, position: int = 0) -> list:
    got = source(shard, shards, seed=seed, batch_size=4, split="train", position=position)
    return list(got)


def test_shards_are_finite_permutations_of_disjoint_windows_inside_the_train_split() -> None:
    stream = _positions(10_000)
    source = StreamSource(_cfg(), stream)
    train_end = eval_split(len(stream), 0.1).start
    starts: list[int] = []
    windows = train_end // 8
    for shard in range(4):
        batches = _train(source, shard, 4, seed=1)
        mine = len(range(shard, windows, 4))  # every 4th window from the shard's own on
        assert len(batches) == mine // 4  # whole batches of whole windows
        shard_starts = []
        for batch in batches:
            assert batch.shape == (4, SEQ + 1)
            assert (np.diff(batch, axis=1) == 1).all()  # contiguous windows
            shard_starts.extend(int(s) for s in batch[:, 0])
        # Interleaved: the shard's windows are spread over the whole train split.
        assert all(s % 32 == 8 * shard for s in shard_starts)
        assert min(shard_starts) < train_end // 10 and max(shard_starts) > train_end * 9 // 10
        starts.extend(shard_starts)
    assert len(starts) == len(set(starts))  # no window twice in the epoch
    assert (np.diff(sorted(starts)) >= 8).all()  # windows never overlap
    assert max(starts) + 8 <= train_end  # nothing from the eval split


def test_the_order_depends_on_the_seed_and_position_skips_batches() -> None:
    source = StreamSource(_cfg(), _positions(10_000))
    first = _train(source, 1, 4, seed=1)
    again = _train(source, 1, 4, seed=1)
    other = _train(source, 1, 4, seed=2)
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    assert not all((a == b).all() for a, b in zip(first, other, strict=True))
    windows = {int(s) for b in first for s in b[:, 0]}
    again_windows = {int(s) for b in other for s in b[:, 0]}
    # The same shard's windows in another order (a partial last batch leaves a few out).
    assert len(windows & again_windows) >= len(windows) - 4
    resumed = _train(source, 1, 4, seed=1, position=3)
    assert len(resumed) == len(first) - 3
    assert all((a == b).all() for a, b in zip(first[3:], resumed, strict=True))
    assert _train(source, 1, 4, seed=1, position=len(first)) == []


def test_eval_gives_corpus_eval_batches() -> None:
    cfg = _cfg()
    stream = _positions(10_000)
    want = eval_batches(cfg, 3, stream)
    got = StreamSource(cfg, stream)(0, 4, seed=cfg.seed, batch_size=4, split="eval", position=0)
    for expected, batch in zip(want, got, strict=False):
        np.testing.assert_array_equal(batch, expected)


def test_a_shard_smaller_than_a_batch_names_data_shards() -> None:
    source = StreamSource(_cfg(), _positions(2_000))
    with pytest.raises(DataError, match=r"data\.shards"):
        _train(source, 0, 128, seed=0)  # 225 windows: 2 for shard 0


def test_bad_arguments_are_refused() -> None:
    source = StreamSource(_cfg(), _positions(10_000))
    with pytest.raises(DataError, match="split"):
        source(0, 4, seed=0, batch_size=4, split="test", position=0)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"data\.args"):
        source(0, 4, seed=0, batch_size=4, split="train", position=0, extra=1)
    with pytest.raises(DataError, match="shard 4"):
        _train(source, 4, 4, seed=0)
