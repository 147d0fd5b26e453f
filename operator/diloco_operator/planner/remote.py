"""Remote-group policy: units of a group that runs in another cluster. The home run neither
creates nor watches them; it knows them only as the syncer hears them, so their state follows
their heartbeats alone: Pending until first heard, Online while heard within
`offlineAfterSeconds`, Offline after that (a cut link, a dead cluster, or units being
recreated there). Their own cluster's operator recreates them; here nothing is acted on but an
Event on each change."""

from __future__ import annotations

from collections.abc import Sequence

from diloco_trainer.status import LearnerStatus, SyncerStatus

from diloco_operator.api import UnitState, UnitStatus
from diloco_operator.planner.model import Action, EmitEvent
from diloco_operator.planner.placement import UnitSlot
from diloco_operator.planner.timefmt import at


def heard_state(learner: LearnerStatus | None, offline_after: float) -> UnitState:
    """What a remote unit's last sign of life at the syncer says about it."""
    if learner is None or learner.age_seconds is None:
        return "Pending"
    return "Online" if learner.age_seconds <= offline_after else "Offline"


def remote_units(
    slots: Sequence[UnitSlot],
    previous: dict[str, UnitStatus],
    report: SyncerStatus | None,
    offline_after: float,
    now: float,
) -> tuple[list[UnitStatus], list[Action]]:
    """The status of each remote unit, and an Event for each that changed state. Without a
    report (the syncer unreachable from here) every unit keeps its last state: this cluster
    cannot tell a cut link to the syncer from a dead remote cluster."""
    units: list[UnitStatus] = []
    actions: list[Action] = []
    for slot in slots:
        before = previous.get(slot.name)
        if report is None and before is not None:
            units.append(before)
            continue
        learner = report.learners.get(slot.name) if report is not None else None
        state = heard_state(learner, offline_after)
        attempt = learner.attempt if learner is not None else 0
        if before is not None and before.state == state and before.attempt == attempt:
            units.append(before)
            continue
        units.append(
            UnitStatus(
                name=slot.name,
                group=slot.group,
                index=slot.index,
                global_index=slot.global_index,
                state=state,
                attempt=attempt,
                remote=True,
                since=at(now) if before is None or before.state != state else before.since,
            )
        )
        if before is not None and before.state != state:
            actions.append(_event(slot.name, state, attempt, learner))
    return units, actions


def _event(unit: str, state: UnitState, attempt: int, learner: LearnerStatus | None) -> Action:
    if state == "Online":
        return EmitEvent("Normal", "RemoteUnitOnline", f"{unit} attempt {attempt} heard", unit)
    age = learner.age_seconds if learner is not None else None
    silent = f"not heard for {age:.0f}s" if age is not None else "never heard"
    return EmitEvent("Warning", "RemoteUnitOffline", f"{unit} (another cluster) {silent}", unit)
