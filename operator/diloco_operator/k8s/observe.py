"""Map Kubernetes children (Jobs, Pods, Nodes) to the planner's neutral ObservedUnit (pure).

Views are small summaries of the objects, so the operator's watch indexes stay light
(50 runs x 16 units is a few thousand entries, not a few thousand full pod bodies).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diloco_operator.api import LABEL_ATTEMPT, LABEL_GROUP, LABEL_INDEX, LABEL_SPARE, LABEL_UNIT
from diloco_operator.k8s.kueue import QUEUE_NAME_LABEL
from diloco_operator.planner.model import (
    DISRUPTION_TARGET,
    JOB_FAILED,
    NODE_DELETED,
    NODE_NOT_READY,
    POD_DELETED,
    POD_FAILED,
    ObservedUnit,
)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _time(value: Any) -> float:
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _condition(
    conditions: Iterable[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    return next(
        (c for c in conditions or () if c.get("type") == type_ and c.get("status") == "True"), None
    )


# The Job controller labels its pods with the Job's uid: the only safe way to tell this Job's
# pods from leftovers of a same-named unit of an earlier run (delete + re-apply of a run).
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"


@dataclass(frozen=True)
class JobView:
    name: str
    group: str
    index: int
    attempt: int
    hosts: int
    terminating: bool
    failed: bool
    complete: bool
    message: str
    created: float
    uid: str = ""
    suspended: bool = False
    queue: str = ""
    # When the Job last resumed from a suspension (its Suspended condition turned False); 0.0
    # for a Job never suspended.
    resumed: float = 0.0
    spare: bool = False  # a warm spare's Job (planner/spares.py)


@dataclass(frozen=True)
class PodView:
    name: str
    unit: str
    attempt: int
    phase: str
    ready: bool
    disrupted: bool
    node: str | None
    terminating: bool
    message: str
    job_uid: str = ""
    disruption_reason: str = ""
    # When its deletion was requested (deletionTimestamp less the grace period); 0.0: not deleted.
    deleted_at: float = 0.0


def _resumed(conditions: Iterable[Mapping[str, Any]] | None) -> float:
    for c in conditions or ():
        if c.get("type") == "Suspended" and c.get("status") == "False":
            return _time(c.get("lastTransitionTime"))
    return 0.0


def job_view(body: Mapping[str, Any]) -> JobView:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    conditions = status.get("conditions")
    failed = _condition(conditions, "Failed")
    return JobView(
        name=meta.get("name", ""),
        group=labels.get(LABEL_GROUP, ""),
        index=_int(labels.get(LABEL_INDEX)),
        attempt=_int(labels.get(LABEL_ATTEMPT)),
        hosts=_int(spec.get("completions"), 1),
        terminating=bool(meta.get("deletionTimestamp")),
        failed=failed is not None,
        complete=_condition(conditions, "Complete") is not None,
        message=f"{failed.get('reason', '')}: {failed.get('message', '')}" if failed else "",
        created=_time(meta.get("creationTimestamp")),
        uid=meta.get("uid", ""),
        # Suspended until the Job controller says it resumed: right after spec.suspend turns
        # false, the pods of the run before the suspension may still be seen going.
        suspended=spec.get("suspend") is True or _condition(conditions, "Suspended") is not None,
        queue=str(labels.get(QUEUE_NAME_LABEL, "")),
        resumed=_resumed(conditions),
        spare=labels.get(LABEL_SPARE) == "true",
    )


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    conditions = status.get("conditions")
    disrupted = _condition(conditions, "DisruptionTarget")
    message = status.get("message") or status.get("reason") or ""
    if disrupted is not None:
        message = f"{disrupted.get('reason', '')}: {disrupted.get('message', '')}"
    return PodView(
        name=meta.get("name", ""),
        unit=labels.get(LABEL_UNIT, ""),
        attempt=_int(labels.get(LABEL_ATTEMPT)),
        phase=status.get("phase") or "Pending",
        ready=_condition(conditions, "Ready") is not None,
        disrupted=disrupted is not None,
        node=(body.get("spec") or {}).get("nodeName"),
        terminating=bool(meta.get("deletionTimestamp")),
        message=str(message),
        job_uid=labels.get(CONTROLLER_UID, ""),
        disruption_reason=str(disrupted.get("reason", "")) if disrupted is not None else "",
        deleted_at=_deleted_at(meta),
    )


def node_ready(body: Mapping[str, Any]) -> bool:
    return _condition((body.get("status") or {}).get("conditions"), "Ready") is not None


def _deleted_at(meta: Mapping[str, Any]) -> float:
    at = _time(meta.get("deletionTimestamp"))
    return at - float(meta.get("deletionGracePeriodSeconds") or 0) if at else 0.0


def _suspension_leftover(deleted_at: float, job: JobView) -> bool:
    """Whether a pod's deletion was requested before the Job last resumed: the Job controller
    deleting the pods of a suspended Job, not a failure. (Not the pod's creation time: after a
    resume the controller may create the new pods before it stamps the resume, seen here.) Both
    times are whole seconds (the API's timestamps), so a deletion in the second of the resume
    counts as the suspension's: a suspend and resume within one second were otherwise read as a
    pod deleted after the resume, and the unit recreated (seen in e2e)."""
    return bool(deleted_at and job.resumed and deleted_at <= job.resumed)


def observe_unit(
    job: JobView,
    pods: Iterable[PodView],
    nodes: Mapping[str, bool] | None,
    deleted_pods: Mapping[str, float] | Iterable[str] = (),
) -> ObservedUnit:
    """One unit as the planner sees it. `nodes` maps node name -> Ready (None: nodes unknown,
    e.g. no permission; node signals are then skipped). `deleted_pods`: names of this unit's
    pods seen deleted while the Job was alive (a mapping: name -> when its deletion was asked)."""
    mine = [
        p
        for p in pods
        if p.unit == job.name
        and p.attempt == job.attempt
        and (not job.uid or not p.job_uid or p.job_uid == job.uid)
        and not _suspension_leftover(p.deleted_at, job)
    ]
    when = deleted_pods if isinstance(deleted_pods, Mapping) else {}
    deleted = [n for n in deleted_pods if not _suspension_leftover(when.get(n, 0.0), job)]

    def unit(
        phase: Any,
        failure: str | None = None,
        message: str = "",
        ready: bool = False,
        disruption_reason: str = "",
    ) -> ObservedUnit:
        return ObservedUnit(
            name=job.name,
            group=job.group,
            index=job.index,
            attempt=job.attempt,
            phase=phase,
            ready=ready,
            failure=failure,
            message=message,
            since=job.created,
            disruption_reason=disruption_reason,
            queue=job.queue,
            spare=job.spare,
        )

    if job.terminating:
        return unit("Terminating")
    if job.suspended:
        return unit("Suspended")
    for pod in mine:
        if pod.disrupted:
            return unit(
                "Failed",
                DISRUPTION_TARGET,
                f"pod {pod.name}: {pod.message}",
                disruption_reason=pod.disruption_reason,
            )
    if job.failed:
        return unit("Failed", JOB_FAILED, job.message)
    if job.complete:
        return unit("Succeeded")
    for pod in mine:
        if pod.phase == "Failed":
            return unit("Failed", POD_FAILED, f"pod {pod.name}: {pod.message}")
    if nodes is not None:
        for pod in mine:
            if pod.node and pod.node not in nodes:
                return unit("Running", NODE_DELETED, f"node {pod.node} of pod {pod.name} is gone")
            if pod.node and not nodes[pod.node]:
                return unit(
                    "Running", NODE_NOT_READY, f"node {pod.node} of pod {pod.name} is NotReady"
                )
    for pod in mine:
        if pod.terminating:
            return unit("Running", POD_DELETED, f"pod {pod.name} is being deleted")
    gone = sorted(set(deleted))
    if gone:
        return unit("Running", POD_DELETED, f"pod {gone[0]} was deleted")
    running = [p for p in mine if p.phase == "Running"]
    if len(running) >= job.hosts:
        return unit("Running", ready=all(p.ready for p in running))
    return unit("Pending")
