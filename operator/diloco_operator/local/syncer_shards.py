"""A local run's syncer shards (spec.syncer.shards), supervised together: each a
`SyncerProcess` with its own port, log, lock, standby and checkpoint folder, one run secret.

The runtime sees one syncer, as the operator does: present while every shard's process lives (a
dead shard is started again by the planner's CreateSyncer), ready while every shard serves. A
shard that is down stalls its own fragments only, so the run's status is shard 0's (it holds the
run-level books: learners, data leases, evaluations) with the other shards' fragments added
(`status.gathered`), a down shard's from its last word; without shard 0 there is none. An
unsharded run is the one-shard case of the same code.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco_operator.local.syncer_process import SyncerProcess
from diloco_operator.planner import SyncerStatus
from diloco_trainer.shards import Shard
from diloco_trainer.status import gathered


class SyncerShards:
    def __init__(self, count: int, make: Callable[[Shard, str | None], SyncerProcess]) -> None:
        """`make(shard, token)`: one shard's process (the first makes the run secret)."""
        first = make(Shard(0, count), None)
        self.shards = [first] + [make(Shard(i, count), first.token) for i in range(1, count)]
        self.lead = first
        self.token = first.token
        addresses = [s.client.base_url for s in self.shards]
        for shard in self.shards:
            shard.peers = addresses
        # What a learner is given: every shard's address, shard 0's first (one: unsharded).
        self.addresses = ",".join(addresses)
        self.keys = {s.key: s for s in self.shards}
        self.standby_keys = {s.standby_key: s for s in self.shards}

    # --- what the runtime asks ------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return all(s.healthy for s in self.shards)

    def alive(self) -> bool:
        return all(s.alive() for s in self.shards)

    @property
    def report(self) -> SyncerStatus | None:
        """The run's status for the planner: None while shard 0 is down."""
        return self._gathered(self.lead.report)

    @property
    def last_status(self) -> SyncerStatus | None:
        return self._gathered(self.lead.last_status)

    def _gathered(self, lead: SyncerStatus | None) -> SyncerStatus | None:
        """`lead` with the fragments of the other shards that have served at least once, as of
        their last word."""
        if lead is None:
            return None
        others = [s.last_status for s in self.shards[1:]]
        return gathered([lead, *(status for status in others if status is not None)])

    # --- what the runtime does -------------------------------------------------------------
    def start(self, now: float) -> None:
        for shard in self.shards:
            shard.start(now)

    def poll(self, now: float) -> None:
        for shard in self.shards:
            shard.poll(now)

    def top_up_standby(self, now: float, run_over: bool) -> None:
        for shard in self.shards:
            shard.top_up_standby(now, run_over)

    def process_exited(self, key: str, code: int, now: float) -> bool:
        """Dispatch a process exit to its shard; False when `key` is no syncer process."""
        if key in self.keys:
            self.keys[key].exited(code, now)
        elif key in self.standby_keys:
            self.standby_keys[key].standby_exited(code, now)
        else:
            return False
        return True

    def refresh(self) -> SyncerStatus | None:
        """Every shard's status outside a tick (after the budget); None while shard 0 is down."""
        lead = self.lead.refresh()
        for shard in self.shards[1:]:
            shard.refresh()
        return self._gathered(lead)
