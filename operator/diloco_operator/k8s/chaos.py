"""Chaos on Kubernetes: the manifest's `spec.chaos`, delivered by the operator.

Off unless the operator runs with `--enable-chaos` (the chart's `chaos.enabled`): fault injection
on a production cluster must be a deliberate choice of whoever runs the operator, not of whoever
may write a DilocoRun. The schedule is the local runtime's (`ChaosScheduler`: the
same seed and manifest give the same decisions, `faults.py`); only delivery differs:

- kill: the unit's pods are deleted with no grace period (the kubelet SIGKILLs the learner);
- killSyncer: the syncer pod is deleted the same way (the Deployment makes a new one, which
  resumes from the checkpoint volume);
- nodeNotReady: the Ready condition of a node that runs the unit is set to False (the operator
  then sees what it sees when a host stops reporting, and replaces the unit);
- pause: not deliverable from outside a container on Kubernetes; reported as skipped.

Each fault is an Event on the run. Progress survives an operator restart through an annotation
holding the run time (seconds since creation) of the last delivery: a new scheduler is
fast-forwarded past it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_operator.api import GROUP, LABEL_COMPONENT, LABEL_RUN, LABEL_UNIT
from diloco_operator.k8s import builders, kube
from diloco_operator.planner.faults import ChaosScheduler, Fault, chaos_settings

log = logging.getLogger("diloco_operator.k8s.chaos")

PROGRESS_ANNOTATION = f"{GROUP}/chaos-delivered-at"


@dataclass
class RunChaos:
    """One run's fault schedule; `started` is the run's creation time (epoch seconds)."""

    scheduler: ChaosScheduler
    started: float
    delivered_at: float = 0.0


def new_run_chaos(run: builders.Run, created: float, delivered_at: float) -> RunChaos | None:
    """The run's schedule, fast-forwarded past faults delivered before an operator restart."""
    spec = run.spec.chaos
    if spec is None or not spec.has_fault_settings:
        return None  # no block, or only local knobs (slowdown): never the local demo's defaults
    settings = chaos_settings(spec, enabled=True)
    scheduler = ChaosScheduler(settings)
    if delivered_at > 0:
        scheduler.due(delivered_at, range(run.spec.total_units))
    return RunChaos(scheduler, created, delivered_at)


@dataclass(frozen=True)
class Delivery:
    """What to do for one fault, and the Event that says so (pure: decided from names)."""

    action: str  # kill-pods | mark-node | skip
    selector: str
    reason: str
    message: str


def plan_delivery(run: builders.Run, fault: Fault, unit_names: dict[int, str]) -> Delivery:
    if fault.kind == "kill-syncer":
        selector = f"{LABEL_RUN}={run.name},{LABEL_COMPONENT}={builders.SYNCER}"
        return Delivery("kill-pods", selector, "ChaosKillSyncer", "deleting the syncer pod")
    name = unit_names.get(fault.unit if fault.unit is not None else -1)
    if name is None:
        return Delivery("skip", "", "ChaosSkipped", f"no unit with index {fault.unit}")
    selector = f"{LABEL_UNIT}={name}"
    if fault.kind == "kill":
        return Delivery("kill-pods", selector, "ChaosKill", f"unit {name}: deleting its pods")
    if fault.kind == "node-not-ready":
        return Delivery("mark-node", selector, "ChaosNodeNotReady", f"unit {name}: node NotReady")
    return Delivery(
        "skip", selector, "ChaosSkipped", f"unit {name}: {fault.kind} is local-runtime only"
    )


def due(state: RunChaos, now: float, online: Sequence[int]) -> list[Fault]:
    faults = state.scheduler.due(now - state.started, online)
    if faults:
        state.delivered_at = max(f.at for f in faults)
    return faults


async def deliver(run: builders.Run, delivery: Delivery) -> str:
    """Carry out one delivery; returns the Event message with what was hit."""
    if delivery.action == "kill-pods":
        pods = await kube.kill_pods(run.namespace, delivery.selector)
        return f"{delivery.message}: {', '.join(pods) or 'none running'}"
    if delivery.action == "mark-node":
        nodes = await kube.pod_nodes(run.namespace, delivery.selector)
        for node in nodes[:1]:
            await kube.mark_node_not_ready(node, "DilocoChaos", f"chaos of run {run.name}")
        return f"{delivery.message}: {', '.join(nodes[:1]) or 'no node'}"
    return delivery.message
