"""What a learner asks of the syncer and what comes back: the replies as typed values and
`SyncerApi`, the calls themselves, which `client.SyncerClient` (one syncer process) and
`shard_client.ShardedClient` (a sharded syncer) both provide."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from diloco_trainer.status import SyncerStatus
from diloco_trainer.wire import DataLease


@dataclass(frozen=True)
class ShardLayout:
    """Which syncer shard answered a join, of how many, and the shard of each fragment."""

    index: int
    count: int
    owners: tuple[int, ...]


@dataclass(frozen=True)
class JoinReply:
    run: str
    layout: list[list[str]]
    versions: list[int]
    complete: bool
    outer_step: int = 0
    resume_step: int = 0  # the unit's steps in earlier attempts: where its LR schedule continues
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    data_lease: DataLease | None = None  # where the unit reads the train split
    shard: ShardLayout | None = None  # None: a syncer older than shards (one process)


@dataclass(frozen=True)
class PushReply:
    accepted: bool
    duplicate: bool
    version: int
    bytes_sent: int
    quant_error: float


@dataclass(frozen=True)
class HeartbeatReply:
    complete: bool
    versions: list[int]
    outer_step: int
    budget_done: float = 0.0  # the run's counted share of its budget (0 from older syncers)


class SyncerApi(Protocol):
    """What the learner asks of the syncer: `SyncerClient` (one process) and
    `shard_client.ShardedClient` (a sharded syncer) both provide it."""

    layout_plan: dict[str, Any] | None
    data_position: DataLease | None

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    def link_of(self, fragment: int) -> int:
        """Which syncer process the fragment's requests go to (0 unsharded): a failing one
        is backed off without holding back the others."""
        ...

    def join(self) -> JoinReply: ...

    def claim_data(self, finished: DataLease) -> DataLease: ...

    def pull_all(self) -> tuple[dict[str, np.ndarray], list[int]]: ...

    def push(
        self,
        fragment: int,
        base_version: int,
        delta: Mapping[str, np.ndarray],
        c_steps: int,
        c_tokens: int,
        step: int = 0,
    ) -> PushReply: ...

    def poll(
        self, fragment: int, after_version: int, wait: float
    ) -> tuple[int, dict[str, np.ndarray]] | None: ...

    def heartbeat(
        self, step: int, tokens: int, tokens_per_sec: float, loss: float | None
    ) -> HeartbeatReply: ...

    def status(self) -> SyncerStatus: ...

    def close(self) -> None: ...
