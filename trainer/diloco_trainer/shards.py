"""A sharded syncer: which syncer process holds which fragment (pure logic, no I/O).

With `shards: S`, S syncer processes split the run's fragments between them; each holds only its
fragments' parameters, outer-optimizer state, pending pushes and journal. Shard 0 leads: it
alone hands out data leases and evaluates the model. Every shard takes joins and heartbeats
(its quorum and grace windows need the learners' pace) and the operator's roster.

The owner of each fragment follows from the layout alone, so a learner, every shard and the
operator compute the same map without asking anyone (docs/design.md, "Sharded syncer").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_SHARD = re.compile(r"^(\d+)/(\d+)$")
MAX_SHARDS = 64


@dataclass(frozen=True)
class Shard:
    """Syncer shard `index` of `count` (0/1: the whole model in one process)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS:
            raise ValueError(f"shards: must be in 1..{MAX_SHARDS}, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard: index {self.index} is not in 0..{self.count - 1}")

    @classmethod
    def parse(cls, raw: str) -> Shard:
        """`I/S`, as the syncer's --shard flag and DILOCO_SYNCER_SHARD spell it."""
        match = _SHARD.match(raw.strip())
        if match is None:
            raise ValueError(f"shard: expected INDEX/COUNT such as 0/2, got {raw!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def leads(self) -> bool:
        """Shard 0 keeps the run-level books: data leases, evaluations."""
        return self.index == 0

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_owners(sizes: Sequence[int], count: int) -> list[int]:
    """The shard of each fragment, given the fragments' element counts: largest first (ties by
    fragment index) onto the least-loaded shard (ties by lowest shard), so memory per shard is
    balanced and every shard holds at least one fragment. A count above the number of fragments
    is an error: a shard with nothing to hold would be a process that only costs."""
    if count < 1:
        raise ValueError(f"shards: must be >= 1, got {count}")
    if count > len(sizes):
        raise ValueError(
            f"shards: {count} shards for {len(sizes)} fragments; every shard needs a fragment "
            "(raise training.fragments or lower syncer.shards)"
        )
    loads = [0] * count
    owners = [0] * len(sizes)
    for fragment in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        target = min(range(count), key=lambda s: (loads[s], s))
        owners[fragment] = target
        loads[target] += sizes[fragment]
    return owners


def owned_versions(owners: Sequence[int], per_shard: Sequence[Sequence[int]]) -> list[int]:
    """Each fragment's version as the shard holding it reports it (`per_shard[i]`: shard i's
    list, which knows only its own fragments' versions)."""
    return [per_shard[owner][p] for p, owner in enumerate(owners)]


def shard_checkpoint_path(base: str, shard: Shard) -> str:
    """Where a shard keeps its checkpoints and journals: the run's path itself unsharded, else a
    folder per shard that names the shard count too, so that a restart with another count never
    reads a layout it does not hold (`foreign_shard_folders` finds the leftovers)."""
    if not shard.sharded:
        return base
    return f"{base.rstrip('/')}/{shard_folder(shard)}"


def shard_folder(shard: Shard) -> str:
    return f"shard-{shard.index}-of-{shard.count}"


_FOLDER = re.compile(r"^shard-(\d+)-of-(\d+)$")


def parse_shard_folder(name: str) -> Shard | None:
    """The shard a checkpoint folder named `shard-I-of-S` belongs to, or None."""
    match = _FOLDER.match(name)
    if match is None:
        return None
    try:
        return Shard(int(match.group(1)), int(match.group(2)))
    except ValueError:  # an index or count out of range: not a shard's folder
        return None


def foreign_shard_folders(names: Sequence[str], count: int) -> list[str]:
    """The entries of a checkpoint path written by a syncer with another shard count."""
    foreign = []
    for name in names:
        match = _FOLDER.match(name)
        if match is not None and int(match.group(2)) != count:
            foreign.append(name)
    return sorted(foreign)


def split_addresses(raw: str) -> list[str]:
    """The syncer addresses a learner is given, shard 0 first: one URL, or one per shard
    separated by commas."""
    addresses = [part.strip() for part in raw.split(",")]
    if not raw.strip() or any(not a for a in addresses):
        raise ValueError(f"syncer: expected URL[,URL...] (one per shard), got {raw!r}")
    if len(addresses) > MAX_SHARDS:
        raise ValueError(f"syncer: {len(addresses)} addresses; at most {MAX_SHARDS} shards")
    return addresses
