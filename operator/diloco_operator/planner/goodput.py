"""Per-unit goodput on a cluster, accounted pass by pass from the syncer's reports (pure).

The definition is the local report's (local/report.py): a unit's seconds count from its first
heartbeat interval in which its step advanced; a second is useful when it lies between two
consecutive heartbeats of the same attempt whose step advanced. Useful spans are differences of
the syncer's heartbeat times; total time is the operator's clock between passes, counted while the
unit holds or waits for its slot (Pending, Online, Offline, Recreating) and not once it is
Completed, Failed or being removed. The operator sees only the latest heartbeat of each report, so
when several heartbeats fall between two passes their intervals are judged together.
"""

from __future__ import annotations

from diloco_trainer.attempts import wire_attempt
from diloco_trainer.status import LearnerStatus

from diloco_operator.api import UnitStatus
from diloco_operator.api.unit_goodput import UnitGoodput
from diloco_operator.planner.timefmt import at

COUNTED_STATES = ("Pending", "Online", "Offline", "Recreating")


def useful_share(useful: float, total: float) -> float:
    # Heartbeat times (the syncer's clock) and pass times (the operator's) can disagree by a
    # little: never report more than all of it.
    return min(1.0, useful / total) if total > 0 else 0.0


def account(unit: UnitStatus, learner: LearnerStatus | None, now: float) -> UnitStatus:
    """`unit` with its goodput advanced to `now`, given the syncer's latest view of it."""
    if unit.state not in COUNTED_STATES:
        return unit
    prev = unit.goodput or UnitGoodput()
    useful, total = prev.useful_seconds, prev.total_seconds
    counted_until = prev.counted_until
    if counted_until is not None:
        total += max(0.0, now - counted_until.timestamp())
        counted_until = at(now)
    last = (prev.last_attempt, prev.last_step, prev.last_heartbeat)
    # The learner process, not only its pod: a restart in place is a gap too, not useful time.
    process = wire_attempt(learner.attempt, learner.restarts_in_place) if learner else None
    beat = learner.last_heartbeat if learner is not None else None
    step = learner.step if learner is not None else None
    new_beat = beat is not None and (prev.last_heartbeat is None or beat > prev.last_heartbeat)
    if learner is not None and beat is not None and step is not None and new_beat:
        if (
            prev.last_heartbeat is not None
            and prev.last_step is not None
            and process == prev.last_attempt
            and step > prev.last_step
        ):
            span = beat - prev.last_heartbeat
            useful += span
            if counted_until is None:  # it trains from the start of this interval
                total += span
                counted_until = at(now)
        last = (process, step, beat)
    if last == (None, None, None):
        return unit  # not heard from yet: nothing to account
    goodput = UnitGoodput(
        useful_seconds=round(useful, 3),
        total_seconds=round(total, 3),
        ratio=round(useful_share(useful, total), 4),
        last_attempt=last[0],
        last_step=last[1],
        last_heartbeat=last[2],
        counted_until=counted_until,
    )
    return unit.model_copy(update={"goodput": goodput})
