"""One planning pass: spec + observed units + last status + syncer report -> Plan.

Pure and idempotent: rerunning it on the same inputs gives the same actions, and a pass that
lost its status write (operator crash) is repaired by the next one, because unit identity lives
in deterministic names and attempt labels, not only in status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from diloco_trainer.status import SyncerStatus

from diloco_operator.api import (
    LABEL_GROUP,
    LABEL_RUN,
    DilocoRunSpec,
    DilocoRunStatus,
    UnitStatus,
)
from diloco_operator.planner.completion import TERMINAL, TROUBLED, run_phase
from diloco_operator.planner.conditions import set_condition
from diloco_operator.planner.failure import (
    Signal,
    failure_signal,
    recover,
    restart_delay,
    take_offline,
)
from diloco_operator.planner.model import (
    Action,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    Plan,
)
from diloco_operator.planner.placement import UnitSlot, desired_units
from diloco_operator.planner.scaling import remove, surplus
from diloco_operator.planner.timefmt import at


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
        gone = obs is None or obs.phase in ("Missing", "Terminating")
        return unit, [] if gone else [DeleteUnit(unit.name, "RestartBudgetSpent")], None
    if unit.state == "Offline":
        return recover(unit, obs, slot, spec.total_units, policy, now)
    if unit.state == "Removing":
        # Scaled down, then up again before it was gone: wait for it to go, then start afresh
        # (not a failure, so no restart is counted).
        if obs is not None and obs.phase != "Missing":
            return unit, [], 1.0
        attempt = unit.attempt + 1
        return (
            unit.model_copy(update={"state": "Pending", "attempt": attempt, "since": at(now)}),
            [_create(slot, attempt, spec)],
            None,
        )
    # Live states: Pending, Recreating, Online.
    if obs is not None and obs.attempt > unit.attempt:
        unit = unit.model_copy(update={"attempt": obs.attempt})  # a lost status write
    signal = failure_signal(obs, unit, report, policy)
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
        wait = restart_delay(policy, updated.quick_failures) if updated.state == "Offline" else None
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
) -> Plan:
    """Plan one reconciliation pass of run `run` at time `now` (seconds since the epoch)."""
    prev = status or DilocoRunStatus()
    obs_by = {o.name: o for o in observed if o.phase != "Missing"}
    prev_by = {u.name: u for u in prev.units}
    slots = desired_units(run, spec)
    slot_by = {s.name: s for s in slots}
    actions: list[Action] = []
    waits: list[float] = []
    units: list[UnitStatus] = []
    terminal = prev.phase in TERMINAL or (report is not None and report.complete)

    if not terminal and not syncer.present:
        actions.append(CreateSyncer())

    for slot in slots:
        unit = prev_by.get(slot.name)
        obs = obs_by.get(slot.name)
        if unit is None and obs is None:
            if terminal:
                continue
            unit = UnitStatus(
                name=slot.name,
                group=slot.group,
                index=slot.index,
                global_index=slot.global_index,
                state="Pending",
                since=at(now),
            )
            actions.append(_create(slot, 0, spec))
            units.append(unit)
            continue
        if unit is None:
            assert obs is not None
            unit = _adopt(obs, slot.global_index, now)
        if terminal:
            units.append(unit)
            continue
        unit, unit_actions, wait = _step_unit(unit, obs, slot, spec, report, now)
        units.append(unit)
        actions.extend(unit_actions)
        if wait is not None:
            waits.append(wait)

    order = {u.name: u.global_index for u in prev.units}
    order.update({o.name: o.index for o in obs_by.values() if o.name not in order})
    for name in surplus(set(prev_by) | set(obs_by), set(slot_by), order):
        obs = obs_by.get(name)
        unit = prev_by.get(name) or (_adopt(obs, order[name], now) if obs else None)
        if unit is None:
            continue
        kept, removal = remove(unit, obs)
        actions.extend(removal)
        if kept is not None:
            units.append(kept)
            waits.append(1.0)

    phase, why = run_phase(prev.phase, units, report, spec.training.quorum)
    if phase in TERMINAL:
        # Nothing new starts in a finished run; every unit still running is stopped.
        actions = [a for a in actions if not isinstance(a, CreateUnit | CreateSyncer)]
        deleting = {a.name for a in actions if isinstance(a, DeleteUnit)}
        for name, obs in obs_by.items():
            if obs.phase not in ("Terminating", "Succeeded") and name not in deleting:
                actions.append(DeleteUnit(name, f"Run{phase}"))
        if phase == "Succeeded":
            units = [
                u.model_copy(update={"state": "Completed"})
                if u.state in ("Pending", "Recreating", "Online")
                else u
                for u in units
            ]
    if phase != prev.phase:
        kind: Literal["Normal", "Warning"] = (
            "Warning" if phase in ("Failed", "Degraded") else "Normal"
        )
        actions.append(EmitEvent(kind, f"Run{phase}", why))

    units.sort(key=lambda u: u.global_index)
    first = spec.unit_groups[0].name
    online = sum(u.state == "Online" for u in units)
    active = [u for u in units if u.state != "Removing"]
    troubled = [u.name for u in active if u.state in TROUBLED]
    conds = list(prev.conditions)
    ready = phase == "Running" and online == len(active) and syncer.ready
    conds = set_condition(
        conds,
        "Ready",
        ready,
        "AllUnitsOnline" if ready else ("SyncerNotReady" if not syncer.ready else "UnitsNotOnline"),
        f"{online}/{len(active)} units online; syncer {'ready' if syncer.ready else 'not ready'}",
        now,
        generation,
    )
    conds = set_condition(
        conds,
        "Degraded",
        bool(troubled),
        "UnitsOffline" if troubled else "AllUnitsHealthy",
        ", ".join(troubled[:10]),
        now,
        generation,
    )
    conds = set_condition(
        conds, "Progressing", phase not in TERMINAL, f"Run{phase}", why, now, generation
    )
    conds = set_condition(
        conds, "Complete", phase == "Succeeded", f"Run{phase}", why, now, generation
    )

    new_status = DilocoRunStatus(
        phase=phase,
        conditions=conds,
        units=units,
        units_online=online,
        replicas=sum(1 for u in active if u.group == first),
        selector=f"{LABEL_RUN}={run},{LABEL_GROUP}={first}",
        outer_step=report.outer_step
        if report and report.outer_step is not None
        else prev.outer_step,
        steps=report.steps if report and report.steps is not None else prev.steps,
        tokens=report.tokens if report and report.tokens is not None else prev.tokens,
        loss=report.loss if report and report.loss is not None else prev.loss,
        train_loss=report.train_loss
        if report and report.train_loss is not None
        else prev.train_loss,
        final_loss=report.final_loss
        if report and report.final_loss is not None
        else prev.final_loss,
        observed_generation=generation if generation is not None else prev.observed_generation,
        message=why,
    )
    return Plan(tuple(actions), new_status, min(waits) if waits else None)
