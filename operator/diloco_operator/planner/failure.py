"""Failure policy: failure signals turn a unit Offline; the whole unit is deleted, and once it is
gone and its restart delay has passed it is recreated with attempt+1. A unit whose restart budget
is spent is given up (Failed) instead.

The restart delay works like a Kubernetes crash-loop backoff. A unit that had run healthily (Online
for `healthyAfterSeconds` and, when the syncer reports it, past step 0) before it failed is
recreated at once: a preempted slice or a killed process says nothing about the next attempt, and
every second waited is a unit's worth of lost training. A failure that comes before that (a crash
while starting or compiling) is a *quick failure*: the first waits `restartBackoffSeconds`, each
further one in a row doubles it, up to `maxRestartBackoffSeconds`; a healthy run clears the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diloco_trainer.status import SyncerStatus

from diloco_operator.api import FailurePolicy, UnitFailure, UnitStatus
from diloco_operator.planner.model import (
    HEARTBEAT_STALE,
    POD_FAILED,
    UNIT_DELETED,
    Action,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedUnit,
    gone,
)
from diloco_operator.planner.placement import UnitSlot
from diloco_operator.planner.preemption import (
    PREEMPTED,
    is_preempted,
    preemption_message,
    recreation_counts,
)
from diloco_operator.planner.timefmt import at, seconds_since


@dataclass(frozen=True)
class Signal:
    reason: str
    message: str


def heartbeats_trusted(report: SyncerStatus | None, policy: FailurePolicy) -> bool:
    """Whether stale heartbeats can be blamed on the units. When two or more learners are all
    stale at once, the likelier culprit is the syncer (just restarted from a checkpoint, or cut
    off): restarting every unit would only stop the run, so staleness is ignored then."""
    if report is None or not report.learners:
        return False
    ages = [entry.age_seconds or 0.0 for entry in report.learners.values()]
    return len(ages) < 2 or min(ages) <= policy.offline_after_seconds


# Seconds a just-created unit may be absent from the operator's watch cache before it counts as
# deleted: the create returns before the watch delivers the new Job (CI once saw a pass 32 ms
# after the create miss it, delete the unit and recreate it as attempt 1).
CACHE_LAG_SECONDS = 15.0


def not_yet_seen(unit: UnitStatus, obs: ObservedUnit | None, now: float) -> bool:
    """Whether a unit missing from the observation was only just created (Pending, Queued or
    Recreating for under CACHE_LAG_SECONDS): wait for the cache instead of calling it gone."""
    created = unit.state in ("Pending", "Queued", "Recreating")
    return gone(obs) and created and seconds_since(unit.since, now) < CACHE_LAG_SECONDS


def failure_signal(
    obs: ObservedUnit | None,
    unit: UnitStatus,
    report: SyncerStatus | None,
    policy: FailurePolicy,
    now: float | None = None,
) -> Signal | None:
    """The failure signal of a live unit (Pending/Recreating/Online), or None when healthy.
    `now` bounds a heartbeat's age by the unit's time Online (None: not bounded)."""
    if obs is None or obs.phase == "Missing":
        return Signal(UNIT_DELETED, f"unit {unit.name} attempt {unit.attempt} disappeared")
    if obs.phase == "Terminating":
        return Signal(UNIT_DELETED, f"unit {unit.name} is being deleted by someone else")
    preempted = preemption_message(obs)
    if preempted is not None:
        return Signal(PREEMPTED, preempted)
    if obs.failure:
        return Signal(obs.failure, obs.message or f"unit {unit.name}: {obs.failure}")
    if obs.phase == "Failed":
        return Signal(POD_FAILED, obs.message or f"unit {unit.name} failed")
    trusted = heartbeats_trusted(report, policy)
    learner = report.learners.get(unit.name) if report and trusted else None
    age = (learner.age_seconds or 0.0) if learner is not None else 0.0
    # A heartbeat older than the unit's time Online belongs to before it came Online (a Job
    # suspended by its queue and resumed keeps its attempt): give the new pods the full period.
    if unit.since is not None and now is not None:
        age = min(age, seconds_since(unit.since, now))
    if (
        unit.state == "Online"
        and learner is not None
        and learner.attempt == unit.attempt
        and age > policy.offline_after_seconds
    ):
        return Signal(
            HEARTBEAT_STALE,
            f"last heartbeat {age:.1f}s ago (offlineAfterSeconds={policy.offline_after_seconds:g})",
        )
    return None


def ran_healthily(
    unit: UnitStatus, report: SyncerStatus | None, policy: FailurePolicy, now: float
) -> bool:
    """Whether the failing attempt had run healthily: Online for at least healthyAfterSeconds,
    and past step 0 when the syncer still reports this attempt (a unit that heartbeats at join
    and then dies compiling never made progress, however long the compile took)."""
    if unit.state != "Online" or seconds_since(unit.since, now) < policy.healthy_after_seconds:
        return False
    learner = report.learners.get(unit.name) if report is not None else None
    if learner is None or learner.attempt != unit.attempt or learner.step is None:
        return True  # nothing says otherwise (e.g. the syncer restarted and forgot it)
    return learner.step > 0


def fault_targets(
    units: Sequence[UnitStatus], report: SyncerStatus | None, policy: FailurePolicy, now: float
) -> list[UnitStatus]:
    """The units a chaos unit fault may hit: those that have run healthily. Merely Online is not
    enough: faults that came due while units were down would land on each one the moment it came
    back, a crash loop that only a queue of faults makes, and the crash-loop backoff would then
    keep the unit out of the run for minutes."""
    return [u for u in units if ran_healthily(u, report, policy, now)]


def restart_delay(policy: FailurePolicy, quick_failures: int) -> float:
    """Seconds between a unit being Offline and its recreation: 0 after a healthy run, else the
    crash-loop backoff restartBackoffSeconds * 2^(quick_failures-1), capped."""
    if quick_failures <= 0:
        return 0.0
    cap = max(policy.max_restart_backoff_seconds, policy.restart_backoff_seconds)
    return float(min(policy.restart_backoff_seconds * 2.0 ** min(quick_failures - 1, 60), cap))


def offline_delay(unit: UnitStatus, policy: FailurePolicy) -> float:
    """Seconds an Offline unit waits, once gone, before its recreation: none after a
    preemption, else the crash-loop backoff of its quick failures."""
    return 0.0 if is_preempted(unit) else restart_delay(policy, unit.quick_failures)


def take_offline(
    unit: UnitStatus,
    signal: Signal,
    policy: FailurePolicy,
    now: float,
    report: SyncerStatus | None = None,
) -> tuple[UnitStatus, list[Action]]:
    """Mark a failed unit Offline (or Failed when its budget is spent) and delete all of it; the
    crash-loop count restarts from 0 after a healthy run and grows after a quick failure. A
    preemption spends no budget and leaves the crash-loop count as it was."""
    failure = UnitFailure(reason=signal.reason, message=signal.message[:1024], time=at(now))
    preempted = signal.reason == PREEMPTED
    spent = not preempted and unit.restarts >= policy.max_unit_restarts
    state = "Failed" if spent else "Offline"
    if preempted:
        quick = unit.quick_failures
    else:
        quick = 0 if ran_healthily(unit, report, policy, now) else unit.quick_failures + 1
    updated = unit.model_copy(
        update={
            "state": state,
            "since": at(now),
            "last_failure": failure,
            "quick_failures": quick,
        }
    )
    offline = (
        EmitEvent("Normal", "UnitPreempted", f"{unit.name}: {signal.message}", unit.name)
        if preempted
        else EmitEvent(
            "Warning", "UnitOffline", f"{unit.name}: {signal.reason}: {signal.message}", unit.name
        )
    )
    events: list[Action] = [offline, DeleteUnit(unit.name, signal.reason)]
    if spent:
        events.append(
            EmitEvent(
                "Warning",
                "RestartBudgetSpent",
                f"{unit.name} failed after {unit.restarts} restarts "
                f"(maxUnitRestarts={policy.max_unit_restarts}); giving it up",
                unit.name,
            )
        )
    return updated, events


def recover(
    unit: UnitStatus,
    obs: ObservedUnit | None,
    slot: UnitSlot,
    num_units: int,
    policy: FailurePolicy,
    now: float,
) -> tuple[UnitStatus, list[Action], float | None]:
    """An Offline unit: keep deleting until it is gone, then after its restart delay recreate
    it. Returns the unit, the actions and the seconds until it should be looked at again."""
    if obs is not None and obs.attempt > unit.attempt and obs.phase != "Terminating":
        # The replacement exists but its status write was lost (operator crash): adopt it.
        adopted = unit.model_copy(
            update={
                "state": "Recreating",
                "attempt": obs.attempt,
                **recreation_counts(unit),
                "since": at(now),
            }
        )
        return adopted, [], None
    if obs is not None and obs.phase != "Missing":
        # Still there: (re)issue the delete unless it is already going; deleting is idempotent
        # and this also covers an operator that crashed between status write and delete.
        actions: list[Action] = (
            [] if obs.phase == "Terminating" else [DeleteUnit(unit.name, "Offline")]
        )
        return unit, actions, policy.restart_backoff_seconds or 1.0
    waited = seconds_since(unit.since, now)
    delay = offline_delay(unit, policy)
    if waited < delay:
        return unit, [], delay - waited
    attempt = unit.attempt + 1
    updated = unit.model_copy(
        update={
            "state": "Recreating",
            "attempt": attempt,
            **recreation_counts(unit),
            "since": at(now),
        }
    )
    why = " after a preemption" if is_preempted(unit) else ""
    return (
        updated,
        [
            CreateUnit(
                slot.name, slot.group, slot.index, slot.global_index, attempt, num_units, slot.hosts
            ),
            EmitEvent(
                "Normal",
                "UnitRecreated",
                f"{unit.name} recreated as attempt {attempt}{why}",
                unit.name,
            ),
        ],
        None,
    )
