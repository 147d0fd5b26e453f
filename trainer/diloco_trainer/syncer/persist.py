"""Checkpoint side of the syncer: snapshot, restore and version renumbering after a crash."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.phases import phase
from diloco_trainer.syncer.checkpoint import LEASE_JOURNAL, Snapshot
from diloco_trainer.syncer.data_leases import LeaseBook
from diloco_trainer.syncer.fragment import FragmentState, PushKey, l2_norm
from diloco_trainer.syncer.health import retry_delay
from diloco_trainer.syncer.journal import (
    fits,
    fragment_index,
    merged_from_json,
    merged_to_json,
)
from diloco_trainer.syncer.roster import Roster

if TYPE_CHECKING:
    from diloco_trainer.syncer.state import SyncerState

log = logging.getLogger("diloco.syncer")


def restore(s: SyncerState, snap: Snapshot) -> None:
    with phase(log, "restore", seq=snap.seq):
        _restore(s, snap)


def _restore(s: SyncerState, snap: Snapshot) -> None:
    layout = [f.names for f in s.frags]
    if snap.layout != layout:
        raise ValueError(
            "checkpoint layout differs from this config's fragments/model; "
            "use a fresh checkpoint.path for a changed model"
        )
    for f in s.held:
        for n in f.names:
            if n not in snap.params or tuple(snap.params[n].shape) != s.shapes[n]:
                raise ValueError(f"checkpoint leaf {n}: missing or wrong shape")
        f.params = {n: snap.params[n].astype(np.float32) for n in f.names}
        f.opt_state = s.outer.state_from_leaves(f.params, snap.outer_state[f.index])
        f.version = snap.versions[f.index]
        f.last_merge = (snap.extra.get("lastMerge") or [None] * len(s.frags))[f.index]
        merged = snap.extra.get("mergedPushes")
        if isinstance(merged, list) and len(merged) == len(s.frags):
            remember_merged(f, merged_from_json(merged[f.index]))
    restore_run_state(s, snap.learners, snap.extra)
    s.saved_mark = s.mark()
    s.restored_seq = snap.seq
    log.info(
        "event=restored seq=%d versions=%s outer_step=%d",
        snap.seq,
        snap.versions,
        s.outer_step,
    )


def restore_run_state(s: SyncerState, learners: dict[str, Any], extra: dict[str, Any]) -> None:
    """What a checkpoint holds besides the fragments: learner counters, data leases (the
    journal's when newer), evaluations."""
    s.learners.load_json(learners, now=time.time())
    # Absent from checkpoints older than data leases: a fresh book.
    s.leases = LeaseBook.from_json(extra.get("dataLeases"), s.cfg.data.shards)
    adopt_journaled_leases(s)
    s.eval_loss = extra.get("evalLoss")
    s.final_loss = extra.get("finalLoss")
    s.gate.quarantine.load_json(extra.get("quarantined"))
    if extra.get("roster") is not None:  # absent from checkpoints that predate it
        try:
            s.gate.take_roster(Roster.from_json(extra["roster"], "checkpoint roster"))
        except ValueError as exc:
            log.error("event=checkpoint_roster_dropped reason=%r", str(exc))


def take_over_run_state(s: SyncerState) -> None:
    """A standby's run state from the newest checkpoint's manifest (the fragments come from the
    journal, so the tensors are not read again), or from the lease journal alone."""
    manifest = s.store.newest_manifest(after=s.restored_seq) if s.store is not None else None
    if manifest is not None:
        restore_run_state(
            s, dict(manifest.get("learners") or {}), dict(manifest.get("extra") or {})
        )
        s.restored_seq = int(manifest["seq"])
        log.info("event=run_state_taken_over seq=%d", s.restored_seq)
    else:
        adopt_journaled_leases(s)


def adopt_journaled_leases(s: SyncerState) -> None:
    """The lease journal's book where it is newer than `s`'s (it holds the assignments made
    since the checkpoint)."""
    journal = s.store.recorded_leases() if s.store is not None else None
    if journal is not None:
        s.leases = s.leases.newest(LeaseBook.from_json(journal, s.cfg.data.shards))


def catch_up(s: SyncerState, changed: list[str]) -> None:
    """Read again the journal files that changed between this process's reading them and its
    claim of the checkpoint location (the syncer it takes over from wrote them meanwhile)."""
    if changed:
        log.info("event=claimed_after_changes files=%s", ",".join(changed))
    indices = {i for i in map(fragment_index, changed) if i is not None}
    if indices:
        replay_journal(s, only=indices)
    if LEASE_JOURNAL in changed:
        adopt_journaled_leases(s)


def replay_journal(
    s: SyncerState,
    level: int = logging.INFO,
    only: set[int] | None = None,
    *,
    at_start: bool = False,
) -> list[int]:
    """Install each fragment's journaled version (of the fragments `only` names, if given)
    where it is newer than what `s` holds (the checkpoint's, or a standby's earlier catch-up).
    Returns the fragments installed. `at_start`: logged as the start-up phase `journal_replay`
    (not a standby's routine following)."""
    with phase(log, "journal_replay") if at_start else contextlib.nullcontext():
        return _replay_journal(s, level, only)


def _replay_journal(s: SyncerState, level: int, only: set[int] | None) -> list[int]:
    if s.store is None:
        return []
    installed = []
    for f in s.held:
        if only is not None and f.index not in only:
            continue
        entry = s.store.recorded_fragment(f.index)
        if entry is None or entry.version <= f.version:
            continue
        problem = fits(entry, {n: s.shapes[n] for n in f.names})
        if problem is not None:
            log.warning("event=fragment_journal_ignored fragment=%d reason=%r", f.index, problem)
            continue
        params = {n: entry.params[n].astype(np.float32) for n in f.names}
        f.opt_state = s.outer.state_from_leaves(params, entry.outer_leaves)
        f.params, f.version, f.last_merge = params, entry.version, entry.last_merge
        f.norm = l2_norm(params)
        remember_merged(f, entry.merged)
        installed.append(f.index)
    if installed:
        log.log(level, "event=journal_replayed fragments=%s versions=%s", installed, s.versions())
    return installed


def remember_merged(f: FragmentState, merged: dict[PushKey, int]) -> None:
    """The pushes a restored version holds: a replay of one is a duplicate, never merged."""
    f.merged = dict(merged)
    for key, version in merged.items():
        f.seen[key] = version


def resume_numbering(s: SyncerState) -> list[int]:
    """Versions published before a crash but not checkpointed are lost; their numbers are not
    reused. A fragment whose journal is ahead resumes at journal+1, so every learner sees a
    strictly newer version (carrying the restored content) and installs it."""
    versions = s.versions()
    journal = s.store.recorded_versions() if s.store is not None else None
    if journal is not None and len(journal) == len(versions):
        for f in s.held:
            if journal[f.index] > f.version:
                log.warning(
                    "event=versions_lost fragment=%d checkpointed=%d published=%d resume=%d",
                    f.index,
                    f.version,
                    journal[f.index],
                    journal[f.index] + 1,
                )
                f.version = journal[f.index] + 1
        versions = s.versions()
    if s.store is not None:
        _record_versions_until_written(s, versions)
    return versions


def _record_versions_until_written(s: SyncerState, versions: list[int]) -> None:
    """Journal the versions about to be served, retrying with backoff while the disk refuses
    (full, failing). They must be durable before they are served (a later restart must not
    reuse their numbers), but exiting would not free the disk: a standby that took over, or a
    restarted syncer, would die and be restarted cold over and over until it did."""
    assert s.store is not None
    failures = 0
    while True:
        try:
            s.store.record_versions(versions)
            return
        except OSError as exc:
            failures += 1
            delay = retry_delay(failures)
            log.warning(
                "event=version_journal_failed failures=%d retry_in=%.1f error=%r",
                failures,
                delay,
                str(exc),
            )
            time.sleep(delay)


def config_hash(cfg: TrainingConfig) -> str:
    """A short digest of the training block: tells which config a checkpoint (or an export)
    was made under."""
    wire = json.dumps(cfg.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(wire.encode()).hexdigest()[:16]


def snapshot(s: SyncerState) -> Snapshot:
    """References to the current state (taken on the loop thread; arrays are never mutated)."""
    params = s.global_params()
    return Snapshot(
        params=params,
        outer_state=[OuterOptimizer.state_leaves(f.opt_state) for f in s.frags],
        versions=[f.version for f in s.frags],
        layout=[f.names for f in s.frags],
        outer_step=s.outer_step,
        learners=s.learners.to_json(),
        extra={
            "run": s.run,
            "configHash": config_hash(s.cfg),
            "evalLoss": s.eval_loss,
            "finalLoss": s.final_loss,
            "lastMerge": [f.last_merge for f in s.frags],
            "mergedPushes": [merged_to_json(f.merged) for f in s.frags],
            "dataLeases": s.leases.to_json(),
            "roster": None if s.gate.roster is None else s.gate.roster.to_json(),
            "quarantined": s.gate.quarantine.to_json(),
        },
    )


async def save_checkpoint(s: SyncerState, force: bool = False) -> None:
    """Write a checkpoint (in the checkpoint thread) unless nothing it keeps changed since the
    last one (`force`: write anyway), or another syncer has the location now."""
    if s.store is None or s.superseded is not None:
        return
    async with s.save_lock:
        mark = s.mark()
        if not force and mark == s.saved_mark:
            return
        snap = snapshot(s)
        started = time.perf_counter()
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                s.pools.checkpoint, s.store.save, snap
            )
        except Exception as exc:
            s.failed("checkpoint", exc)
            raise
        s.health.recovered("checkpoint")
        s.saved_mark = mark
        s.metrics.checkpoints.inc()
        log.info(
            "event=checkpoint_saved path=%s versions=%s seconds=%.3f",
            path,
            snap.versions,
            time.perf_counter() - started,
        )
