"""Suspension and queueing: neither is a failure.

Two things stop a unit without anything having gone wrong, and neither spends `maxUnitRestarts`,
grows the crash-loop count or marks a unit Failed:

- **The run is suspended** (`spec.suspend`): every unit goes to state Suspended and the syncer is
  scaled to zero. A unit's Job is suspended in place (its pods go, the Job stays); a unit whose
  Job is queued through Kueue (labelled with a queue) is deleted instead, because Kueue resumes a
  suspended Job whose Workload is still admitted, and deleting it gives the quota back. On resume
  a suspended Job is unsuspended (same attempt); a deleted one is created again (attempt + 1,
  counted neither as a restart nor as a preemption). Learners rejoin with the syncer's global
  parameters, which it restores from its checkpoint when it comes back.
- **A queue holds the unit** (a Job labelled with a queue, suspended by Kueue: not yet admitted,
  or evicted/preempted later): state Queued. The operator leaves such a Job alone (no restart,
  no recreation, no delete); when Kueue admits it again, its new pods run and rejoin.
"""

from __future__ import annotations

from diloco_operator.api import UnitStatus
from diloco_operator.planner.model import (
    Action,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    ScaleSyncer,
    SuspendUnit,
    gone,
)
from diloco_operator.planner.placement import UnitSlot
from diloco_operator.planner.timefmt import at

QUEUED = "Queued"
SUSPENDED = "Suspended"
RUN_SUSPENDED = "RunSuspended"

Step = tuple[UnitStatus, list[Action], float | None]


def _enter(unit: UnitStatus, state: str, now: float) -> UnitStatus:
    if unit.state == state:
        return unit
    return unit.model_copy(update={"state": state, "since": at(now)})


def suspend(unit: UnitStatus, obs: ObservedUnit | None, now: float) -> Step:
    """The run is suspended: stop a live, queued or suspended unit; count nothing."""
    actions: list[Action] = []
    if unit.state != SUSPENDED:
        message = f"{unit.name}: the run is suspended (attempt {unit.attempt} kept)"
        actions.append(EmitEvent("Normal", "UnitSuspended", message, unit.name))
    wait = None
    if obs is not None and obs.phase == "Terminating":
        wait = 1.0
    elif not gone(obs):
        assert obs is not None
        if obs.queue:
            actions.append(DeleteUnit(unit.name, RUN_SUSPENDED))
        elif obs.phase != "Suspended":
            actions.append(SuspendUnit(unit.name, True))
    return _enter(unit, SUSPENDED, now), actions, wait


def resume(unit: UnitStatus, obs: ObservedUnit | None, create: CreateUnit, now: float) -> Step:
    """The run is no longer suspended: unsuspend the unit's Job, or create it again when it was
    deleted (or never created); `create` is the creation at attempt + 1."""
    if obs is not None and obs.phase == "Terminating":
        return unit, [], 1.0
    event = EmitEvent("Normal", "UnitResumed", f"{unit.name}: the run resumed", unit.name)
    if gone(obs):
        update = {"state": "Pending", "attempt": create.attempt, "since": at(now)}
        return unit.model_copy(update=update), [create, event], None
    assert obs is not None
    if obs.queue and obs.phase == "Suspended":
        return _enter(unit, QUEUED, now), [event], None  # Kueue decides when it runs
    actions: list[Action] = [event]
    if obs.phase == "Suspended":
        actions.insert(0, SuspendUnit(unit.name, False))
    return _enter(unit, "Pending", now), actions, None


def held(unit: UnitStatus, obs: ObservedUnit, now: float) -> Step:
    """A live unit whose Job is suspended while the run is not: a queue holds it (Queued), or,
    with no queue, the operator owns the Job's suspension and resumes it."""
    if not obs.queue:
        return unit, [SuspendUnit(unit.name, False)], 1.0
    if unit.state == QUEUED:
        return unit, [], None
    message = (
        f"{unit.name} attempt {unit.attempt} waits for admission by queue {obs.queue} "
        f"(not a failure: nothing is counted)"
    )
    return _enter(unit, QUEUED, now), [EmitEvent("Normal", "UnitQueued", message, unit.name)], None


def admitted(unit: UnitStatus, obs: ObservedUnit, now: float) -> Step:
    """A Queued unit whose Job runs again: its queue admitted it."""
    message = f"{unit.name} attempt {unit.attempt} admitted by queue {obs.queue or '(none)'}"
    return (
        _enter(unit, "Pending", now),
        [EmitEvent("Normal", "UnitAdmitted", message, unit.name)],
        None,
    )


def syncer_actions(suspended: bool, syncer: ObservedSyncer) -> list[Action]:
    """Scale the syncer to zero while the run is suspended and back to one after."""
    if not syncer.present or syncer.replicas is None:
        return []
    want = 0 if suspended else 1
    return [] if syncer.replicas == want else [ScaleSyncer(want)]


def new_slot_state(suspended: bool) -> str:
    return SUSPENDED if suspended else "Pending"


def creation(slot: UnitSlot, attempt: int, num_units: int) -> CreateUnit:
    return CreateUnit(
        slot.name, slot.group, slot.index, slot.global_index, attempt, num_units, slot.hosts
    )
