"""Kueue passthrough (pure): which of the run's labels its unit Jobs carry, and what the run's
status says about its queue.

A run joins a Kueue LocalQueue the way every Kueue workload does: the label
`kueue.x-k8s.io/queue-name` on the object the user applies (here the DilocoRun), optionally with
`kueue.x-k8s.io/priority-class` (a WorkloadPriorityClass). The operator copies both onto each
unit's Job and creates that Job suspended; Kueue admits it by unsuspending it, and evicts or
preempts it by suspending it again (planner/suspension.py: not a failure).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from diloco_operator.api import Condition
from diloco_operator.planner.conditions import set_condition

QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
PASSED_LABELS = (QUEUE_NAME_LABEL, PRIORITY_CLASS_LABEL)

QueueLookup = Literal["found", "missing", "no-kueue"]


def queue_name(run_labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a run asks for (its queue-name label), or None."""
    name = (run_labels or {}).get(QUEUE_NAME_LABEL)
    return name or None


def job_labels(run_labels: Mapping[str, str] | None) -> dict[str, str]:
    """The Kueue labels of a run that its unit Jobs carry (none: the Jobs are not queued)."""
    labels = run_labels or {}
    if not queue_name(labels):
        return {}
    return {key: labels[key] for key in PASSED_LABELS if labels.get(key)}


def queue_found_condition(
    conditions: list[Condition],
    queue: str,
    lookup: QueueLookup,
    now: float,
    generation: int | None,
) -> tuple[list[Condition], str | None]:
    """The QueueFound condition for `queue` and, when the lookup says the queue cannot admit
    anything, the Warning message to post (None when all is well)."""
    if lookup == "found":
        message = f"LocalQueue {queue} exists"
        return set_condition(
            conditions, "QueueFound", True, "LocalQueueFound", message, now, generation
        ), None
    if lookup == "missing":
        reason = "LocalQueueNotFound"
        message = (
            f"LocalQueue {queue} (label {QUEUE_NAME_LABEL}) does not exist in this namespace: "
            "the units stay suspended until it is created or the label names another queue"
        )
    else:
        reason = "KueueNotInstalled"
        message = (
            f"label {QUEUE_NAME_LABEL}={queue} is set but the cluster has no Kueue "
            "(no localqueues.kueue.x-k8s.io): the units stay suspended"
        )
    return set_condition(conditions, "QueueFound", False, reason, message, now, generation), message
