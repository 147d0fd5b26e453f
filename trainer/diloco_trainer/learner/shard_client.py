"""A learner's client of a sharded syncer: one `SyncerClient` per shard behind the same calls.

Pushes and long-polls of a fragment go to the shard that holds it (the owners come with the
join reply); joins go to every shard, shard 0 first (its reply holds the unit's data lease and
resume step); heartbeats go to every shard, shard 0 answering (the others keep their view of
the learners' pace current, which their quorum and grace windows need, from a background
thread each, so a shard that does not answer never delays the heartbeat that tells a learner
the run is complete); data claims and status reads are shard 0's. A shard that fails stalls its
own fragments only: the learner keeps training, and what it could not push is folded into the
next push of the fragment (sync_link.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from diloco_trainer.learner.client import SyncerClient, SyncerError, SyncerRejected
from diloco_trainer.learner.syncer_api import HeartbeatReply, JoinReply, PushReply
from diloco_trainer.shards import owned_versions
from diloco_trainer.status import SyncerStatus
from diloco_trainer.wire import DataLease

log = logging.getLogger(__name__)


class ShardMismatch(SyncerRejected):
    """The learner was given another number of syncer addresses than the run has shards."""

    def __init__(self, message: str) -> None:
        super().__init__(409, "shard_mismatch", message)


class ShardedClient:
    def __init__(self, shards: Sequence[SyncerClient]) -> None:
        if len(shards) < 2:
            raise ValueError("ShardedClient: a sharded syncer has at least two shards")
        self.shards = list(shards)
        for index, client in enumerate(self.shards):
            client.slot = (index, len(self.shards))
        self.lead = self.shards[0]
        self.owners: list[int] = []
        self._beating: dict[int, threading.Thread] = {}

    # What the learner sets on its client: the fragment plan goes to every shard's join; the
    # data position only to shard 0's requests (it keeps the lease book).
    @property
    def layout_plan(self) -> dict[str, Any] | None:
        return self.lead.layout_plan

    @layout_plan.setter
    def layout_plan(self, plan: dict[str, Any] | None) -> None:
        for client in self.shards:
            client.layout_plan = plan

    @property
    def data_position(self) -> DataLease | None:
        return self.lead.data_position

    @data_position.setter
    def data_position(self, at: DataLease | None) -> None:
        self.lead.data_position = at

    @property
    def bytes_sent(self) -> int:
        return sum(client.bytes_sent for client in self.shards)

    @property
    def bytes_received(self) -> int:
        return sum(client.bytes_received for client in self.shards)

    def link_of(self, fragment: int) -> int:
        return self.owners[fragment] if 0 <= fragment < len(self.owners) else 0

    def owner(self, fragment: int) -> SyncerClient:
        if not 0 <= fragment < len(self.owners):
            raise SyncerRejected(404, "unknown_fragment", f"fragment {fragment}: not joined yet")
        return self.shards[self.owners[fragment]]

    # ---------------------------------------------------------------- protocol
    def join(self) -> JoinReply:
        first = self.lead.join()
        owners = self._owners(first, 0)
        per_shard = [first.versions]
        for index, client in enumerate(self.shards[1:], start=1):
            reply = client.join()
            if self._owners(reply, index) != owners:
                raise ShardMismatch(f"shard {index} places the fragments otherwise than shard 0")
            per_shard.append(reply.versions)
        self.owners = owners
        return replace(first, versions=owned_versions(owners, per_shard))

    def _owners(self, reply: JoinReply, index: int) -> list[int]:
        # SyncerClient.join checked the shard's index and count.
        if reply.shard is None:
            raise ShardMismatch(
                f"{self.shards[index].address} is not a sharded syncer, this learner was given "
                f"{len(self.shards)} addresses"
            )
        return list(reply.shard.owners)

    def pull_all(self) -> tuple[dict[str, np.ndarray], list[int]]:
        tensors: dict[str, np.ndarray] = {}
        per_shard = []
        for client in self.shards:
            got, theirs = client.pull_all()
            tensors.update(got)
            per_shard.append(theirs)
        return tensors, owned_versions(self.owners, per_shard)

    def push(
        self,
        fragment: int,
        base_version: int,
        delta: Mapping[str, np.ndarray],
        c_steps: int,
        c_tokens: int,
        step: int = 0,
    ) -> PushReply:
        return self.owner(fragment).push(fragment, base_version, delta, c_steps, c_tokens, step)

    def poll(
        self, fragment: int, after_version: int, wait: float
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        return self.owner(fragment).poll(fragment, after_version, wait)

    def heartbeat(
        self, step: int, tokens: int, tokens_per_sec: float, loss: float | None
    ) -> HeartbeatReply:
        for index, client in enumerate(self.shards[1:], start=1):
            if index in self._beating and self._beating[index].is_alive():
                continue  # the last one to this shard is still out: skip a beat, do not pile up
            beat = threading.Thread(
                target=_beat,
                args=(client, index, step, tokens, tokens_per_sec, loss),
                name=f"heartbeat-shard-{index}",
                daemon=True,
            )
            self._beating[index] = beat
            beat.start()
        return self.lead.heartbeat(step, tokens, tokens_per_sec, loss)

    def claim_data(self, finished: DataLease) -> DataLease:
        return self.lead.claim_data(finished)

    def status(self) -> SyncerStatus:
        return self.lead.status()

    def close(self) -> None:
        for client in self.shards:
            client.close()


def _beat(
    client: SyncerClient,
    index: int,
    step: int,
    tokens: int,
    tokens_per_sec: float,
    loss: float | None,
) -> None:
    # A shard that restarted hears of the unit from this (a push's not_joined joins again).
    try:
        client.heartbeat(step, tokens, tokens_per_sec, loss)
    except SyncerError as exc:
        log.warning("event=heartbeat_failed shard=%d error=%s", index, exc)
