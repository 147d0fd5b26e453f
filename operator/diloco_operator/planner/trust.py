"""Trust policy: what the syncer says of a unit's claims becomes status, Events and recreation.

The syncer refuses heartbeats and pushes whose counters no honest unit could send, and
quarantines an attempt whose pushes are outliers again and again (the trainer's
syncer/trust.py, robust.py, quarantine.py). The planner mirrors the refusal count in the unit's
status (`claimsRefused`) with a Warning Event each time it grows, and treats a quarantined
current attempt as a failure: the unit goes Offline (reason Quarantined) and is recreated, and
its next attempt starts clean, counted against maxUnitRestarts like any failure.
"""

from __future__ import annotations

from diloco_trainer.status import SyncerStatus

from diloco_operator.api.status import UnitStatus
from diloco_operator.planner.failure import Signal
from diloco_operator.planner.model import QUARANTINED, Action, EmitEvent


def quarantine_signal(unit: UnitStatus, report: SyncerStatus | None) -> Signal | None:
    """Quarantined when the syncer says so of this unit's current attempt."""
    learner = report.learners.get(unit.name) if report is not None else None
    if learner is None or learner.quarantined is None or learner.attempt != unit.attempt:
        return None
    return Signal(
        QUARANTINED, f"the syncer quarantined attempt {unit.attempt}: {learner.quarantined}"
    )


def note_refusals(unit: UnitStatus, report: SyncerStatus | None) -> tuple[UnitStatus, list[Action]]:
    """The unit with the syncer's count of its refused claims, and a Warning Event when it grew
    (a restarted syncer counts from its checkpoint, so a smaller count is only copied)."""
    learner = report.learners.get(unit.name) if report is not None else None
    if learner is None or learner.refused == unit.claims_refused:
        return unit, []
    updated = unit.model_copy(update={"claims_refused": learner.refused})
    if learner.refused < unit.claims_refused:
        return updated, []
    new = learner.refused - unit.claims_refused
    message = (
        f"{unit.name}: {new} heartbeat(s) or push(es) refused as impossible "
        f"({learner.refused} in all); the last: {learner.last_refusal or 'n/a'}"
    )
    return updated, [EmitEvent("Warning", "UnitClaimRefused", message, unit.name)]
