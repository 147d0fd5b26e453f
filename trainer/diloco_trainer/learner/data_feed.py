"""The learner's batches, following its data lease from the syncer (docs/design.md, "Data").

The feed reads the leased shard from the data source at the lease's position, one batch ahead:
when the look-ahead finds the shard exhausted, the leader claims the next shard in a background
thread while the shard's last batch trains, so a claim rarely stalls a step. Every host of a
unit reads the same unit-wide batch and keeps its own rows (hosts advance in lockstep, one batch
per step); the leader's claimed lease reaches the others by broadcast at the step where the
shard ran out, the same step on every host.

After each batch the feed publishes its lease (position = batches handed out) through
`on_position`; the leader's client sends it with every push (`X-Diloco-Data-Position`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from diloco_trainer.api import DataSource
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.distributed import broadcast_from_leader, is_leader
from diloco_trainer.learner.sync_link import retry_until
from diloco_trainer.learner.syncer_api import SyncerApi
from diloco_trainer.wire import DataLease

log = logging.getLogger(__name__)

# The leader's claim returns None when the learner is stopping: then the unit repeats its last
# batch for the step or two left (no lease to read from).
Claim = Callable[[DataLease], DataLease | None]


def epoch_seed(run_seed: int, epoch: int) -> int:
    """The data source's `seed` for a data epoch: one integer from (run seed, epoch)."""
    return int(np.random.SeedSequence([run_seed, epoch]).generate_state(1, np.uint64)[0] >> 1)


def share_lease(lease: DataLease | None) -> DataLease | None:
    """The leader's lease on every host of the unit (None: -1 on the wire)."""
    raw = np.asarray(
        [-1, -1, -1] if lease is None else [lease.epoch, lease.shard, lease.position], np.int64
    )
    got = np.asarray(broadcast_from_leader(raw)) if jax.process_count() > 1 else raw
    return None if int(got[0]) < 0 else DataLease(int(got[0]), int(got[1]), int(got[2]))


class DataFeed(Iterator[Any]):
    def __init__(
        self,
        source: DataSource,
        lease: DataLease,
        *,
        num_shards: int,
        run_seed: int,
        batch_size: int,
        rows: slice,
        claim: Claim | None,
        on_position: Callable[[DataLease], None] = lambda lease: None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """`lease`: where to start (the same on every host); `batch_size`: the unit's rows per
        step; `rows`: this host's share of them; `claim`: the leader's call to the syncer
        (None on other hosts)."""
        self.source, self.num_shards, self.run_seed = source, num_shards, run_seed
        self.batch_size, self.rows, self.args = batch_size, rows, dict(args or {})
        self.claim, self.on_position = claim, on_position
        self._claimed: concurrent.futures.Future[DataLease | None] | None = None
        self._last: Any = None
        self._open(lease)

    def _open(self, lease: DataLease) -> None:
        self.lease = lease
        batches: Iterable[Any] = self.source(
            lease.shard,
            self.num_shards,
            seed=epoch_seed(self.run_seed, lease.epoch),
            batch_size=self.batch_size,
            split="train",
            position=lease.position,
            **self.args,
        )
        self._batches = iter(batches)
        self._ahead = next(self._batches, None)
        log.info(
            "event=data_shard epoch=%d shard=%d position=%d empty=%s",
            lease.epoch,
            lease.shard,
            lease.position,
            self._ahead is None,
        )
        if self._ahead is None and lease.position == 0:
            raise ValueError(
                f"data: the source gave no batch for shard {lease.shard} of {self.num_shards} "
                "from position 0; every shard must hold at least one batch (data.shards)"
            )
        if self._ahead is None:
            self._start_claim()

    def _start_claim(self) -> None:
        """Claim the next shard in a daemon thread (a claim retrying against an unreachable
        syncer must not keep a finished learner's process alive)."""
        if self.claim is None or self._claimed is not None:
            return
        claim, finished = self.claim, self.lease
        future: concurrent.futures.Future[DataLease | None] = concurrent.futures.Future()
        self._claimed = future

        def work() -> None:
            try:
                future.set_result(claim(finished))
            except BaseException as exc:  # handed to the training thread by result()
                future.set_exception(exc)

        threading.Thread(target=work, name="data-claim", daemon=True).start()

    def _next_lease(self) -> DataLease | None:
        got: DataLease | None = None
        if self._claimed is not None:
            got = self._claimed.result()
            self._claimed = None
        return share_lease(got)

    def __next__(self) -> Any:
        while self._ahead is None:  # the shard is read: on to the claimed one
            lease = self._next_lease()
            if lease is None:  # stopping: no lease to read from
                if self._last is None:
                    raise StopIteration
                return self._last
            self._open(lease)
        batch = self._ahead
        self.lease = DataLease(self.lease.epoch, self.lease.shard, self.lease.position + 1)
        log.debug(
            "event=data_batch epoch=%d shard=%d position=%d",
            self.lease.epoch,
            self.lease.shard,
            self.lease.position - 1,
        )
        self._ahead = next(self._batches, None)
        if self._ahead is None:
            self._start_claim()  # overlaps the step that trains `batch`
        self.on_position(self.lease)
        self._last = jax.tree.map(lambda a: np.asarray(a)[self.rows], batch)
        return self._last


def unit_feed(
    cfg: TrainingConfig,
    source: DataSource,
    lease: DataLease | None,
    client: SyncerApi,
    stop: threading.Event,
) -> DataFeed:
    """This host's feed for the unit: `lease` is the leader's from the join (None elsewhere);
    the leader claims shards and reports its position through `client`."""
    lease = share_lease(lease)
    if lease is None:
        raise ValueError("the syncer's join reply holds no dataLease (a syncer too old?)")
    rows = cfg.data.batch_size // jax.process_count()
    first = jax.process_index() * rows
    claim: Claim | None = None
    if is_leader():
        client.data_position = lease

        def claim(finished: DataLease) -> DataLease | None:
            return retry_until(lambda: client.claim_data(finished), stop, "data_claim")

    def publish(at: DataLease) -> None:
        client.data_position = at

    return DataFeed(
        source,
        lease,
        num_shards=cfg.data.shards,
        run_seed=cfg.seed,
        batch_size=cfg.data.batch_size,
        rows=slice(first, first + rows),
        claim=claim,
        on_position=publish if claim is not None else lambda at: None,
    )
