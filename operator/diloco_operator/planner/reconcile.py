"""One planning pass: spec + observed units + last status + syncer report -> Plan.

Pure and idempotent: rerunning it on the same inputs gives the same actions, and a pass that
lost its status write (operator crash) is repaired by the next one, because unit identity lives
in deterministic names and attempt labels, not only in status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from diloco_trainer.status import LearnerStatus, SyncerStatus

from diloco_operator.api import (
    LABEL_GROUP,
    LABEL_RUN,
    Condition,
    DilocoRunSpec,
    DilocoRunStatus,
    RunPhase,
    UnitStatus,
)
from diloco_operator.planner.completion import TERMINAL, TROUBLED, run_phase
from diloco_operator.planner.conditions import queue_conditions, set_condition
from diloco_operator.planner.failure import (
    Signal,
    failure_signal,
    not_yet_seen,
    offline_delay,
    recover,
    take_offline,
)
from diloco_operator.planner.goodput import account
from diloco_operator.planner.groups import group_summaries
from diloco_operator.planner.model import (
    Action,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    Plan,
    gone,
)
from diloco_operator.planner.placement import UnitSlot, desired_units
from diloco_operator.planner.remote import remote_units
from diloco_operator.planner.scaling import remove, surplus
from diloco_operator.planner.spares import covers, is_cover, mark_covered, step_spares
from diloco_operator.planner.suspension import (
    QUEUED,
    SUSPENDED,
    admitted,
    held,
    new_slot_state,
    resume,
    suspend,
    syncer_actions,
)
from diloco_operator.planner.timefmt import at
from diloco_operator.planner.trust import note_refusals, quarantine_signal


def _adopt(obs: ObservedUnit, global_index: int, now: float) -> UnitStatus:
    """Status for a child found without bookkeeping (status lost, e.g. operator crash)."""
    return UnitStatus(
        name=obs.name,
        group=obs.group,
        index=obs.index,
        global_index=global_index,
        state="Pending" if obs.attempt == 0 else "Recreating",
        attempt=obs.attempt,
        restarts=obs.attempt,
        since=at(obs.since or now),
    )


def _step_unit(
    unit: UnitStatus,
    obs: ObservedUnit | None,
    slot: UnitSlot,
    spec: DilocoRunSpec,
    report: SyncerStatus | None,
    now: float,
) -> tuple[UnitStatus, list[Action], float | None]:
    policy = spec.failure_policy
    if unit.state == "Completed":
        return unit, [], None
    if unit.state == "Failed":
        leaving = obs is None or obs.phase in ("Missing", "Terminating")
        return unit, [] if leaving else [DeleteUnit(unit.name, "RestartBudgetSpent")], None
    if unit.state == "Offline":
        if spec.suspend and gone(obs):
            return unit, [], None  # recreated (and counted) once the run resumes
        return recover(unit, obs, slot, spec.total_units, policy, now)
    if spec.suspend and unit.state != "Removing":
        return suspend(unit, obs, now)
    if unit.state == SUSPENDED:
        return resume(unit, obs, _create(slot, unit.attempt + 1, spec), now)
    if unit.state == "Removing":
        # Scaled down, then up again before it was gone: wait for it to go, then start afresh
        # (not a failure, so no restart is counted).
        if not gone(obs):
            return unit, [], 1.0
        attempt = unit.attempt + 1
        return (
            unit.model_copy(update={"state": "Pending", "attempt": attempt, "since": at(now)}),
            [_create(slot, attempt, spec)],
            None,
        )
    # Live states: Pending, Queued, Recreating, Online.
    if obs is not None and obs.attempt > unit.attempt:
        unit = unit.model_copy(update={"attempt": obs.attempt})  # a lost status write
    if obs is not None and obs.phase == "Suspended" and obs.attempt == unit.attempt:
        return held(unit, obs, now)
    if unit.state == QUEUED and obs is not None and obs.phase in ("Pending", "Running"):
        return admitted(unit, obs, now)
    if not_yet_seen(unit, obs, now):
        return unit, [], 1.0
    signal = failure_signal(obs, unit, report, policy, now)
    if signal is None and unit.state == "Online":
        signal = quarantine_signal(unit, report)
    if signal is None and obs is not None and obs.attempt < unit.attempt:
        signal = Signal("StaleAttempt", f"found attempt {obs.attempt}, expected {unit.attempt}")
    if obs is not None and obs.phase == "Succeeded" and signal is None:
        done = unit.model_copy(update={"state": "Completed", "since": at(now)})
        return (
            done,
            [EmitEvent("Normal", "UnitCompleted", f"{unit.name} finished", unit.name)],
            None,
        )
    if signal is not None:
        updated, actions = take_offline(unit, signal, policy, now, report)
        wait = offline_delay(updated, policy) if updated.state == "Offline" else None
        return updated, actions, wait
    assert obs is not None
    if obs.phase == "Running" and obs.ready and unit.state != "Online":
        online = unit.model_copy(update={"state": "Online", "since": at(now)})
        event = EmitEvent(
            "Normal", "UnitOnline", f"{unit.name} attempt {unit.attempt} online", unit.name
        )
        return online, [event], None
    return unit, [], None


def _create(slot: UnitSlot, attempt: int, spec: DilocoRunSpec) -> CreateUnit:
    return CreateUnit(
        slot.name, slot.group, slot.index, slot.global_index, attempt, spec.total_units, slot.hosts
    )


# Progress the syncer reports, copied into the run's status (the same names on both): a report
# without a value keeps the previous one, so an unreachable syncer does not blank the status.
PROGRESS_FIELDS = ("outer_step", "steps", "tokens", "loss", "train_loss", "final_loss")


def _progress(report: SyncerStatus | None, prev: DilocoRunStatus) -> dict[str, Any]:
    out = {}
    for name in PROGRESS_FIELDS:
        value = getattr(report, name) if report is not None else None
        out[name] = value if value is not None else getattr(prev, name)
    return out


def _scale(run: str, spec: DilocoRunSpec, units: Sequence[UnitStatus]) -> dict[str, Any]:
    """The scale subresource's fields: the first group's units and their pods' selector."""
    first = spec.unit_groups[0].name
    return {
        "replicas": sum(1 for u in units if u.state != "Removing" and u.group == first),
        "selector": f"{LABEL_RUN}={run},{LABEL_GROUP}={first}",
    }


