"""Kubernetes condition conventions: one entry per type; lastTransitionTime changes only when
the status flips, so rerunning a pass with the same facts rewrites nothing."""

from __future__ import annotations

from typing import Literal

from diloco_operator.api import Condition
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
