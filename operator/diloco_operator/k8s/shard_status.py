"""A sharded syncer as one syncer to the planner, and shard by shard in the run's status.

The planner takes one `SyncerStatus` (its interface is the local runtime's too); here the shards'
documents become that one with `diloco_trainer.status.gathered`, shard 0 first: the run-level
parts (learners, evaluations, completion, roster) are shard 0's, fragments and outer step add up.

A shard that does not answer is a fault domain of its own: the learners go on pushing the other
shards' fragments and merging with them, so the run keeps its phase. What changes: its
fragments are unknown this pass (the run's outerStep keeps its last value rather than falling
back to a partial sum), `status.syncerShards[i]` says it does not answer and why, the condition
`SyncerShards` names it, and a Warning Event `SyncerShardDown` marks the moment it stopped
(`SyncerShardBack` when it answers again). Without shard 0 there is no report at all, as for
an unsharded syncer that does not answer: the run-level parts are its alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import kopf
from diloco_trainer.status import SyncerStatus, gathered

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.status import FragmentVersion, SyncerShardStatus
from diloco_operator.k8s.run_ref import Run
from diloco_operator.k8s.syncer_calls import ShardRead
from diloco_operator.k8s.syncer_shards import SyncerDeployment
from diloco_operator.planner.conditions import set_condition
from diloco_operator.planner.timefmt import at

log = logging.getLogger("diloco_operator")

CONDITION = "SyncerShards"


def gathered_report(run: Run, reads: Sequence[ShardRead]) -> SyncerStatus | None:
    """The run's one syncer report from its shards' reads (shard 0 first); None without
    shard 0's. While a shard is silent its fragments are missing from the sum: outer step and
    bytes are left unknown (the planner keeps the last values) rather than seen to fall."""
    if not reads or reads[0].report is None:
        return None
    answered = [r.report for r in reads if r.report is not None]
    report = gathered(answered)
    if run.shards > 1 and len(answered) < run.shards:
        report = replace(report, outer_step=None, bytes_received=None, bytes_sent=None)
    return report


def shard_entries(
    run: Run,
    deployments: Sequence[SyncerDeployment],
    reads: Sequence[ShardRead],
    before: Sequence[SyncerShardStatus],
    now: float,
) -> list[SyncerShardStatus]:
    """`status.syncerShards`: each shard as read this pass; a silent shard keeps the fragments
    and outer step it last reported, with the reason it is silent."""
    ready = {d.shard: d.ready for d in deployments}
    read_of = {r.shard: r for r in reads}
    old = {s.index: s for s in before}
    entries = []
    for shard in range(run.shards):
        read, prev = read_of.get(shard), old.get(shard)
        report = read.report if read is not None else None
        answering = report is not None
        since = prev.since if prev is not None and prev.answering == answering else at(now)
        if report is not None:
            step, message = report.outer_step, None
            frags = [FragmentVersion(index=f.index, version=f.version) for f in report.fragments]
        else:
            step, message = (prev.outer_step if prev is not None else None), _why(read)
            frags = list(prev.fragments) if prev is not None else []
        entries.append(
            SyncerShardStatus(
                index=shard,
                name=run.shard_name(shard),
                ready=ready.get(shard, False),
                answering=answering,
                since=since,
                outer_step=step,
                fragments=frags,
                message=message,
            )
        )
    return entries


def _why(read: ShardRead | None) -> str:
    if read is None:
        return "not read: its Deployment is missing or scaled to zero"
    return f"{read.url}: {read.error}"[:1024]


def report_shards(
    run: Run,
    status: DilocoRunStatus,
    before: DilocoRunStatus | None,
    deployments: Sequence[SyncerDeployment],
    reads: Sequence[ShardRead],
    body: Any,
    generation: int | None,
    now: float,
) -> DilocoRunStatus:
    """The shards in the run's status (`syncerShards` and the SyncerShards condition) and an
    Event when one stops or starts answering. A run of one shard is returned unchanged."""
    if run.shards == 1:
        return status
    prev = (before.syncer_shards if before is not None else None) or []
    entries = shard_entries(run, deployments, reads, prev, now)
    silent = [e for e in entries if not e.answering]
    if run.spec.suspend:
        ok, reason, message = False, "RunSuspended", "every shard is scaled to zero"
    elif silent:
        ok, reason = False, "ShardsNotAnswering"
        message = "; ".join(f"shard {e.index} ({e.name}) {e.message}" for e in silent)
    else:
        ok, reason, message = True, "AllShardsAnswering", f"{run.shards} shards answering"
    conditions = set_condition(
        list(status.conditions), CONDITION, ok, reason, message[:1024], now, generation
    )
    conditions.sort(key=lambda c: c.type)
    if not run.spec.suspend:
        _post_changes(run, body, prev, entries)
    return status.model_copy(update={"conditions": conditions, "syncer_shards": entries})


def _post_changes(
    run: Run, body: Any, before: Sequence[SyncerShardStatus], now: Sequence[SyncerShardStatus]
) -> None:
    """A Warning when a shard that answered stops, a Normal when one that had answered and
    stopped answers again (a shard still starting says nothing: it never answered)."""
    old = {s.index: s for s in before}
    for entry in now:
        prev = old.get(entry.index)
        if prev is None or prev.answering == entry.answering:
            continue
        if not entry.answering:
            kind, reason = "Warning", "SyncerShardDown"
            message = (
                f"syncer shard {entry.index} ({entry.name}) stopped answering: {entry.message}; "
                "training goes on with the other shards' fragments"
            )
        elif prev.outer_step is not None:
            kind, reason = "Normal", "SyncerShardBack"
            message = f"syncer shard {entry.index} ({entry.name}) answers again"
        else:
            continue
        kopf.event(body, type=kind, reason=reason, message=message[:1024])
        log.log(
            logging.WARNING if kind == "Warning" else logging.INFO,
            "event run=%s reason=%s message=%s",
            run.name,
            reason,
            message,
        )