def _new_unit(slot: UnitSlot, now: float, state: Any = "Pending") -> UnitStatus:
    return UnitStatus(
        name=slot.name,
        group=slot.group,
        index=slot.index,
        global_index=slot.global_index,
        state=state,
        since=at(now),
    )


def _desired(
    slots: Sequence[UnitSlot],
    spec: DilocoRunSpec,
    prev_by: dict[str, UnitStatus],
    obs_by: dict[str, ObservedUnit],
    report: SyncerStatus | None,
    now: float,
    terminal: bool,
) -> tuple[list[UnitStatus], list[Action], list[float]]:
    """Step every unit the spec wants; a finished run only carries their status over."""
    units: list[UnitStatus] = []
    actions: list[Action] = []
    waits: list[float] = []
    for slot in slots:
        unit = prev_by.get(slot.name)
        obs = obs_by.get(slot.name)
        if unit is None and obs is None:
            if not terminal:
                units.append(_new_unit(slot, now, new_slot_state(spec.suspend)))
                if not spec.suspend:
                    actions.append(_create(slot, 0, spec))
            continue
        if unit is None:
            assert obs is not None
            unit = _adopt(obs, slot.global_index, now)
        if terminal:
            units.append(unit)
            continue
        unit, unit_actions, wait = _step_unit(unit, obs, slot, spec, report, now)
        unit, events = note_refusals(unit, report)
        unit_actions = [*unit_actions, *events]
        units.append(unit)
        actions.extend(unit_actions)
        if wait is not None:
            waits.append(wait)
    return units, actions, waits


