"""The syncer: global fragments, quorum + grace merges, outer Nesterov steps, long-poll broadcast.

One asyncio process. The event loop only does bookkeeping; decoding payloads, merging, evaluating
and checkpointing run in thread pools (pools.py) so a slow merge never delays a heartbeat. The
state lives in state.py; its parts are push.py (intake), rounds.py (merges), persist.py
(checkpoints and journals) and evaluation.py; this class is their lifecycle: start, serve, take
over, stop. HTTP details are in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from aiohttp import web

from diloco_trainer.config import TrainingConfig
from diloco_trainer.downlink import Publication
from diloco_trainer.merge import Contribution
from diloco_trainer.payload import Pieces
from diloco_trainer.phases import phase
from diloco_trainer.shards import Shard
from diloco_trainer.syncer import evaluation, persist, push
from diloco_trainer.syncer.checkpoint import CheckpointStore, Snapshot
from diloco_trainer.syncer.fragment import (
    EvalFn,
    FragmentState,
    InitFn,
    default_eval,
    default_init,
    l2_norm,
)
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.wire import encode_step, params_pieces

log = logging.getLogger("diloco.syncer")


class Syncer(SyncerState):
    def __init__(
        self,
        cfg: TrainingConfig,
        token: str,
        run: str = "run",
        store: CheckpointStore | None = None,
        init_fn: InitFn = default_init,
        eval_fn: EvalFn | None = default_eval,
        restore: Snapshot | None = None,
        max_units: int | None = None,
        standby: bool = False,
        roster: Roster | None = None,
        shard: Shard | None = None,
        peers: Sequence[str] = (),
    ) -> None:
        """`standby`: a warm spare (standby.py) that reads the checkpoint location but writes
        nothing to it until `take_over`. `shard`: the fragments this process holds (shards.py);
        `peers`: every shard's address, shard 0's first, which the leading shard reads the other
        fragments from to evaluate the model; the other shards never evaluate."""
        # `restore` lets the caller read (and vet) the checkpoint before paying for model init.
        snap = restore if restore is not None else (store.load_latest() if store else None)
        if shard is not None and not shard.leads:
            eval_fn = None
        super().__init__(
            cfg,
            token,
            run,
            store,
            init_fn,
            eval_fn,
            fresh=snap is None,
            max_units=max_units,
            roster=roster,
            shard=shard or Shard(),
        )
        self.peers = list(peers)
        if self.shard.sharded and eval_fn is not None and len(self.peers) != self.shard.count:
            raise ValueError(
                f"shard {self.shard}: evaluating the model needs every shard's address "
                f"({self.shard.count}), got {len(self.peers)}"
            )
        if snap is not None:
            persist.restore(self, snap)
        for f in self.held:
            f.norm = l2_norm(f.params)
        persist.replay_journal(self, at_start=True)
        self.metrics.checkpoints_skipped.set(len(store.skipped) if store else 0)
        if self.final_loss is not None:
            self.final_eval = "done"
        elif eval_fn is None:
            self.final_eval = "off"
        self.standby = standby
        if not standby:
            self._begin_serving()

    def _begin_serving(self) -> None:
        if self.store is not None:
            persist.catch_up(self, self.store.claim())
        self.published = persist.resume_numbering(self)
        # Names this process's downlink steps: a learner's copy from another process (before a
        # restart) never gets a step, only values.
        self.epoch = secrets.token_hex(8)
        if self.cfg.compression.downlink != "none":
            for f in self.held:
                f.publication = Publication(f.version, dict(f.params))
        self.publish_gauges()

    def follow(self) -> list[int]:
        """A standby's catch-up: install the fragment versions journaled since it last looked
        (only those the version journal says are newer are read)."""
        journal = self.store.recorded_versions() if self.store is not None else None
        if journal is None or len(journal) != len(self.frags):
            return []
        if all(v <= f.version for v, f in zip(journal, self.frags, strict=True)):
            return []
        return persist.replay_journal(self, logging.DEBUG)

    def take_over(self) -> None:
        """A standby becomes the serving syncer: the newest checkpoint's run state (learners,
        evaluations, data leases), every journaled fragment, then version numbering."""
        assert self.standby, "take_over is for a standby"
        persist.take_over_run_state(self)
        persist.replay_journal(self)
        self.standby = False
        self._begin_serving()

    def snapshot(self) -> Snapshot:
        """References to the current state (taken on the loop thread; arrays are never mutated)."""
        return persist.snapshot(self)

    async def save_checkpoint(self, force: bool = False) -> None:
        await persist.save_checkpoint(self, force)

    async def accept_push(
        self, f: FragmentState, body: bytes, caller: str | None = None
    ) -> dict[str, Any]:
        """Decode, check and queue one push (`push.accept_push`). `caller`: the
        authenticated unit, which must be the payload's (None skips that check: in-process
        callers)."""
        return await push.accept_push(self, f, body, caller)

    # ---------------------------------------------------------------- downloads
    async def fragment_payload(self, f: FragmentState, after: int = -1, epoch: str = "") -> Pieces:
        """The fragment at its current version for a learner that holds version `after`
        published by `epoch`: the quantized step from there when the downlink has one (small:
        encoded once, off the loop, however many long-pollers wake up for it), else the
        published values, which are not copied: the response writes the arrays themselves."""
        version, pub = f.version, f.publication
        step = (
            pub is not None
            and pub.step is not None
            and pub.version == version
            and after == version - 1
            and epoch == self.epoch
        )
        self.metrics.downloads.labels("step" if step else "values").inc()
        if not step:
            return params_pieces(f.published(), [version], f.index, self.epoch)
        assert pub is not None and pub.step is not None
        cached = f.step_payload
        if cached is None or cached[0] != version:
            job = functools.partial(
                encode_step, pub.step, f.index, after, version, self.epoch, pub.checksum
            )
            future = asyncio.get_running_loop().run_in_executor(self.pools.decode, job)
            cached = f.step_payload = (version, asyncio.ensure_future(future))
        return Pieces(await cached[1])

    async def wait_for_change(self, f: FragmentState, after: int, wait: float) -> bool:
        """True once f.version != after (newer, or older after a restore); False on timeout or
        when the server is shutting down."""
        deadline = time.monotonic() + wait
        while f.version == after and not self.closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(f.changed.wait(), remaining)
            except TimeoutError:
                break
        return f.version != after  # False on timeout or shutdown: the poller gets 204

    # ---------------------------------------------------------------- background work
    async def _every(self, seconds: float, work: Callable[[], Awaitable[None]], name: str) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:
                log.exception("event=%s_failed", name)

    async def run_eval(self) -> None:
        await evaluation.run_eval(self)

    def check_complete(self) -> None:
        """Start the final evaluation the first time the budget is seen reached
        (`evaluation.check_complete`)."""
        evaluation.check_complete(self)

    def warm_up(self) -> None:
        """Compile each fragment's outer step before the first push can arrive. Compiled on
        the first merge instead (seconds per fragment), the learners' progress piled up
        meanwhile would reach the global parameters as one outsized outer gradient, which the
        outer momentum then carries several times over."""
        for f in self.held:
            zero = {name: np.zeros_like(value) for name, value in f.params.items()}
            self.merge_compute(f.params, f.opt_state, [Contribution(zero, 1, 1)], 1.0)
        self.warmed = True

    async def start_background(self, app: web.Application) -> None:
        # A standby warmed up while it waited: a take-over binds the port without a second
        # pass over every fragment.
        if not self.warmed:
            with phase(log, "compile"):
                await asyncio.get_running_loop().run_in_executor(self.pools.merge, self.warm_up)
        if self.store is not None:
            if self.saved_mark is None:  # a fresh run has a checkpoint from its first second
                try:
                    with phase(log, "first_checkpoint"):
                        await self.save_checkpoint()
                except Exception:
                    # A full or failing disk: serve anyway (readiness says so, health.py); the
                    # periodic save below writes it once it can. Exiting would not free the disk.
                    log.exception("event=checkpoint_failed when=start")
            self.background.append(
                asyncio.create_task(
                    self._every(
                        self.cfg.checkpoint.every_seconds, self.save_checkpoint, "checkpoint"
                    )
                )
            )
        if self.eval_fn is not None and self.cfg.eval.every_seconds is not None:
            self.background.append(
                asyncio.create_task(self._every(self.cfg.eval.every_seconds, self.run_eval, "eval"))
            )
        self.check_complete()

    async def wake_pollers(self, app: web.Application) -> None:
        """On shutdown: answer every open long-poll (204) so the server can stop at once."""
        self.closing = True
        for f in self.frags:
            f.changed.set()

    async def stop_background(self, app: web.Application) -> None:
        for task in self.background:
            task.cancel()
        for f in self.frags:
            if f.merge_task is not None:
                f.merge_task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.background.clear()
        await self.save_checkpoint(force=False)

    def close(self) -> None:
        self.pools.close()
