"""The operator, hardened: children the API server refuses or whose name is taken are reported
on the run (Event + condition), a 409 is success only for this run's own object, the checkpoint
PVC outlives a deleted run by default, and a run never has more units than its status holds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from crd_schema import openapi_schema
from diloco_operator.api import MAX_UNITS, parse_spec
from diloco_operator.k8s import builders, handlers, kube

SPEC = {"image": "t", "replicas": 2, "training": {"totalSteps": 5}}
EMPTY_INDEXES: dict[str, Any] = {
    "learner_jobs": {},
    "learner_pods": {},
    "syncer_deployments": {},
    "cluster_nodes": {},
}


def child(name: str = "r-token", owner_uid: str | None = "uid-1", run: str = "r") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"diloco.dev/run": run}}
    if owner_uid:
        meta["ownerReferences"] = [{"kind": "DilocoRun", "uid": owner_uid, "controller": True}]
    return {"metadata": meta}


def test_conflict_is_ours_only_when_controlled_by_this_run() -> None:
    wanted = child(owner_uid="uid-1")
    assert kube.ours(child(owner_uid="uid-1"), wanted, "uid-1")
    assert not kube.ours(child(owner_uid="uid-old"), wanted, "uid-1")  # a previous run's
    assert not kube.ours(child(owner_uid=None), wanted, "uid-1")  # someone else's object
    assert not kube.ours({"metadata": {"name": "r-token"}}, wanted, "uid-1")


def test_retained_claim_is_reused_by_the_next_run_of_the_same_name() -> None:
    wanted = child("r-checkpoints", owner_uid=None)
    assert kube.ours(child("r-checkpoints", owner_uid=None), wanted, "uid-2")
    assert kube.ours(child("r-checkpoints", owner_uid="uid-2"), wanted, "uid-2")  # pre-upgrade
    assert not kube.ours(child("r-checkpoints", owner_uid=None, run="other"), wanted, "uid-2")
    assert not kube.ours(child("r-checkpoints", owner_uid="uid-x"), wanted, "uid-2")


def test_checkpoint_claim_is_not_owned_by_the_run_unless_asked() -> None:
    run = builders.Run("r", "ns", "uid-1", parse_spec(SPEC))
    claim = builders.checkpoint_claim(run)
    assert claim is not None and "ownerReferences" not in claim["metadata"]
    assert claim["metadata"]["labels"]["diloco.dev/run"] == "r"
    deleting = parse_spec({**SPEC, "syncer": {"checkpoint": {"retentionPolicy": "Delete"}}})
    owned = builders.checkpoint_claim(builders.Run("r", "ns", "uid-1", deleting))
    assert owned is not None and owned["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    with pytest.raises(ValueError, match="retentionPolicy"):
        parse_spec({**SPEC, "syncer": {"checkpoint": {"retentionPolicy": "Keep"}}})


def test_status_holds_as_many_units_as_admission_allows() -> None:
    schema = openapi_schema()
    units = schema["properties"]["status"]["properties"]["units"]
    assert units["maxItems"] == MAX_UNITS
    assert schema["properties"]["spec"]["properties"]["replicas"]["maximum"] == MAX_UNITS
    parse_spec(
        {**SPEC, "replicas": 600, "unitGroups": [{"name": "a"}, {"name": "b", "replicas": 400}]}
    )
    with pytest.raises(ValueError, match=r"spec\.replicas: the run has 1001 units"):
        parse_spec(
            {**SPEC, "replicas": 600, "unitGroups": [{"name": "a"}, {"name": "b", "replicas": 401}]}
        )


def run_passes(
    monkeypatch: pytest.MonkeyPatch, refuse: dict[str, kube.ChildError], passes: int = 2
) -> tuple[list[Any], list[tuple[str, str, str]], list[str]]:
    """Reconcile passes where creating the named objects fails as given."""
    events: list[tuple[str, str, str]] = []
    created: list[str] = []
    statuses: list[Any] = []

    async def fake_create(obj: dict[str, Any], run_uid: str) -> bool:
        assert run_uid == "uid-1"
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if name in refuse:
            raise refuse[name]
        created.append(name)
        return True

    async def fake_patch(namespace: str, name: str, status: dict[str, Any]) -> None:
        return None

    async def no_token(*_: Any) -> None:
        return None

    async def no_delete(*_: Any) -> None:  # the children are never observed in these passes
        return None

    monkeypatch.setattr(kube, "create", fake_create)
    monkeypatch.setattr(kube, "delete_unit", no_delete)
    monkeypatch.setattr(kube, "patch_status", fake_patch)
    monkeypatch.setattr(kube, "read_token", no_token)
    monkeypatch.setattr(
        handlers.kopf,
        "event",
        lambda body, type, reason, message: events.append((type, reason, message)),
    )
    body = {"metadata": {"generation": 1}, "spec": SPEC}
    status = None
    for _ in range(passes):
        _, status = asyncio.run(
            handlers.reconcile_once("r", "ns", "uid-1", body, status, EMPTY_INDEXES)
        )
        statuses.append(status)
    return statuses, events, created


def test_refused_child_gives_an_event_and_a_condition_and_the_pass_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = kube.ChildError(
        "ChildRejected", "Job", "r-default-1", 'Job.batch "r-default-1" is invalid: spec...'
    )
    statuses, events, created = run_passes(monkeypatch, {"Job/r-default-1": refused})
    # The other children were still created (the refusal did not abort the pass).
    assert "Deployment/r-syncer" in created and "Job/r-default-0" in created
    cond = next(c for c in statuses[-1].conditions if c.type == "ChildrenCreated")
    assert (cond.status, cond.reason) == ("False", "ChildRejected")
    assert "Job r-default-1" in cond.message and "is invalid" in cond.message
    warnings = [e for e in events if e[0] == "Warning" and e[1] == "ChildRejected"]
    assert len(warnings) == 1, events  # posted once, not on every pass
    # The refused unit was never created, so it is not bookkept as existing (nor failing).
    assert [u.name for u in statuses[-1].units] == ["r-default-0"]


def test_name_conflict_is_reported_not_taken_as_success(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = kube.ChildError(
        "NameConflict", "Secret", "r-token", "the name is taken by an object this run does not own"
    )
    statuses, events, created = run_passes(monkeypatch, {"Secret/r-token": taken}, passes=1)
    assert "Secret/r-token" not in created and "Deployment/r-syncer" not in created
    cond = next(c for c in statuses[-1].conditions if c.type == "ChildrenCreated")
    assert (cond.status, cond.reason) == ("False", "NameConflict")
    assert ("Warning", "NameConflict") in [(t, r) for t, r, _ in events]


def test_condition_clears_once_children_are_created(monkeypatch: pytest.MonkeyPatch) -> None:
    statuses, events, _ = run_passes(monkeypatch, {}, passes=1)
    cond = next(c for c in statuses[-1].conditions if c.type == "ChildrenCreated")
    assert (cond.status, cond.reason) == ("True", "Created")
    assert not [e for e in events if e[0] == "Warning"]