def _surplus(
    slots: Sequence[UnitSlot],
    prev: DilocoRunStatus,
    prev_by: dict[str, UnitStatus],
    obs_by: dict[str, ObservedUnit],
    now: float,
) -> tuple[list[UnitStatus], list[Action], list[float]]:
    """Remove the units the spec no longer wants (scaled down), highest index first."""
    units: list[UnitStatus] = []
    actions: list[Action] = []
    waits: list[float] = []
    order = {u.name: u.global_index for u in prev.units}
    order.update({o.name: o.index for o in obs_by.values() if o.name not in order})
    for name in surplus(set(prev_by) | set(obs_by), {s.name for s in slots}, order):
        obs = obs_by.get(name)
        unit = prev_by.get(name) or (_adopt(obs, order[name], now) if obs else None)
        if unit is None:
            continue
        kept, removal = remove(unit, obs)
        actions.extend(removal)
        if kept is not None:
            units.append(kept)
            waits.append(1.0)
    return units, actions, waits


# How long a succeeded run's learners may take to exit on their own before they are stopped.
FINISH_GRACE_SECONDS = 30.0


def succeeded_since(prev: DilocoRunStatus, now: float) -> float:
    """When the run turned Succeeded: its Complete condition's transition, or now."""
    if prev.phase == "Succeeded":
        for c in prev.conditions:
            if c.type == "Complete" and c.status == "True":
                return c.last_transition_time.timestamp()
    return now


def in_place_count(unit: UnitStatus, learner: LearnerStatus | None) -> UnitStatus:
    """`unit` with the restarts in place of its current attempt, once the syncer heard them
    (a warm spare's cover of the unit is none of them)."""
    if learner is None or learner.attempt != unit.attempt or is_cover(learner.restarts_in_place):
        return unit
    if learner.restarts_in_place == unit.restarts_in_place:
        return unit
    return unit.model_copy(update={"restarts_in_place": learner.restarts_in_place})


def _settle(
    phase: RunPhase,
    actions: list[Action],
    units: list[UnitStatus],
    obs_by: dict[str, ObservedUnit],
    finish_wait: float,
) -> tuple[list[Action], list[UnitStatus]]:
    """Nothing new starts in a finished run; every unit still running is stopped, and in a
    succeeded one every live unit counts as Completed. A succeeded run's learners are given
    `finish_wait` more seconds to exit by themselves (they hear of completion with their next
    heartbeat), so their pods end Completed with their logs, not deleted mid-exit."""
    if phase not in TERMINAL:
        return actions, units
    actions = [a for a in actions if not isinstance(a, CreateUnit | CreateSyncer)]
    deleting = {a.name for a in actions if isinstance(a, DeleteUnit)}
    for name, obs in obs_by.items():
        if obs.phase in ("Terminating", "Succeeded") or name in deleting:
            continue
        if phase == "Failed" or finish_wait <= 0:
            actions.append(DeleteUnit(name, f"Run{phase}"))
    if phase == "Succeeded":
        units = [
            u.model_copy(update={"state": "Completed"})
            if u.state in ("Pending", "Queued", "Recreating", "Online")
            else u
            for u in units
        ]
    return actions, units


def _conditions(
    prev: DilocoRunStatus,
    phase: RunPhase,
    why: str,
    units: Sequence[UnitStatus],
    syncer: ObservedSyncer,
    now: float,
    generation: int | None,
    suspended: bool,
) -> list[Condition]:
    online = sum(u.state == "Online" for u in units)
    active = [u for u in units if u.state != "Removing"]
    troubled = [u.name for u in active if u.state in TROUBLED]
    ready = phase == "Running" and online == len(active) and syncer.ready
    not_ready = "SyncerNotReady" if not syncer.ready else "UnitsNotOnline"
    syncer_word = "ready" if syncer.ready else "not ready"
    conds = set_condition(
        list(prev.conditions),
        "Ready",
        ready,
        "AllUnitsOnline" if ready else not_ready,
        f"{online}/{len(active)} units online; syncer {syncer_word}",
        now,
        generation,
    )
    degraded = "UnitsOffline" if troubled else "AllUnitsHealthy"
    conds = set_condition(
        conds, "Degraded", bool(troubled), degraded, ", ".join(troubled[:10]), now, generation
    )
    conds = set_condition(
        conds, "Progressing", phase not in TERMINAL, f"Run{phase}", why, now, generation
    )
    conds = queue_conditions(conds, suspended, units, now, generation)
    return set_condition(
        conds, "Complete", phase == "Succeeded", f"Run{phase}", why, now, generation
    )


