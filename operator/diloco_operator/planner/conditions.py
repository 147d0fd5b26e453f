"""Kubernetes condition conventions: one entry per type; lastTransitionTime changes only when
the status flips, so rerunning a pass with the same facts rewrites nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from diloco_operator.api import Condition, UnitStatus
from diloco_operator.planner.timefmt import at


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: float,
    generation: int | None,
) -> list[Condition]:
    value: Literal["True", "False"] = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    moment = old.last_transition_time if old is not None and old.status == value else at(now)
    new = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=moment,
        observed_generation=generation,
    )
    return [c for c in conditions if c.type != type_] + [new]


def queue_conditions(
    conditions: list[Condition],
    suspended: bool,
    units: Sequence[UnitStatus],
    now: float,
    generation: int | None,
) -> list[Condition]:
    """Suspended (spec.suspend) and Queued (units held by their queue): written once they first
    apply, so a run that never uses either carries no extra conditions."""
    have = {c.type for c in conditions}
    if suspended or "Suspended" in have:
        reason = "RunSuspended" if suspended else "RunActive"
        message = "spec.suspend is true: units and syncer stopped" if suspended else ""
        conditions = set_condition(
            conditions, "Suspended", suspended, reason, message, now, generation
        )
    queued = [u.name for u in units if u.state == "Queued"]
    if queued or "Queued" in have:
        reason = "UnitsQueued" if queued else "AllUnitsAdmitted"
        message = f"{len(queued)} units wait for admission: {', '.join(queued[:10])}"
        conditions = set_condition(
            conditions, "Queued", bool(queued), reason, message if queued else "", now, generation
        )
    return conditions
