"""The learner's data feed over a fake source and claim (single process)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from diloco_trainer.learner.data_feed import DataFeed, epoch_seed
from diloco_trainer.wire import DataLease

BATCHES_PER_SHARD = 3


def source(
    shard: int,
    num_shards: int,
    *,
    seed: int,
    batch_size: int,
    split: str,
    position: int,
    **args: Any,
) -> Iterator[dict[str, np.ndarray]]:
    """Batch rows say (seed, shard, batch index, row)."""
    assert split == "train" and num_shards == 4
    for b in range(position, BATCHES_PER_SHARD):
        rows = np.arange(batch_size)
        yield {
            "x": np.stack(
                [
                    np.full(batch_size, seed),
                    np.full(batch_size, shard),
                    np.full(batch_size, b),
                    rows,
                ],
                axis=1,
            )
        }


class Claims:
    def __init__(self, answers: list[DataLease | None]) -> None:
        self.answers, self.finished = answers, []
        self.called = threading.Event()

    def __call__(self, finished: DataLease) -> DataLease | None:
        self.finished.append(finished)
        self.called.set()
        return self.answers.pop(0)


def feed(lease: DataLease, claims: Claims | None, published: list[DataLease]) -> DataFeed:
    return DataFeed(
        source,
        lease,
        num_shards=4,
        run_seed=7,
        batch_size=4,
        rows=slice(2, 4),
        claim=claims,
        on_position=published.append,
    )


def test_the_feed_reads_its_shard_then_the_claimed_one() -> None:
    claims = Claims([DataLease(0, 3, 0)])
    published: list[DataLease] = []
    batches = feed(DataLease(0, 1, 1), claims, published)
    got = [next(batches)["x"] for _ in range(3)]
    seed = epoch_seed(7, 0)
    assert [(int(b[0, 1]), int(b[0, 2])) for b in got] == [(1, 1), (1, 2), (3, 0)]
    assert all(int(b[0, 0]) == seed for b in got)
    assert all(b[:, 3].tolist() == [2, 3] for b in got)  # this host's rows only
    assert claims.finished == [DataLease(0, 1, 3)]  # read to its end
    assert published == [DataLease(0, 1, 2), DataLease(0, 1, 3), DataLease(0, 3, 1)]


def test_the_claim_starts_while_the_shards_last_batch_trains() -> None:
    claims = Claims([DataLease(0, 2, 0)])
    batches = feed(DataLease(0, 0, 1), claims, [])
    next(batches)  # batch 1 of 3: the look-ahead still has batch 2
    assert not claims.called.wait(0.2)
    next(batches)  # batch 2, the last: the look-ahead found the end, the claim is under way
    assert claims.called.wait(5)


def test_the_epoch_reseeds_the_source() -> None:
    batches = feed(DataLease(3, 0, 0), Claims([]), [])
    assert int(next(batches)["x"][0, 0]) == epoch_seed(7, 3) != epoch_seed(7, 0)


def test_a_restart_at_the_end_of_its_shard_claims_at_once() -> None:
    claims = Claims([DataLease(1, 0, 0)])
    batches = feed(DataLease(0, 2, BATCHES_PER_SHARD), claims, [])
    assert int(next(batches)["x"][0, 1]) == 0
    assert claims.finished == [DataLease(0, 2, BATCHES_PER_SHARD)]


def test_when_stopping_without_a_lease_the_last_batch_repeats() -> None:
    batches = feed(DataLease(0, 0, 2), Claims([None]), [])
    last = next(batches)
    assert next(batches) is last


def test_a_source_with_nothing_for_a_fresh_shard_is_an_error() -> None:
    def empty(*args: Any, **kwargs: Any) -> list[Any]:
        return []

    with pytest.raises(ValueError, match=r"data\.shards"):
        DataFeed(
            empty,
            DataLease(0, 0, 0),
            num_shards=4,
            run_seed=0,
            batch_size=4,
            rows=slice(0, 4),
            claim=None,
        )
