"""What the syncer knows: the global fragments, the learners, the run's evaluations and
counters, and what follows from them (outer step, completion, status). The syncer's parts (push
intake, merge rounds, persistence, evaluation) read and change this state; `core.Syncer` adds
the lifecycle over it. State changes happen on the event loop thread only, by swapping whole
dicts, so a snapshot is just a set of references."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from diloco_trainer.budget import Budget
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import fragment_sizes, pack_fragments
from diloco_trainer.merge import Contribution
from diloco_trainer.outer import OuterOptimizer, merge_and_step
from diloco_trainer.shards import Shard, shard_owners
from diloco_trainer.status import CheckpointStatus, FinalEval, FragmentStatus, SyncerStatus
from diloco_trainer.syncer.checkpoint import CheckpointStore, Superseded
from diloco_trainer.syncer.data_leases import LeaseBook
from diloco_trainer.syncer.fragment import (
    EvalFn,
    FragmentState,
    InitFn,
    Reject,
    parse_fragment_index,
    start_params,
)
from diloco_trainer.syncer.gate import Gate, lead_steps
from diloco_trainer.syncer.grace import Ema
from diloco_trainer.syncer.health import Health
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.pools import Pools
from diloco_trainer.syncer.registry import LearnerRegistry
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.syncer.spares import SpareDesk
from diloco_trainer.tls import ClientTrust
from diloco_trainer.workload.check import tokens_per_step

log = logging.getLogger("diloco.syncer")


class SyncerState:
    def __init__(
        self,
        cfg: TrainingConfig,
        token: str,
        run: str,
        store: CheckpointStore | None,
        init_fn: InitFn,
        eval_fn: EvalFn | None,
        *,
        fresh: bool,
        max_units: int | None,
        roster: Roster | None,
        shard: Shard,
    ) -> None:
        """`fresh`: initialise the parameters from the model (else a checkpoint replaces them).
        `shard`: which of the run's fragments this process holds (shards.py); it knows the
        others' names and shapes, never their values."""
        if not token:
            raise ValueError("token: a bearer token is required")
        self.cfg, self.token, self.run, self.store, self.eval_fn = cfg, token, run, store, eval_fn
        self.metrics = SyncerMetrics()
        self.health = Health(self.metrics)
        self.pools = Pools()
        self.learners = LearnerRegistry(
            cfg.grace.ema, offline_after=max(5.0, 3 * cfg.heartbeat_seconds), lead=lead_steps(cfg)
        )
        # The learners' own count, from the batch their model trains on (not model.seqLen).
        self.tokens_per_step = tokens_per_step(cfg)
        self.gate = Gate(cfg, self.tokens_per_step, self.learners, self.metrics, roster, max_units)
        self.outer = OuterOptimizer.from_config(cfg.outer_optimizer)
        self.shard = shard
        self.peers: list[str] = []  # every shard's address, shard 0's first (peers.py)
        self.peer_trust = ClientTrust(os.environ.get("DILOCO_CA_FILE") or None)
        self.owners: list[int] = []
        params = start_params(
            cfg, init_fn, fresh=fresh, keep=self._held_leaves if shard.sharded else None
        )
        self.shapes = {k: tuple(int(d) for d in v.shape) for k, v in params.items()}
        layout = pack_fragments(self.shapes, cfg.fragments)
        self.owners = shard_owners(fragment_sizes(self.shapes, layout), shard.count)
        # Every fragment of the run, by index; those of other shards hold no values (`held`).
        self.frags = [self._new_fragment(i, names, params) for i, names in enumerate(layout)]
        self.held = [f for f in self.frags if f.held]
        self.leases = LeaseBook(cfg.data.shards)  # who reads which shard (data_leases.py)
        self.spares = SpareDesk()  # warm spares waiting to cover a lost unit (spares.py)
        # A lease whose unit was not heard from for this long may go to another unit.
        self.lease_orphan_after = max(30.0, 10 * cfg.heartbeat_seconds)
        self.eval_loss: float | None = None
        self.evaluated: tuple[int, ...] | None = None  # the versions eval_loss is of
        # The evaluation taken once the budget is reached (docs/protocol.md, "Final evaluation").
        self.final_loss: float | None = None
        self.final_eval: FinalEval = "waiting"
        self.final_task: asyncio.Task[None] | None = None
        self.decoding = 0  # pushes being decoded right now
        self.sync_time = Ema(cfg.grace.ema)
        self.bytes_received = 0
        self.bytes_sent = 0
        self.saved_mark: tuple[int, ...] | None = None  # mark() of the last checkpoint
        self.save_lock = asyncio.Lock()
        self.background: list[asyncio.Task[None]] = []  # cancelled when the server stops
        self.closing = False
        self.restored_seq: int | None = None  # the checkpoint this state came from
        self.warmed = False  # warm_up has compiled every fragment's outer step
        self.published: list[int] = []  # per fragment: the highest version journaled
        self.epoch = ""
        # Set once another syncer has written the checkpoint location since this one claimed
        # it (storage.Superseded): from then on this one writes nothing and stops serving.
        self.superseded: Superseded | None = None
        self.on_superseded: Callable[[], None] | None = None  # serve() stops the server

    def _held_leaves(self, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
        layout = pack_fragments(shapes, self.cfg.fragments)
        owners = shard_owners(fragment_sizes(shapes, layout), self.shard.count)
        return {n for p, names in enumerate(layout) if owners[p] == self.shard.index for n in names}

    def _new_fragment(
        self, index: int, names: list[str], params: Mapping[str, np.ndarray]
    ) -> FragmentState:
        if self.owners[index] != self.shard.index:
            return FragmentState(index, names, {}, self.outer.init({}), held=False)
        frag_params = {n: np.asarray(params[n], dtype=np.float32) for n in names}
        elements = sum(v.size for v in frag_params.values())
        # The largest legitimate push is the unquantized float32 fragment plus its header.
        max_body = 4 * elements + 1024 * len(names) + 65536
        return FragmentState(
            index, names, frag_params, self.outer.init(frag_params), max_body=max_body
        )

    def fragment(self, raw: str) -> FragmentState:
        """The fragment a URL names; Reject when the run has none such, or another shard holds
        it (421, naming the one that does)."""
        index = parse_fragment_index(raw, len(self.frags))
        if index is None:
            raise Reject(
                404,
                "unknown_fragment",
                f"unknown fragment {raw!r}: this run has 0..{len(self.frags) - 1}",
            )
        f = self.frags[index]
        if not f.held:
            raise Reject(
                421,
                "wrong_shard",
                f"fragment {index} is held by syncer shard {self.owners[index]} of "
                f"{self.shard.count}; this is shard {self.shard.index}",
            )
        return f

    def merge_compute(
        self,
        params: dict[str, np.ndarray],
        state: Any,
        contributions: list[Contribution],
        share: float,
    ) -> tuple[dict[str, np.ndarray], Any]:
        """One outer step of a fragment (in the merge thread): the merge rounds run it,
        `warm_up` compiles it."""
        merge = self.cfg.merge
        return merge_and_step(
            self.outer, params, state, contributions, merge.method, merge.token_weighting, share
        )

    def failed(self, what: str, error: BaseException) -> None:
        """A component failed (health.py). Superseded: another syncer writes the checkpoint
        location now, so this one stands down (serve() stops, no final checkpoint)."""
        self.health.failed(what, error)
        if isinstance(error, Superseded) and self.superseded is None:
            self.superseded = error
            log.error("event=superseded what=%s action=stop_serving error=%r", what, str(error))
            if self.on_superseded is not None:
                self.on_superseded()

    # ---------------------------------------------------------------- derived state
    def mark(self) -> tuple[int, ...]:
        """What a checkpoint must keep up with: versions, counters, joins (a push needs its
        attempt's join, so a clean restart must not forget one), data leases and the roster
        (its revocations too: a roster of the same revision may revoke more)."""
        steps, tokens = self.learners.totals()
        joins = sum(len(r.joined) for r in self.learners.records.values())
        held = self.gate.roster
        roster = (-1, 0) if held is None else (held.revision, hash((held.revoked, held.budget)))
        return self.outer_step, steps, tokens, joins, self.leases.revision, *roster

    @property
    def outer_step(self) -> int:
        """Merges this process made (a shard: of its fragments; the run's is the shards' sum)."""
        return sum(f.version for f in self.held)

    @property
    def budget(self) -> Budget:
        """The run's budget: the newest roster's (the operator hands over a changed one), else
        the training config's."""
        held = self.gate.roster
        if held is not None and held.budget is not None:
            return held.budget
        return Budget.of(self.cfg)

    @property
    def complete(self) -> bool:
        return self.budget.reached(*self.learners.totals())

    @property
    def settled(self) -> bool:
        """No push is being decoded and no merge is running."""
        return self.decoding == 0 and all(f.merge_task is None for f in self.held)

    @property
    def budget_done(self) -> float:
        """The share of the run's budget its learners have counted, in [0, 1]: what each
        learner's LR schedule keeps up with (`learner.train.ScheduleClock`)."""
        return self.budget.share_done(*self.learners.totals())

    def take_roster(self, roster: Roster) -> bool:
        """Admit by `roster` when it is at least as new as the one held (False: nothing
        changes). A complete run stays complete: its learners were told to stop and its final
        evaluation is under way, so a roster then keeps the budget that completed it."""
        if self.complete and roster.budget != self.budget:
            roster = replace(roster, budget=self.budget)
        return self.gate.take_roster(roster)

    def versions(self) -> list[int]:
        return [f.version for f in self.frags]

    def global_params(self) -> dict[str, np.ndarray]:
        """The current parameters of every fragment held, in one dict (references, not
        copies)."""
        params: dict[str, np.ndarray] = {}
        for f in self.held:
            params.update(f.params)
        return params

    def publish_gauges(self) -> None:
        self.metrics.outer_step.set(self.outer_step)
        for f in self.held:
            self.metrics.fragment_version.labels(str(f.index)).set(f.version)
        self.metrics.count_tokens(self.learners.totals()[1])
        self.metrics.learners_online.set(len(self.learners.online(time.time())))
        if self.eval_loss is not None:
            self.metrics.eval_loss.set(self.eval_loss)

    def status(self) -> SyncerStatus:
        now = time.time()
        steps, tokens = self.learners.totals()
        return SyncerStatus(
            run=self.run,
            outer_step=self.outer_step,
            steps=steps,
            tokens=tokens,
            loss=self.eval_loss,
            train_loss=self.learners.train_loss(),
            complete=self.complete,
            final_loss=self.final_loss,
            final_eval=self.final_eval,
            time=now,
            fragments=tuple(FragmentStatus(f.index, f.version, f.last_merge) for f in self.held),
            learners=self.learners.status(now, self.gate.quarantine.reason),
            bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent,
            health=self.health.status(),
            checkpoint=CheckpointStatus(tuple(self.store.skipped) if self.store else ()),
            roster_revision=self.gate.roster_revision,
            shard=self.shard,
            spares=self.spares.status(now),
        )
