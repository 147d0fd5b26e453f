"""spec.suspend and Kueue: suspending, queueing, eviction and resumption are never failures.

Planner decisions (pure), the Job/Pod mapping of suspended Jobs, the Kueue labels on unit Jobs,
the QueueFound condition, and the local runtime's refusal of a suspended manifest."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from diloco_operator.api import DilocoRunSpec, DilocoRunStatus, parse_spec
from diloco_operator.k8s import builders, kube, queue_status
from diloco_operator.k8s.kueue import job_labels, queue_found_condition, queue_name
from diloco_operator.k8s.observe import job_view, observe_unit, pod_view
from diloco_operator.local.manifest import ManifestError, load_manifest
from diloco_operator.planner import (
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    LearnerStatus,
    ObservedSyncer,
    ObservedUnit,
    Plan,
    ScaleSyncer,
    SuspendUnit,
    SyncerStatus,
    plan,
)
from diloco_operator.planner.model import DISRUPTION_TARGET

T0 = 1_700_000_000.0
SYNCER_UP = ObservedSyncer(present=True, ready=True, replicas=1)
QUEUE = "tpu-queue"


def make_spec(replicas: int = 2, **extra: Any) -> DilocoRunSpec:
    doc: dict[str, Any] = {
        "image": "trainer:dev",
        "replicas": replicas,
        "training": {"totalSteps": 1000},
        "failurePolicy": {"maxUnitRestarts": 2, "offlineAfterSeconds": 30},
    }
    doc.update(extra)
    return parse_spec(doc)


def running(name: str, attempt: int = 0, **kw: Any) -> ObservedUnit:
    fields: dict[str, Any] = {"phase": "Running", "ready": True, "since": T0}
    fields.update(kw)
    return ObservedUnit(name=name, group="default", index=int(name[-1]), attempt=attempt, **fields)


def unit(p: Plan, name: str) -> Any:
    return next(u for u in p.status.units if u.name == name)


def reasons(p: Plan) -> list[str]:
    return [e.reason for e in p.of_type(EmitEvent)]


def condition(p: Plan, type_: str) -> Any:
    return next((c for c in p.status.conditions if c.type == type_), None)


def online(spec: DilocoRunSpec, queue: str = "") -> tuple[list[ObservedUnit], DilocoRunStatus]:
    first = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    observed = [running(c.name, queue=queue) for c in first.of_type(CreateUnit)]
    second = plan("r", spec, observed, first.status, T0 + 1, syncer=SYNCER_UP)
    assert second.status.phase == "Running"
    return observed, second.status


def assert_nothing_counted(p: Plan) -> None:
    for u in p.status.units:
        assert (u.restarts, u.preemptions, u.quick_failures) == (0, 0, 0), u
        assert u.state != "Failed" and u.last_failure is None
    assert "UnitOffline" not in reasons(p) and "UnitPreempted" not in reasons(p)


# -- spec.suspend


def test_suspending_a_run_suspends_jobs_in_place_and_scales_the_syncer_to_zero() -> None:
    spec = make_spec()
    observed, status = online(spec)
    suspended = spec.model_copy(update={"suspend": True})
    p = plan("r", suspended, observed, status, T0 + 5, syncer=SYNCER_UP)
    assert sorted(p.of_type(SuspendUnit), key=lambda a: a.name) == [
        SuspendUnit("r-default-0", True),
        SuspendUnit("r-default-1", True),
    ]
    assert p.of_type(ScaleSyncer) == [ScaleSyncer(0)]
    assert not p.of_type(DeleteUnit) and not p.of_type(CreateUnit)
    assert [u.state for u in p.status.units] == ["Suspended", "Suspended"]
    assert reasons(p).count("UnitSuspended") == 2
    assert p.status.phase == "Suspended"
    assert condition(p, "Suspended").status == "True"
    assert_nothing_counted(p)
    # The Jobs now show suspended, their pods gone, the syncer at 0: a quiet, stable state.
    held = [replace(o, phase="Suspended", ready=False) for o in observed]
    syncer_down = ObservedSyncer(present=True, ready=False, replicas=0)
    again = plan("r", suspended, held, p.status, T0 + 6, syncer=syncer_down)
    assert [a for a in again.actions if not isinstance(a, EmitEvent)] == []
    assert again.status.phase == "Suspended"
    assert_nothing_counted(again)


def test_resuming_unsuspends_the_same_jobs_and_the_syncer_counting_nothing() -> None:
    spec = make_spec()
    observed, status = online(spec)
    suspended = spec.model_copy(update={"suspend": True})
    p = plan("r", suspended, observed, status, T0 + 5, syncer=SYNCER_UP)
    held = [replace(o, phase="Suspended", ready=False) for o in observed]
    syncer_down = ObservedSyncer(present=True, ready=False, replicas=0)
    p = plan("r", spec, held, p.status, T0 + 20, syncer=syncer_down)
    assert sorted(p.of_type(SuspendUnit), key=lambda a: a.name) == [
        SuspendUnit("r-default-0", False),
        SuspendUnit("r-default-1", False),
    ]
    assert p.of_type(ScaleSyncer) == [ScaleSyncer(1)]
    assert not p.of_type(CreateUnit) and not p.of_type(DeleteUnit)
    assert [u.state for u in p.status.units] == ["Pending", "Pending"]
    assert [u.attempt for u in p.status.units] == [0, 0]
    assert condition(p, "Suspended").status == "False"
    # New pods come up (the syncer's old heartbeat of this attempt is older than that): Online.
    stale = SyncerStatus(learners={o.name: LearnerStatus(attempt=0, age_seconds=40) for o in held})
    p = plan("r", spec, observed, p.status, T0 + 21, syncer=SYNCER_UP, report=stale)
    p = plan("r", spec, observed, p.status, T0 + 25, syncer=SYNCER_UP, report=stale)
    assert [u.state for u in p.status.units] == ["Online", "Online"]
    assert p.status.phase == "Running"
    assert_nothing_counted(p)


def test_a_run_created_suspended_creates_nothing_until_resumed() -> None:
    spec = make_spec(suspend=True)
    absent = ObservedSyncer(present=False, ready=False)
    p = plan("r", spec, [], None, T0, syncer=absent)
    assert [a for a in p.actions if not isinstance(a, EmitEvent)] == []
    assert reasons(p) == ["RunSuspended"]
    assert [u.state for u in p.status.units] == ["Suspended", "Suspended"]
    assert p.status.phase == "Suspended"
    p = plan("r", make_spec(), [], p.status, T0 + 1, syncer=absent)
    assert CreateSyncer() in p.actions
    assert sorted(a.name for a in p.of_type(CreateUnit)) == ["r-default-0", "r-default-1"]
    assert_nothing_counted(p)


def test_suspending_a_queued_run_deletes_its_jobs_and_recreates_them_on_resume() -> None:
    # Kueue resumes a suspended Job whose Workload is admitted: deleting gives the quota back.
    spec = make_spec()
    observed, status = online(spec, queue=QUEUE)
    p = plan(
        "r", spec.model_copy(update={"suspend": True}), observed, status, T0 + 5, syncer=SYNCER_UP
    )
    assert sorted(a.name for a in p.of_type(DeleteUnit)) == ["r-default-0", "r-default-1"]
    assert {a.reason for a in p.of_type(DeleteUnit)} == {"RunSuspended"}
    assert not p.of_type(SuspendUnit)
    p = plan("r", spec.model_copy(update={"suspend": True}), [], p.status, T0 + 6, syncer=SYNCER_UP)
    assert not p.of_type(CreateUnit)
    p = plan("r", spec, [], p.status, T0 + 30, syncer=SYNCER_UP)
    assert sorted((a.name, a.attempt) for a in p.of_type(CreateUnit)) == [
        ("r-default-0", 1),
        ("r-default-1", 1),
    ]
    assert_nothing_counted(p)


def test_an_offline_unit_is_not_recreated_while_suspended_and_counts_once_after() -> None:
    spec = make_spec()
    observed, status = online(spec)
    failed = running("r-default-1", failure=DISRUPTION_TARGET)
    p = plan("r", spec, [observed[0], failed], status, T0 + 30, syncer=SYNCER_UP)
    assert unit(p, "r-default-1").state == "Offline"
    suspended = spec.model_copy(update={"suspend": True})
    p = plan("r", suspended, [observed[0]], p.status, T0 + 31, syncer=SYNCER_UP)
    p = plan("r", suspended, [observed[0]], p.status, T0 + 100, syncer=SYNCER_UP)
    assert not p.of_type(CreateUnit)
    assert unit(p, "r-default-1").state == "Offline"
    assert unit(p, "r-default-0").state == "Suspended"
    p = plan("r", spec, [observed[0]], p.status, T0 + 200, syncer=SYNCER_UP)
    recreated = p.of_type(CreateUnit)
    assert [(a.name, a.attempt) for a in recreated] == [("r-default-1", 1)]
    assert unit(p, "r-default-1").restarts == 1
    assert unit(p, "r-default-0").restarts == 0


# -- Kueue: queued, admitted, evicted or preempted, admitted again


def test_a_job_suspended_by_its_queue_is_queued_not_failed_and_left_alone() -> None:
    spec = make_spec()
    first = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    waiting = [
        running(c.name, phase="Suspended", ready=False, queue=QUEUE)
        for c in first.of_type(CreateUnit)
    ]
    p = plan("r", spec, waiting, first.status, T0 + 1, syncer=SYNCER_UP)
    assert [u.state for u in p.status.units] == ["Queued", "Queued"]
    assert reasons(p).count("UnitQueued") == 2
    assert [a for a in p.actions if not isinstance(a, EmitEvent)] == []
    assert p.status.phase == "Queued"
    queued = condition(p, "Queued")
    assert queued.status == "True" and "r-default-0" in queued.message
    # Minutes later, a stale heartbeat of the attempt: still queued, nothing done or counted.
    stale = SyncerStatus(
        learners={o.name: LearnerStatus(attempt=0, age_seconds=900) for o in waiting}
    )
    later = plan("r", spec, waiting, p.status, T0 + 600, syncer=SYNCER_UP, report=stale)
    assert later.actions == () and later.status.phase == "Queued"
    assert_nothing_counted(later)


def test_admission_then_eviction_then_readmission_keeps_the_attempt_and_counts() -> None:
    spec = make_spec()
    observed, status = online(spec, queue=QUEUE)
    # Kueue preempts unit 1: its Job is suspended again (pods deleted by the Job controller).
    evicted = [observed[0], replace(observed[1], phase="Suspended", ready=False)]
    p = plan("r", spec, evicted, status, T0 + 50, syncer=SYNCER_UP)
    assert unit(p, "r-default-1").state == "Queued"
    assert unit(p, "r-default-0").state == "Online"
    assert [a for a in p.actions if not isinstance(a, EmitEvent)] == []
    assert p.status.phase == "Running"  # one unit still trains: decoupled DiLoCo goes on
    assert condition(p, "Queued").status == "True"
    # Readmitted: the same Job (same attempt) runs again and its pods come up.
    pending = [observed[0], replace(observed[1], phase="Pending", ready=False)]
    p = plan("r", spec, pending, p.status, T0 + 90, syncer=SYNCER_UP)
    assert unit(p, "r-default-1").state == "Pending"
    assert "UnitAdmitted" in reasons(p)
    p = plan("r", spec, observed, p.status, T0 + 91, syncer=SYNCER_UP)
    assert unit(p, "r-default-1").state == "Online"
    assert [u.attempt for u in p.status.units] == [0, 0]
    assert condition(p, "Queued").status == "False"
    assert not p.of_type(CreateUnit) and not p.of_type(DeleteUnit)
    assert_nothing_counted(p)


def test_queued_units_keep_a_run_alive_below_quorum_of_online_units() -> None:
    spec = make_spec(training={"totalSteps": 1000, "quorum": 2})
    observed, status = online(spec, queue=QUEUE)
    evicted = [replace(o, phase="Suspended", ready=False) for o in observed]
    p = plan("r", spec, evicted, status, T0 + 50, syncer=SYNCER_UP)
    assert p.status.phase == "Queued"


def test_a_suspended_job_without_a_queue_is_resumed_by_the_operator() -> None:
    spec = make_spec()
    observed, status = online(spec)
    someone = [observed[0], replace(observed[1], phase="Suspended", ready=False)]
    p = plan("r", spec, someone, status, T0 + 5, syncer=SYNCER_UP)
    assert p.of_type(SuspendUnit) == [SuspendUnit("r-default-1", False)]
    assert unit(p, "r-default-1").state == "Online"
    assert_nothing_counted(p)


# -- Kubernetes mapping


def job(suspend: bool = False, resumed: str | None = "2026-01-01T00:01:00Z") -> dict[str, Any]:
    labels = {
        "diloco.dev/group": "default",
        "diloco.dev/index": "0",
        "diloco.dev/attempt": "0",
        "kueue.x-k8s.io/queue-name": QUEUE,
    }
    meta = {
        "name": "r-default-0",
        "uid": "u1",
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "labels": labels,
    }
    # The Job controller's Suspended condition: True while suspended, False once resumed.
    cond = {"type": "Suspended", "status": "False" if resumed else "True"}
    if resumed:
        cond["lastTransitionTime"] = resumed
    status: dict[str, Any] = {"conditions": [cond]}
    return {"metadata": meta, "spec": {"completions": 1, "suspend": suspend}, "status": status}


def pod(name: str, created: str, deleted: str | None = None, grace: int = 30) -> dict[str, Any]:
    """A Running pod of the unit; `deleted`: when its deletion was asked (with `grace`)."""
    meta: dict[str, Any] = {
        "name": name,
        "creationTimestamp": created,
        "labels": {
            "diloco.dev/unit": "r-default-0",
            "diloco.dev/attempt": "0",
            "batch.kubernetes.io/controller-uid": "u1",
        },
    }
    if deleted:
        # The API server stamps deletionTimestamp = request time + grace period.
        at = datetime.fromisoformat(deleted.replace("Z", "+00:00")) + timedelta(seconds=grace)
        meta["deletionTimestamp"] = at.isoformat().replace("+00:00", "Z")
        meta["deletionGracePeriodSeconds"] = grace
    conditions = [{"type": "Ready", "status": "True"}]
    return {
        "metadata": meta,
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "conditions": conditions},
    }


SUSPENDED_AT = "2026-01-01T00:00:40Z"  # the Job controller deletes the pods (grace 30 s)
RESUMED_AT = "2026-01-01T00:01:00Z"  # the Job's Suspended condition turns False


def test_a_suspended_job_is_observed_suspended_with_its_queue_whatever_its_pods_do() -> None:
    leftover = pod_view(pod("r-default-0-0-a", "2026-01-01T00:00:30Z", SUSPENDED_AT))
    o = observe_unit(
        job_view(job(suspend=True, resumed=None)),
        [leftover],
        {"n1": True},
        {"r-default-0-0-a": leftover.deleted_at},
    )
    assert (o.phase, o.failure, o.queue) == ("Suspended", None, QUEUE)


def test_a_job_unsuspended_but_not_yet_resumed_by_its_controller_is_still_suspended() -> None:
    # spec.suspend is false already, the status still says Suspended: the pods of before are
    # still being deleted and must not count as failures (seen on a real control plane).
    unsuspended = {**job(resumed=None), "spec": {"completions": 1, "suspend": False}}
    leftover = pod_view(pod("r-default-0-0-a", "2026-01-01T00:00:30Z", SUSPENDED_AT))
    o = observe_unit(
        job_view(unsuspended), [leftover], {"n1": True}, {"r-default-0-0-a": leftover.deleted_at}
    )
    assert (o.phase, o.failure) == ("Suspended", None)


def test_pods_deleted_by_the_suspension_are_not_failures_after_the_resume() -> None:
    leftover = pod_view(pod("r-default-0-0-a", "2026-01-01T00:00:30Z", SUSPENDED_AT))
    # The new pods may be made a moment before the controller stamps the resume (seen on a real
    # control plane: created 14:29:16, resumed 14:29:17): they are the Job's current pods.
    fresh = pod_view(pod("r-default-0-0-b", "2026-01-01T00:00:59Z"))
    j = job_view(job(resumed=RESUMED_AT))
    deleted = {"r-default-0-0-a": leftover.deleted_at}
    o = observe_unit(j, [leftover, fresh], {"n1": True}, deleted)
    assert (o.phase, o.ready, o.failure) == ("Running", True, None)
    # A pod deleted after the resume is a failure, as before, seen terminating or deleted.
    current = pod_view(pod("r-default-0-0-c", "2026-01-01T00:00:59Z", "2026-01-01T00:01:05Z"))
    assert observe_unit(j, [current], {"n1": True}, {}).failure == "PodDeleted"
    gone = {"r-default-0-0-c": current.deleted_at}
    assert observe_unit(j, [fresh], {"n1": True}, gone).failure == "PodDeleted"


def test_a_resume_in_the_second_of_the_suspension_keeps_the_job() -> None:
    # Timestamps are whole seconds: suspended and resumed within one (an e2e run did, and its
    # units were recreated), the suspension's deletions carry the resume's second.
    leftover = pod_view(pod("r-default-0-0-a", "2026-01-01T00:00:30Z", RESUMED_AT))
    j = job_view(job(resumed=RESUMED_AT))
    o = observe_unit(j, [leftover], {"n1": True}, {"r-default-0-0-a": leftover.deleted_at})
    assert (o.phase, o.failure) == ("Pending", None)
    later = pod_view(pod("r-default-0-0-b", "2026-01-01T00:00:59Z", "2026-01-01T00:01:01Z"))
    assert observe_unit(j, [later], {"n1": True}, {}).failure == "PodDeleted"


def test_unit_jobs_carry_the_runs_kueue_labels_and_start_suspended() -> None:
    spec = make_spec()
    labels = {
        "kueue.x-k8s.io/queue-name": QUEUE,
        "kueue.x-k8s.io/priority-class": "low",
        "team": "x",
    }
    unit_action = CreateUnit("r-default-0", "default", 0, 0, 0, 2, 1)
    queued = builders.unit_job(builders.Run("r", "ns", "uid", spec, labels), unit_action)
    assert queued["spec"]["suspend"] is True
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == QUEUE
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "low"
    assert "team" not in queued["metadata"]["labels"]
    plain = builders.unit_job(builders.Run("r", "ns", "uid", spec), unit_action)
    assert "suspend" not in plain["spec"]
    assert not any(k.startswith("kueue.x-k8s.io/") for k in plain["metadata"]["labels"])
    # A priority class without a queue does not queue anything.
    assert job_labels({"kueue.x-k8s.io/priority-class": "low"}) == {}
    assert queue_name({"kueue.x-k8s.io/queue-name": ""}) is None


def test_queue_found_condition_and_warning() -> None:
    conds, warning = queue_found_condition([], "q", "missing", T0, 1)
    assert warning is not None and "LocalQueue q" in warning and "does not exist" in warning
    assert (conds[0].type, conds[0].status, conds[0].reason) == (
        "QueueFound",
        "False",
        "LocalQueueNotFound",
    )
    conds, warning = queue_found_condition(conds, "q", "no-kueue", T0, 1)
    assert warning is not None and conds[0].reason == "KueueNotInstalled"
    conds, warning = queue_found_condition(conds, "q", "found", T0 + 5, 1)
    assert warning is None and conds[0].status == "True"


def test_report_queue_posts_one_warning_per_new_message(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, str]] = []
    lookups: list[str] = []

    async def missing(namespace: str, name: str) -> str:
        lookups.append(name)
        return "missing"

    monkeypatch.setattr(kube, "local_queue", missing)
    monkeypatch.setattr(
        queue_status.kopf,
        "event",
        lambda body, type, reason, message: posted.append((type, reason)),
    )
    run = builders.Run("r", "ns", "u", make_spec(), {"kueue.x-k8s.io/queue-name": "nope"})
    first = asyncio.run(queue_status.report_queue(run, DilocoRunStatus(), None, {}, 1))
    again = asyncio.run(queue_status.report_queue(run, first, first, {}, 1))
    assert posted == [("Warning", "LocalQueueNotFound")]
    assert lookups == ["nope"]  # the second pass used the cached lookup
    found = next(c for c in again.conditions if c.type == "QueueFound")
    assert found.status == "False" and "nope" in found.message
    plain = builders.Run("r2", "ns", "u", make_spec())
    assert asyncio.run(queue_status.report_queue(plain, first, None, {}, 1)) is first


def test_the_local_runtime_refuses_a_suspended_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        "apiVersion: diloco.dev/v1alpha1\nkind: DilocoRun\nmetadata: {name: r}\n"
        "spec: {image: t, suspend: true, training: {totalSteps: 5}}\n"
    )
    with pytest.raises(ManifestError, match=r"spec\.suspend"):
        load_manifest(manifest)
