"""Completion policy: the run's phase from its units and the syncer's report.

Succeeded when the syncer reports its budget reached (or every unit exited successfully);
Failed when fewer units are left than the merge quorum K (nothing could ever merge again);
terminal phases stick. Otherwise Suspended (spec.suspend), Degraded (some unit Offline,
Recreating or given up), Queued (no unit Online, some held by their queue), Pending (no unit
Online yet) or Running.
"""

from __future__ import annotations

from collections.abc import Sequence

from diloco_trainer.status import SyncerStatus

from diloco_operator.api import RunPhase, UnitStatus

TERMINAL: tuple[RunPhase, ...] = ("Succeeded", "Failed")
TROUBLED = ("Offline", "Recreating", "Failed")


def run_phase(
    previous: RunPhase,
    units: Sequence[UnitStatus],
    report: SyncerStatus | None,
    quorum: int,
    suspended: bool = False,
) -> tuple[RunPhase, str]:
    """The phase and a one-line reason for it."""
    if previous in TERMINAL:
        return previous, "terminal"
    if report is not None and report.complete:
        return "Succeeded", "the syncer reports the training budget reached"
    active = [u for u in units if u.state != "Removing"]
    if suspended:
        stopped = sum(u.state == "Suspended" for u in active)
        return "Suspended", f"spec.suspend: {stopped}/{len(active)} units suspended, syncer at 0"
    if active and all(u.state == "Completed" for u in active):
        return "Succeeded", "every unit finished its training"
    alive = [u for u in active if u.state != "Failed"]
    if len(alive) < quorum:
        return (
            "Failed",
            f"{len(alive)} units left alive, fewer than the quorum {quorum}: no merge can happen",
        )
    online = sum(u.state == "Online" for u in active)
    if any(u.state in TROUBLED for u in active):
        return "Degraded", f"{online}/{len(active)} units online"
    queued = sum(u.state == "Queued" for u in active)
    if online == 0 and queued:
        return "Queued", f"{queued}/{len(active)} units wait for admission by their queue"
    if online == 0:
        return "Pending", "waiting for units to come online"
    return "Running", f"{online}/{len(active)} units online"