def plan(
    run: str,
    spec: DilocoRunSpec,
    observed: Sequence[ObservedUnit],
    status: DilocoRunStatus | None,
    now: float,
    *,
    syncer: ObservedSyncer,
    report: SyncerStatus | None = None,
    generation: int | None = None,
    spares: bool = True,
) -> Plan:
    """Plan one reconciliation pass of run `run` at time `now` (seconds since the epoch).
    `spares`: whether this backend keeps the spec's warm spares (the local runtime has a spare
    pool of its own, local/spares.py)."""
    prev = status or DilocoRunStatus()
    obs_by = {o.name: o for o in observed if o.phase != "Missing" and not o.spare}
    spare_obs = {o.name: o for o in observed if o.phase != "Missing" and o.spare}
    prev_by = {u.name: u for u in prev.units}
    slots = desired_units(run, spec)
    local = [s for s in slots if not s.remote]
    # Home reports the other clusters' units as the syncer hears them; an away run only its own.
    remote = [] if spec.away else [s for s in slots if s.remote]
    terminal = prev.phase in TERMINAL or (report is not None and report.complete)

    actions: list[Action] = []
    if not terminal and not spec.away:
        wanted = not (syncer.present or spec.suspend)
        actions += [CreateSyncer()] if wanted else syncer_actions(spec.suspend, syncer)
    units, unit_actions, waits = _desired(local, spec, prev_by, obs_by, report, now, terminal)
    far, far_events = remote_units(
        remote, prev_by, report, spec.failure_policy.offline_after_seconds, now
    )
    removed, removal_actions, removal_waits = _surplus(slots, prev, prev_by, obs_by, now)
    actions += unit_actions + far_events + removal_actions
    units += far + removed
    waits += removal_waits
    if not terminal:
        heard = report.learners if report is not None else {}
        units = [
            account(in_place_count(u, heard.get(u.name)), heard.get(u.name), now) for u in units
        ]

    # An away run answers for its own units only; the run's quorum is the home syncer's.
    quorum = 1 if spec.away else spec.training.quorum
    phase, why = run_phase(prev.phase, units, report, quorum, spec.suspend)
    finish_wait = succeeded_since(prev, now) + FINISH_GRACE_SECONDS - now
    actions, units = _settle(phase, actions, units, obs_by, finish_wait)
    if phase == "Succeeded" and finish_wait > 0:
        waits.append(finish_wait)
    stopping = phase in TERMINAL or spec.suspend or not spares
    kept, spare_actions, spare_waits = step_spares(
        run, spec, prev.spares, spare_obs, report, now, stopping
    )
    actions += spare_actions
    if not stopping:
        actions += covers(units, report, spec.total_units)
    units = mark_covered(units, report)
    waits += spare_waits
    if phase != prev.phase:
        kind: Literal["Normal", "Warning"] = (
            "Warning" if phase in ("Failed", "Degraded") else "Normal"
        )
        actions.append(EmitEvent(kind, f"Run{phase}", why))

    units.sort(key=lambda u: u.global_index)
    new_status = DilocoRunStatus(
        phase=phase,
        conditions=_conditions(prev, phase, why, units, syncer, now, generation, spec.suspend),
        units=units,
        units_online=sum(u.state == "Online" for u in units),
        groups=group_summaries(spec, units, report, prev.groups),
        **_scale(run, spec, units),
        observed_generation=generation if generation is not None else prev.observed_generation,
        message=why,
        spares=kept or None,
        **_progress(report, prev),
    )
    return Plan(tuple(actions), new_status, min(waits) if waits else None)
