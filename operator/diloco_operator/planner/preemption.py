"""Preemption and node maintenance are not failures.

A unit whose pod was preempted by the scheduler, evicted through the Eviction API (a drain for
node maintenance or upgrades), terminated by the kubelet (a Spot VM's or a maintenance
shutdown), or whose node was deleted (its pods garbage-collected), did nothing wrong: the next
attempt is as likely to run as the last one. Such a unit is recreated at once (no crash-loop
backoff), and the recreation is counted in `preemptions`, never against `maxUnitRestarts`.

What stays a failure: `DeletionByTaintManager` (a NoExecute taint, usually a node gone
NotReady, which is also how a broken host looks), a NotReady node, a failed pod or Job, a stale
heartbeat; and a DisruptionTarget without a reason the backend could read.
"""

from __future__ import annotations

from diloco_operator.api import UnitStatus
from diloco_operator.planner.model import DISRUPTION_TARGET, NODE_DELETED, ObservedUnit

PREEMPTED = "Preempted"

# Reasons of the pod condition DisruptionTarget set by the platform rather than by the pod.
PREEMPTION_REASONS = frozenset(
    {"PreemptionByScheduler", "EvictionByEvictionAPI", "TerminationByKubelet", "DeletionByPodGC"}
)


def preemption_message(obs: ObservedUnit | None) -> str | None:
    """Why `obs` was preempted, or None when what it shows is not a preemption."""
    if obs is None:
        return None
    if obs.failure == NODE_DELETED or obs.failure == PREEMPTED:
        return f"{obs.failure}: {obs.message}" if obs.message else obs.failure
    if obs.failure == DISRUPTION_TARGET and obs.disruption_reason in PREEMPTION_REASONS:
        return obs.message or obs.disruption_reason
    return None


def is_preempted(unit: UnitStatus) -> bool:
    """Whether the unit's last trip offline was a preemption (read from its status, so an
    operator restart keeps the decision)."""
    return unit.last_failure is not None and unit.last_failure.reason == PREEMPTED


def recreation_counts(unit: UnitStatus) -> dict[str, int]:
    """The counter a recreation of `unit` advances: preemptions or restarts."""
    if is_preempted(unit):
        return {"preemptions": unit.preemptions + 1}
    return {"restarts": unit.restarts + 1}
