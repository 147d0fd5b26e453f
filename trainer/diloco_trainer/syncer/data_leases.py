"""The data lease book: which unit reads which shard of the train split, and how far it got.

The train split is cut into `data.shards` virtual shards. Each unit holds at most one lease
(epoch, shard, position = batches of that shard consumed). A shard is *free* in an epoch when it
is neither finished nor leased in that epoch. Assignment, for a unit with no lease or whose lease
ran out:

1. the lowest free shard of the current epoch;
2. an orphaned lease: held by a unit not alive any more (scaled down, or gone for longer than
   the caller's liveness window), handed over at its reported position;
3. otherwise every shard of the epoch is finished or leased: epoch+1 opens and its shard 0 goes
   out (the data source permutes each shard with the epoch, so the new epoch reads another order).

A unit that comes back (same name, any attempt) gets its own lease back at the last position
it reported. Within an epoch no shard is leased to two units at once, and a lease only moves
from a unit whose lease it is to another at the position it reported, so two units never read
the same (epoch, shard, batch) unless a dead unit read past its last report.

Only the book decides who reads what: a unit finishes, and reports positions in, the lease it
holds and nothing else. A claim or report naming any other shard changes nothing (a claim's
answer is then the unit's current lease, which is also the right answer to a retried claim whose
reply was lost). The book is journaled before a unit hears of a change (syncer side), so a
restarted syncer never knows less than a unit does and has no reason to take a unit's word.

Pure bookkeeping, no I/O: the syncer calls it from its HTTP handlers and checkpoints `to_json`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.wire import MAX_COUNTER, DataLease, WireError, data_lease_from_json

log = logging.getLogger("diloco.syncer")


@dataclass
class LeaseBook:
    num_shards: int
    epoch: int = 0
    finished: set[int] = field(default_factory=set)  # shards finished in `epoch`
    held: dict[str, DataLease] = field(default_factory=dict)  # unit -> its lease
    revision: int = 0  # bumped by every change, so a checkpoint knows to catch up
    # Bumped when a lease is given, taken or finished (not by positions): such a change is
    # journaled before the unit hears of it (CheckpointStore.record_leases).
    moves: int = 0
    # Each unit's last finished lease: tells a retried claim from one of a lease never held.
    last_finished: dict[str, DataLease] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"data.shards: must be >= 1, got {self.num_shards}")

    # ------------------------------------------------------------------ queries
    def lease_of(self, unit: str) -> DataLease | None:
        return self.held.get(unit)

    def _taken(self, epoch: int) -> set[int]:
        """Shards of `epoch` that are not free: finished or leased."""
        taken = {lease.shard for lease in self.held.values() if lease.epoch == epoch}
        return taken | (self.finished if epoch == self.epoch else set())

    # ------------------------------------------------------------------ changes
    def join(self, unit: str, alive: Collection[str]) -> DataLease:
        """The unit's lease: its own when it holds one (a restart), else a new one."""
        lease = self.held.get(unit)
        return lease if lease is not None else self._assign(unit, alive)

    def claim(self, unit: str, finished: DataLease, alive: Collection[str]) -> DataLease:
        """`unit` read all of `finished`: mark it so and return its next lease. A claim of
        anything but the unit's own lease changes nothing and returns that lease: a repeated
        claim (its answer was lost) gets what the first one gave, and a claim of a shard the
        book never gave the unit marks nothing finished."""
        current = self.held.get(unit)
        if current is not None and not finished.same_shard(current):
            retry = finished.same_shard(self.last_finished.get(unit))
            log.log(
                logging.INFO if retry else logging.WARNING,
                "event=%s unit=%s epoch=%d shard=%d held_epoch=%d held_shard=%d",
                "data_claim_repeated" if retry else "data_claim_ignored",
                unit,
                finished.epoch,
                finished.shard,
                current.epoch,
                current.shard,
            )
            return current
        if current is not None:
            self._finish(unit, current)
        return self._assign(unit, alive)

    def report(self, unit: str, at: DataLease) -> bool:
        """The unit's position from a push header, applied when it is in the unit's lease (never
        backwards). False when ignored: a report of a shard the unit does not hold."""
        current = self.held.get(unit)
        if not at.same_shard(current):
            return False
        assert current is not None
        if at.position > current.position:
            self.held[unit] = at
            self.revision += 1
        return True

    def _finish(self, unit: str, lease: DataLease) -> None:
        del self.held[unit]
        self.last_finished[unit] = lease
        if lease.epoch == self.epoch:
            self.finished.add(lease.shard)
        self._moved("data_shard_finished", unit, lease)

    def _assign(self, unit: str, alive: Collection[str]) -> DataLease:
        lease = self._next_lease(unit, alive)
        self.held[unit] = lease
        self._moved("data_lease", unit, lease)
        return lease

    def _moved(self, event: str, unit: str, lease: DataLease, level: int = logging.INFO) -> None:
        """An assignment changed: the journal must be rewritten (revision), and it is logged."""
        self.revision += 1
        self.moves += 1
        log.log(
            level,
            "event=%s unit=%s epoch=%d shard=%d position=%d",
            event,
            unit,
            lease.epoch,
            lease.shard,
            lease.position,
        )

    def _next_lease(self, unit: str, alive: Collection[str]) -> DataLease:
        taken = self._taken(self.epoch)
        free = [s for s in range(self.num_shards) if s not in taken]
        if free:
            return DataLease(self.epoch, free[0])
        orphans = sorted(
            (lease.epoch, lease.shard, owner)
            for owner, lease in self.held.items()
            if owner != unit and owner not in alive
        )
        if orphans:
            owner = orphans[0][2]
            lease = self.held.pop(owner)
            log.warning(
                "event=data_lease_reassigned from=%s to=%s epoch=%d shard=%d position=%d",
                owner,
                unit,
                lease.epoch,
                lease.shard,
                lease.position,
            )
            return lease
        self.epoch += 1
        self.finished = set()
        log.info("event=data_epoch epoch=%d shards=%d", self.epoch, self.num_shards)
        return DataLease(self.epoch, 0)

    # ------------------------------------------------------------------ checkpoint form
    def to_json(self) -> dict[str, Any]:
        return {
            "shards": self.num_shards,
            "epoch": self.epoch,
            "finished": sorted(self.finished),
            "held": {unit: lease.to_json() for unit, lease in self.held.items()},
            "moves": self.moves,
        }

    def newest(self, other: LeaseBook) -> LeaseBook:
        """Of this book (a checkpoint's) and `other` (the journal's), the one with the later
        assignments, holding the further position of each lease both have."""
        base, positions = (other, self) if other.moves > self.moves else (self, other)
        for unit, lease in base.held.items():
            seen = positions.held.get(unit)
            if seen is not None and lease.same_shard(seen) and seen.position > lease.position:
                base.held[unit] = seen
        return base

    @classmethod
    def from_json(cls, data: Any, num_shards: int) -> LeaseBook:
        """The book of a checkpoint; a fresh one when the checkpoint predates leases (None).
        A different shard count is refused: the shards' bounds would move under the leases.
        A damaged entry is dropped with an ERROR line and the rest kept."""
        book = cls(num_shards)
        if data is None:
            return book
        if not isinstance(data, dict):
            log.error("event=checkpoint_data_leases_dropped reason=not an object")
            return book
        if data.get("shards") != num_shards:
            raise ValueError(
                f"data.shards: the checkpoint's run has {data.get('shards')!r} shards, this "
                f"config {num_shards}; the shard count is fixed for the life of a run"
            )
        for name in ("epoch", "moves"):
            value = data.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNTER:
                setattr(book, name, value)
        finished = data.get("finished")
        book.finished = {
            s
            for s in (finished if isinstance(finished, list) else [])
            if isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_shards
        }
        held = data.get("held")
        for unit, raw in (held if isinstance(held, dict) else {}).items():
            try:
                book.held[str(unit)] = data_lease_from_json(raw, num_shards, f"held.{unit}")
            except WireError as exc:
                log.error("event=checkpoint_data_lease_dropped unit=%s reason=%r", unit, str(exc))
        return book
