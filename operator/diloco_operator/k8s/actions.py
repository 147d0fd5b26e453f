"""What each planner action does to the cluster: one applier per kind of action, and a table from
kind to applier (in the spirit of JobSet's action map). A new kind of action is a new row here;
the reconcile pass itself never branches on kinds."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import Counter

from diloco_operator.k8s import builders, kube
from diloco_operator.k8s.netpolicy import run_objects_with_policy
from diloco_operator.k8s.refusals import Refusal, create_all
from diloco_operator.k8s.spare_pods import spare_objects
from diloco_operator.k8s.state import STATE
from diloco_operator.k8s.syncer_calls import ask_cover, read_run_token
from diloco_operator.planner import (
    Action,
    CoverUnit,
    CreateSpare,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    Plan,
    ScaleSyncer,
    SuspendUnit,
)

log = logging.getLogger("diloco_operator")

ACTIONS = Counter("diloco_operator_actions_total", "Actions applied", ["action", "reason"])


@dataclass
class Pass:
    """What one pass's appliers share: the run, its object (for Events), and what the API server
    refused so far (None while nothing was created)."""

    run: builders.Run
    body: Any
    refused: list[Refusal] | None = field(default=None)


async def create_syncer(p: Pass, action: CreateSyncer) -> None:
    objs = run_objects_with_policy(p.run, STATE.options.network_policy)
    await _create(p, action, objs, ("create_syncer", ""))


async def create_unit(p: Pass, action: CreateUnit) -> None:
    run_token = await read_run_token(p.run)
    if run_token is None:
        log.info("unit=%s waits for the run's token Secret", action.name)
        return
    objs = builders.unit_objects(p.run, action, run_token, STATE.options.kubelet_rule_ok)
    await _create(p, action, objs, ("create_unit", f"attempt{min(action.attempt, 1)}"))


async def create_spare(p: Pass, action: CreateSpare) -> None:
    run_token = await read_run_token(p.run)
    if run_token is None:
        log.info("spare=%s waits for the run's token Secret", action.name)
        return
    objs = spare_objects(p.run, action, run_token, STATE.options.kubelet_rule_ok)
    await _create(p, action, objs, ("create_spare", f"attempt{min(action.attempt, 1)}"))


async def cover_unit(p: Pass, action: CoverUnit) -> None:
    spare = await ask_cover(p.run, action)
    ACTIONS.labels("cover_unit", "handed" if spare else "not_handed").inc()
    if spare:
        message = f"{action.name} covered by warm spare {spare} while its pods are recreated"
        kopf.event(p.body, type="Normal", reason="UnitCovered", message=message)


async def _create(
    p: Pass,
    action: CreateSyncer | CreateUnit | CreateSpare,
    objs: list[dict[str, Any]],
    metric: tuple[str, str],
) -> None:
    problem = await create_all(p.run, objs)
    p.refused = (p.refused or []) + ([(action, problem)] if problem else [])
    ACTIONS.labels(*(metric if problem is None else ("refused", problem.reason))).inc()


async def delete_unit(p: Pass, action: DeleteUnit) -> None:
    await kube.delete_unit(p.run.namespace, action.name)
    ACTIONS.labels("delete_unit", action.reason).inc()


async def suspend_unit(p: Pass, action: SuspendUnit) -> None:
    await kube.suspend_job(p.run.namespace, action.name, action.suspend)
    ACTIONS.labels("suspend_unit" if action.suspend else "resume_unit", "").inc()


async def scale_syncer(p: Pass, action: ScaleSyncer) -> None:
    # Every shard: a suspended run keeps no syncer process, a resumed one needs all of them.
    for name in p.run.shard_names:
        await kube.scale_deployment(p.run.namespace, name, action.replicas)
    ACTIONS.labels("scale_syncer", str(action.replicas)).inc()


async def emit_event(p: Pass, action: EmitEvent) -> None:
    kopf.event(p.body, type=action.type, reason=action.reason, message=action.message[:1024])
    level = logging.WARNING if action.type == "Warning" else logging.INFO
    log.log(
        level,
        "event run=%s reason=%s unit=%s message=%s",
        p.run.name,
        action.reason,
        action.unit,
        action.message,
    )
    ACTIONS.labels("event", action.reason).inc()


Applier = Callable[[Pass, Any], Awaitable[None]]

APPLIERS: dict[type, Applier] = {
    CreateSyncer: create_syncer,
    CreateUnit: create_unit,
    CreateSpare: create_spare,
    CoverUnit: cover_unit,
    DeleteUnit: delete_unit,
    SuspendUnit: suspend_unit,
    ScaleSyncer: scale_syncer,
    EmitEvent: emit_event,
}


async def apply(run: builders.Run, the_plan: Plan, body: Any) -> list[Refusal] | None:
    """Apply the plan's actions in order; the creations refused (None when nothing was created)."""
    p = Pass(run, body)
    for action in the_plan.actions:
        await APPLIERS[type(action)](p, action)
    return p.refused


def kinds_without_applier() -> set[type]:
    """Kinds of action the planner can emit that have no row in the table (should be none)."""
    return set(Action.__args__) - set(APPLIERS)
