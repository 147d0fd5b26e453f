"""Children the API server refused: creation stops at the first refused object of an action,
and the pass reports what was refused (the ChildrenCreated condition and a Warning Event)
instead of failing and only logging it."""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.status import SpareStatus
from diloco_operator.k8s import builders, kube
from diloco_operator.planner import CreateSpare, CreateSyncer, CreateUnit
from diloco_operator.planner.conditions import set_condition

log = logging.getLogger("diloco_operator")


async def create_all(run: builders.Run, objs: list[dict[str, Any]]) -> kube.ChildError | None:
    """Create objects in order; stop at the first the API server refuses (the later ones
    depend on it) and return why, so the pass goes on with the other actions."""
    for obj in objs:
        try:
            await kube.create(obj, run.uid)
        except kube.ChildError as exc:
            log.warning("child refused run=%s reason=%s %s", run.name, exc.reason, exc)
            return exc
    return None


Refusal = tuple[CreateSyncer | CreateUnit | CreateSpare, kube.ChildError]


CHILDREN_CONDITION = "ChildrenCreated"


def report_refusals(
    status: DilocoRunStatus,
    before: DilocoRunStatus | None,
    refused: list[Refusal] | None,
    body: Any,
    generation: int | None,
) -> DilocoRunStatus:
    """A condition (and, when it changes, a Warning Event) saying which children the API
    server refused: a failing pass is visible in `kubectl describe`, not only in the log.
    A unit whose creation was refused keeps its previous bookkeeping: it was never created,
    so it must not later count as failed (the next pass simply tries again)."""
    if refused is None:  # nothing was created this pass: the condition stands
        # One order whatever the planner's (it re-appends the ones it sets): an unchanged
        # status must compare equal, or every pass would write it.
        return status.model_copy(
            update={"conditions": sorted(status.conditions, key=lambda c: c.type)}
        )
    ok = not refused
    message = "; ".join(str(e) for _, e in refused)[:1024] if refused else "all children created"
    reason = refused[0][1].reason if refused else "Created"
    not_made = {a.name for a, _ in refused if isinstance(a, CreateUnit)}
    units = [u for u in status.units if u.name not in not_made] + [
        u for u in (before.units if before else []) if u.name in not_made
    ]
    units.sort(key=lambda u: u.global_index)
    spares = _kept_spares(
        status, before, {a.name for a, _ in refused if isinstance(a, CreateSpare)}
    )
    conditions = set_condition(
        status.conditions, CHILDREN_CONDITION, ok, reason, message, time.time(), generation
    )
    old = next(
        (c for c in (before.conditions if before else []) if c.type == CHILDREN_CONDITION), None
    )
    if not ok and (old is None or old.message != message):
        kopf.event(body, type="Warning", reason=reason, message=message)
    conditions.sort(key=lambda c: c.type)
    return status.model_copy(update={"conditions": conditions, "units": units, "spares": spares})


def _kept_spares(
    status: DilocoRunStatus, before: DilocoRunStatus | None, not_made: set[str]
) -> list[SpareStatus] | None:
    """The pass's spares, but the bookkeeping from before for those never created."""
    if not not_made:
        return status.spares
    earlier = [s for s in (before.spares or []) if s.name in not_made] if before else []
    kept = [s for s in status.spares or [] if s.name not in not_made] + earlier
    order = {s.name: i for i, s in enumerate(status.spares or [])}
    return sorted(kept, key=lambda s: order.get(s.name, len(order))) or None
