"""Scaling policy: units beyond the spec (scale-down, removed group) are deleted, highest global
index first; new slots (scale-up) are created at attempt 0. Other units are never touched."""

from __future__ import annotations

from collections.abc import Iterable

from diloco_operator.api import UnitStatus
from diloco_operator.planner.model import Action, DeleteUnit, EmitEvent, ObservedUnit


def surplus(known: Iterable[str], desired: set[str], order: dict[str, int]) -> list[str]:
    """Names that exist (in status or observed) but are no longer desired, highest index first."""
    extra = {n for n in known if n not in desired}
    return sorted(extra, key=lambda n: order.get(n, -1), reverse=True)


def remove(unit: UnitStatus, obs: ObservedUnit | None) -> tuple[UnitStatus | None, list[Action]]:
    """Step the removal of one surplus unit; returns None once it is gone (drop from status)."""
    if obs is None or obs.phase == "Missing":
        return None, []
    actions: list[Action] = []
    if obs.phase != "Terminating":
        actions.append(DeleteUnit(unit.name, "ScaledDown"))
    if unit.state != "Removing":
        actions.append(
            EmitEvent("Normal", "UnitRemoved", f"{unit.name}: no longer in the spec", unit.name)
        )
        unit = unit.model_copy(update={"state": "Removing"})
    return unit, actions
