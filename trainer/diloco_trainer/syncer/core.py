"""The syncer: global fragments, quorum + grace merges, outer Nesterov steps, long-poll broadcast.

One asyncio process. The event loop only does bookkeeping; decoding payloads, merging, evaluating
and checkpointing run in thread executors so a slow merge never delays a heartbeat. State changes
(params, versions, optimizer states) happen on the loop thread only, by swapping whole dicts, so a
snapshot is just a set of references. HTTP details are in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web

from diloco_trainer.config import TrainingConfig
from diloco_trainer.downlink import Publication
from diloco_trainer.fragments import pack_fragments
from diloco_trainer.merge import Contribution
from diloco_trainer.outer import OuterOptimizer, merge_and_step
from diloco_trainer.phases import phase
from diloco_trainer.status import CheckpointStatus, FinalEval, FragmentStatus, SyncerStatus
from diloco_trainer.syncer import evaluation, persist, push
from diloco_trainer.syncer.checkpoint import CheckpointStore, Snapshot, Superseded
from diloco_trainer.syncer.data_leases import LeaseBook
from diloco_trainer.syncer.fragment import (
    EvalFn,
    FragmentState,
    InitFn,
    Reject,
    default_eval,
    default_init,
    l2_norm,
    parse_fragment_index,
    start_params,
)
from diloco_trainer.syncer.gate import Gate, lead_steps
from diloco_trainer.syncer.grace import Ema
from diloco_trainer.syncer.health import Health
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.registry import LearnerRegistry
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.wire import (
    encode_params,
    encode_step,
)

log = logging.getLogger("diloco.syncer")


class Syncer:
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
    ) -> None:
        """`standby`: a warm spare (standby.py) that reads the checkpoint location but writes
        nothing to it until `take_over`."""
        if not token:
            raise ValueError("token: a bearer token is required")
        self.cfg, self.token, self.run, self.store, self.eval_fn = cfg, token, run, store, eval_fn
        self.metrics = SyncerMetrics()
        self.health = Health(self.metrics)
        self.learners = LearnerRegistry(
            cfg.grace.ema, offline_after=max(5.0, 3 * cfg.heartbeat_seconds), lead=lead_steps(cfg)
        )
        # The learners' own count, from the batch their model trains on (not model.seqLen).
        from diloco_trainer.workload.check import tokens_per_step

        self.tokens_per_step = tokens_per_step(cfg)
        self.gate = Gate(cfg, self.tokens_per_step, self.learners, self.metrics, roster, max_units)
        self.outer = OuterOptimizer.from_config(cfg.outer_optimizer)
        # `restore` lets the caller read (and vet) the checkpoint before paying for model init.
        snap = restore if restore is not None else (store.load_latest() if store else None)
        params = start_params(cfg, init_fn, fresh=snap is None)
        self.shapes = {k: tuple(int(d) for d in v.shape) for k, v in params.items()}
        layout = pack_fragments(self.shapes, cfg.fragments)
        self.frags = [self._new_fragment(i, names, params) for i, names in enumerate(layout)]
        self.leases = LeaseBook(cfg.data.shards)  # who reads which shard (data_leases.py)
        # A lease whose unit was not heard from for this long may go to another unit.
        self.lease_orphan_after = max(30.0, 10 * cfg.heartbeat_seconds)
        self.eval_loss: float | None = None
        # The evaluation taken once the budget is reached (docs/protocol.md, "Final evaluation").
        self.final_loss: float | None = None
        self.final_eval: FinalEval = "waiting"
        self._final_task: asyncio.Task[None] | None = None
        self._decoding = 0  # pushes being decoded right now
        self.sync_time = Ema(cfg.grace.ema)
        self.bytes_received = 0
        self.bytes_sent = 0
        self._open_pools()
        self._saved_mark: tuple[int, ...] | None = None
        self._save_lock = asyncio.Lock()
        self._background: list[asyncio.Task[None]] = []
        self.closing = False
        self._evaluated: tuple[int, ...] | None = None
        self.restored_seq: int | None = None  # the checkpoint this state came from
        self.warmed = False  # warm_up has compiled every fragment's outer step
        if snap is not None:
            persist.restore(self, snap)
        for f in self.frags:
            f.norm = l2_norm(f.params)
        persist.replay_journal(self, at_start=True)
        self.metrics.checkpoints_skipped.set(len(store.skipped) if store else 0)
        if self.final_loss is not None:
            self.final_eval = "done"
        elif eval_fn is None:
            self.final_eval = "off"
        self._journal_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal")
        self.standby = standby
        self._published: list[int] = []
        self.epoch = ""
        # Set once another syncer has written the checkpoint location since this one claimed
        # it (storage.Superseded): from then on this one writes nothing and stops serving.
        self.superseded: Superseded | None = None
        self.on_superseded: Callable[[], None] | None = None  # serve() stops the server
        if not standby:
            self._begin_serving()

    def _open_pools(self) -> None:
        pool = concurrent.futures.ThreadPoolExecutor
        self._merge_pool = pool(1, thread_name_prefix="merge")
        # Separate pools: a checkpoint write or an eval never queues behind the other or a decode.
        self._decode_pool = pool(2, thread_name_prefix="decode")
        self._ckpt_pool = pool(1, thread_name_prefix="checkpoint")
        self._eval_pool = pool(1, thread_name_prefix="eval")

    def _begin_serving(self) -> None:
        if self.store is not None:
            persist.catch_up(self, self.store.claim())
        self._published = persist.resume_numbering(self)
        # Names this process's downlink steps: a learner's copy from another process (before a
        # restart) never gets a step, only values.
        self.epoch = secrets.token_hex(8)
        if self.cfg.compression.downlink != "none":
            for f in self.frags:
                f.publication = Publication(f.version, dict(f.params))
        self._publish_gauges()

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

    def _new_fragment(
        self, index: int, names: list[str], params: Mapping[str, np.ndarray]
    ) -> FragmentState:
        frag_params = {n: np.asarray(params[n], dtype=np.float32) for n in names}
        elements = sum(v.size for v in frag_params.values())
        # The largest legitimate push is the unquantized float32 fragment plus its header.
        max_body = 4 * elements + 1024 * len(names) + 65536
        return FragmentState(
            index, names, frag_params, self.outer.init(frag_params), max_body=max_body
        )

    # ---------------------------------------------------------------- checkpoints
    def snapshot(self) -> Snapshot:
        """References to the current state (taken on the loop thread; arrays are never mutated)."""
        return persist.snapshot(self)

    def _mark(self) -> tuple[int, ...]:
        """What a checkpoint must keep up with: versions, counters, joins (a push needs its
        attempt's join, so a clean restart must not forget one) and data leases."""
        steps, tokens = self.learners.totals()
        joins = sum(len(r.joined) for r in self.learners.records.values())
        roster = -1 if self.gate.roster is None else self.gate.roster.revision
        return self.outer_step, steps, tokens, joins, self.leases.revision, roster

    def failed(self, what: str, error: BaseException) -> None:
        """A component failed (health.py). Superseded: another syncer writes the checkpoint
        location now, so this one stands down (serve() stops, no final checkpoint)."""
        self.health.failed(what, error)
        if isinstance(error, Superseded) and self.superseded is None:
            self.superseded = error
            log.error("event=superseded what=%s action=stop_serving error=%r", what, str(error))
            if self.on_superseded is not None:
                self.on_superseded()

    async def save_checkpoint(self, force: bool = False) -> None:
        if self.store is None or self.superseded is not None:
            return
        async with self._save_lock:
            mark = self._mark()
            if not force and mark == self._saved_mark:
                return
            snap = self.snapshot()
            started = time.perf_counter()
            try:
                path = await asyncio.get_running_loop().run_in_executor(
                    self._ckpt_pool, self.store.save, snap
                )
            except Exception as exc:
                self.failed("checkpoint", exc)
                raise
            self.health.recovered("checkpoint")
            self._saved_mark = mark
            self.metrics.checkpoints.inc()
            log.info(
                "event=checkpoint_saved path=%s versions=%s seconds=%.3f",
                path,
                snap.versions,
                time.perf_counter() - started,
            )

    # ---------------------------------------------------------------- derived state
    @property
    def outer_step(self) -> int:
        return sum(f.version for f in self.frags)

    @property
    def complete(self) -> bool:
        steps, tokens = self.learners.totals()
        return (self.cfg.total_steps is not None and steps >= self.cfg.total_steps) or (
            self.cfg.total_tokens is not None and tokens >= self.cfg.total_tokens
        )

    @property
    def budget_done(self) -> float:
        """The share of the run's budget its learners have counted, in [0, 1]: what each
        learner's LR schedule keeps up with (`learner.train.ScheduleClock`)."""
        steps, tokens = self.learners.totals()
        shares = [0.0]
        if self.cfg.total_steps:
            shares.append(steps / self.cfg.total_steps)
        if self.cfg.total_tokens:
            shares.append(tokens / self.cfg.total_tokens)
        return min(1.0, max(shares))

    def versions(self) -> list[int]:
        return [f.version for f in self.frags]

    def _publish_gauges(self) -> None:
        self.metrics.outer_step.set(self.outer_step)
        for f in self.frags:
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
            fragments=tuple(FragmentStatus(f.index, f.version, f.last_merge) for f in self.frags),
            learners=self.learners.status(now, self.gate.quarantine.reason),
            bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent,
            health=self.health.status(),
            checkpoint=CheckpointStatus(tuple(self.store.skipped) if self.store else ()),
            roster_revision=self.gate.roster_revision,
        )

    # ---------------------------------------------------------------- push path
    def fragment(self, raw: str) -> FragmentState:
        index = parse_fragment_index(raw, len(self.frags))
        if index is None:
            raise Reject(
                404,
                "unknown_fragment",
                f"unknown fragment {raw!r}: this run has 0..{len(self.frags) - 1}",
            )
        return self.frags[index]

    async def accept_push(
        self, f: FragmentState, body: bytes, caller: str | None = None
    ) -> dict[str, Any]:
        """Decode, check and queue one push (`push.accept_push`). `caller`: the
        authenticated unit, which must be the payload's (None skips that check: in-process
        callers)."""
        return await push.accept_push(self, f, body, caller)

    # ---------------------------------------------------------------- merges (syncer_merge)
    def _merge_compute(
        self,
        params: dict[str, np.ndarray],
        state: Any,
        contributions: list[Contribution],
        share: float,
    ) -> tuple[dict[str, np.ndarray], Any]:
        """One outer step of a fragment (in the merge thread): `syncer_merge` runs the rounds,
        `warm_up` compiles it."""
        merge = self.cfg.merge
        return merge_and_step(
            self.outer, params, state, contributions, merge.method, merge.token_weighting, share
        )

    # ---------------------------------------------------------------- downloads
    async def fragment_payload(self, f: FragmentState, after: int = -1, epoch: str = "") -> bytes:
        """The fragment at its current version for a learner that holds version `after`
        published by `epoch`: the quantized step from there when the downlink has one, else the
        published values. Encoded once (off the loop) however many long-pollers wake up for it."""
        version, pub = f.version, f.publication
        step = (
            pub is not None
            and pub.step is not None
            and pub.version == version
            and after == version - 1
            and epoch == self.epoch
        )
        cached = f.encoded.get(step)
        if cached is None or cached[0] != version:
            if step:
                assert pub is not None and pub.step is not None
                job = functools.partial(
                    encode_step, pub.step, f.index, after, version, self.epoch, pub.checksum
                )
            else:
                job = functools.partial(
                    encode_params, f.published(), [version], f.index, self.epoch
                )
            future = asyncio.get_running_loop().run_in_executor(self._decode_pool, job)
            cached = f.encoded[step] = (version, asyncio.ensure_future(future))
        self.metrics.downloads.labels("step" if step else "values").inc()
        return await cached[1]

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
        for f in self.frags:
            zero = {name: np.zeros_like(value) for name, value in f.params.items()}
            self._merge_compute(f.params, f.opt_state, [Contribution(zero, 1, 1)], 1.0)
        self.warmed = True

    async def start_background(self, app: web.Application) -> None:
        # A standby warmed up while it waited: a take-over binds the port without a second
        # pass over every fragment.
        if not self.warmed:
            with phase(log, "compile"):
                await asyncio.get_running_loop().run_in_executor(self._merge_pool, self.warm_up)
        if self.store is not None:
            if self._saved_mark is None:  # a fresh run has a checkpoint from its first second
                try:
                    with phase(log, "first_checkpoint"):
                        await self.save_checkpoint()
                except Exception:
                    # A full or failing disk: serve anyway (readiness says so, health.py); the
                    # periodic save below writes it once it can. Exiting would not free the disk.
                    log.exception("event=checkpoint_failed when=start")
            self._background.append(
                asyncio.create_task(
                    self._every(
                        self.cfg.checkpoint.every_seconds, self.save_checkpoint, "checkpoint"
                    )
                )
            )
        if self.eval_fn is not None and self.cfg.eval.every_seconds is not None:
            self._background.append(
                asyncio.create_task(self._every(self.cfg.eval.every_seconds, self.run_eval, "eval"))
            )
        self.check_complete()

    async def wake_pollers(self, app: web.Application) -> None:
        """On shutdown: answer every open long-poll (204) so the server can stop at once."""
        self.closing = True
        for f in self.frags:
            f.changed.set()

    async def stop_background(self, app: web.Application) -> None:
        for task in self._background:
            task.cancel()
        for f in self.frags:
            if f.merge_task is not None:
                f.merge_task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        await self.save_checkpoint(force=False)

    def close(self) -> None:
        self._merge_pool.shutdown(wait=True)
        self._decode_pool.shutdown(wait=True)
        self._ckpt_pool.shutdown(wait=True)
        self._eval_pool.shutdown(wait=False, cancel_futures=True)
        self._journal_pool.shutdown(wait=True)
