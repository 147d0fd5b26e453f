"""Kubernetes -> planner adapters: the mapping of Jobs/Pods/Nodes to ObservedUnits for every
failure signal, the syncer poll over real HTTP, and one handler pass wired end to end with the
cluster calls recorded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from diloco_operator.k8s import handlers, kube, state, syncer_calls
from diloco_operator.k8s.main import parse_args
from diloco_operator.k8s.observe import job_view, node_ready, observe_unit, pod_view
from diloco_operator.k8s.syncer_shards import SyncerDeployment
from diloco_trainer.auth import unit_token

T = "2026-01-01T00:00:00Z"


def job(
    attempt: int = 1,
    hosts: int = 2,
    conditions: list[dict[str, str]] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": "r-v6e-0",
        "creationTimestamp": T,
        "labels": {
            "diloco.dev/group": "v6e",
            "diloco.dev/index": "0",
            "diloco.dev/attempt": str(attempt),
        },
    }
    if deleting:
        meta["deletionTimestamp"] = T
    return {
        "metadata": meta,
        "spec": {"completions": hosts},
        "status": {"conditions": conditions or []},
    }


def pod(
    i: int,
    phase: str = "Running",
    ready: bool = True,
    node: str = "n1",
    attempt: int = 1,
    extra: list[dict[str, str]] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}, *(extra or [])]
    meta: dict[str, Any] = {
        "name": f"r-v6e-0-{i}",
        "labels": {"diloco.dev/unit": "r-v6e-0", "diloco.dev/attempt": str(attempt)},
    }
    if deleting:
        meta["deletionTimestamp"] = T
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {"phase": phase, "conditions": conditions},
    }


NODES = {"n1": True, "n2": True}


def observe(
    j: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: dict[str, bool] | None = None,
    deleted: tuple[str, ...] = (),
) -> Any:
    return observe_unit(
        job_view(j), [pod_view(p) for p in pods], NODES if nodes is None else nodes, deleted
    )


def test_healthy_unit_is_running_and_ready() -> None:
    o = observe(job(), [pod(0), pod(1, node="n2")])
    assert (o.phase, o.ready, o.failure, o.attempt, o.group, o.index) == (
        "Running",
        True,
        None,
        1,
        "v6e",
        0,
    )
    assert o.since > 0


def test_partially_started_unit_is_pending() -> None:
    assert observe(job(), [pod(0), pod(1, phase="Pending", ready=False)]).phase == "Pending"
    assert observe(job(), [pod(0)]).phase == "Pending"
    # pods of an older attempt never count for the current one
    assert observe(job(), [pod(0), pod(1, attempt=0)]).phase == "Pending"


@pytest.mark.parametrize(
    ("j", "pods", "nodes", "deleted", "failure"),
    [
        (job(), [pod(0), pod(1, phase="Failed", ready=False)], None, (), "PodFailed"),
        (
            job(),
            [
                pod(0),
                pod(
                    1,
                    extra=[
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                        }
                    ],
                ),
            ],
            None,
            (),
            "DisruptionTarget",
        ),
        (
            job(
                conditions=[{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
            ),
            [pod(0)],
            None,
            (),
            "JobFailed",
        ),
        (job(), [pod(0), pod(1, node="n2")], {"n1": True, "n2": False}, (), "NodeNotReady"),
        (job(), [pod(0), pod(1, node="gone")], None, (), "NodeDeleted"),
        (job(), [pod(0), pod(1, deleting=True)], None, (), "PodDeleted"),
        (job(), [pod(0)], None, ("r-v6e-0-1",), "PodDeleted"),
    ],
)
def test_every_failure_signal_is_mapped(
    j: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: dict[str, bool] | None,
    deleted: tuple[str, ...],
    failure: str,
) -> None:
    o = observe(j, pods, nodes, deleted)
    assert o.failure == failure
    assert o.message


def test_terminating_and_completed_jobs() -> None:
    assert observe(job(deleting=True), [pod(0)]).phase == "Terminating"
    done = observe(job(conditions=[{"type": "Complete", "status": "True"}]), [])
    assert done.phase == "Succeeded" and done.failure is None


def test_node_readiness() -> None:
    assert node_ready({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert not node_ready({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    assert not node_ready({})


STATUS = {
    "run": "r",
    "outerStep": 12,
    "steps": 4800,
    "tokens": 9830400,
    "loss": 2.31,
    "trainLoss": 2.4,
    "complete": False,
    "time": 1.0,
    "learners": {
        "r-v6e-0": {
            "attempt": 1,
            "group": "v6e",
            "lastHeartbeat": 1.0,
            "ageSeconds": 1.5,
            "step": 1200,
        }
    },
}


def test_syncer_report_over_real_http() -> None:
    async def scenario() -> tuple[Any, Any]:
        seen: list[str] = []

        async def status(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Authorization", ""))
            if request.headers.get("Authorization") != "Bearer s3cret":
                return web.Response(status=401)
            return web.json_response(STATUS)

        app = web.Application()
        app.router.add_get("/v1/status", status)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        run = handlers.builders.Run(
            "r", "ns", "u", handlers.parse_spec({"image": "t", "training": {"totalSteps": 5}})
        )
        state.STATE.options = state.Options(syncer_url=f"http://127.0.0.1:{port}")
        state.STATE.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            state.STATE.tokens[("ns", "r")] = "s3cret"
            good = await syncer_calls.syncer_report(run)
            answering_since = state.STATE.reach[("ns", "r")].since
            await syncer_calls.syncer_report(run)
            # a stretch of answers keeps its start
            assert state.STATE.reach[("ns", "r")].since == answering_since is not None
            state.STATE.tokens[("ns", "r")] = "wrong"
            bad = await syncer_calls.syncer_report(run)
            assert state.STATE.reach[("ns", "r")].since is None
            await runner.cleanup()
            down = await syncer_calls.syncer_report(run)  # unreachable: tolerated
        finally:
            await state.STATE.http.close()
            state.STATE.http = None
            state.STATE.tokens.clear()
            state.STATE.reach.clear()
        assert seen == ["Bearer s3cret", "Bearer s3cret", "Bearer wrong"]
        assert down is None
        return good, bad

    good, bad = asyncio.run(scenario())
    assert bad is None
    assert (good.outer_step, good.tokens, good.loss, good.complete) == (12, 9830400, 2.31, False)
    assert good.learners["r-v6e-0"].age_seconds == 1.5


class Store(list[Any]):
    """Stands in for a kopf index store: an iterable of values."""


def test_one_pass_creates_children_then_writes_status_once(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    patched: list[dict[str, Any]] = []
    events: list[str] = []

    secrets: dict[str, str] = {}

    async def fake_create(obj: dict[str, Any], run_uid: str) -> bool:
        created.append(f"{obj['kind']}/{obj['metadata']['name']}")
        if obj["kind"] == "Secret":
            secrets[obj["metadata"]["name"]] = obj["stringData"]["token"]
        return True

    async def fake_patch(namespace: str, name: str, status: dict[str, Any]) -> None:
        json.dumps(status)  # must be JSON-serializable as sent
        patched.append(status)

    async def read_created_token(namespace: str, secret: str, key: str) -> str | None:
        return secrets.get(secret)

    monkeypatch.setattr(kube, "create", fake_create)
    monkeypatch.setattr(kube, "patch_status", fake_patch)
    monkeypatch.setattr(kube, "read_token", read_created_token)
    monkeypatch.setattr(
        handlers.kopf, "event", lambda body, type, reason, message: events.append(reason)
    )
    body = {
        "metadata": {"generation": 3},
        "spec": {"image": "t", "replicas": 2, "training": {"totalSteps": 5}},
    }
    indexes = {
        "learner_jobs": {},
        "learner_pods": {},
        "syncer_deployments": {},
        "cluster_nodes": {},
    }
    plan1, status = asyncio.run(handlers.reconcile_once("r", "ns", "uid", body, None, indexes))
    assert plan1 is not None and status is not None
    assert created == [
        "Secret/r-token",
        "ConfigMap/r-config",
        "PersistentVolumeClaim/r-checkpoints",
        "Service/r-syncer",
        "PodDisruptionBudget/r-syncer",
        "Deployment/r-syncer",
        "Service/r-default-0",
        "Secret/r-default-0-token",
        "Job/r-default-0",
        "Service/r-default-1",
        "Secret/r-default-1-token",
        "Job/r-default-1",
    ]
    assert secrets["r-default-1-token"] == unit_token(secrets["r-token"], "r-default-1")
    assert (
        len(patched) == 1
        and patched[0]["observedGeneration"] == 3
        and patched[0]["phase"] == "Pending"
    )
    # Second pass with the children now observed: nothing created, status unchanged -> no write.
    jobs = {
        ("ns", "r"): Store(
            job_view(j)
            for j in (
                {
                    **job(attempt=0),
                    "metadata": {
                        **job(attempt=0)["metadata"],
                        "name": f"r-default-{i}",
                        "labels": {
                            "diloco.dev/group": "default",
                            "diloco.dev/index": str(i),
                            "diloco.dev/attempt": "0",
                        },
                    },
                }
                for i in range(2)
            )
        )
    }
    indexes2 = {
        **indexes,
        "learner_jobs": jobs,
        "syncer_deployments": {("ns", "r"): Store([SyncerDeployment(False, 1)])},
    }
    created.clear()
    plan2, _ = asyncio.run(handlers.reconcile_once("r", "ns", "uid", body, status, indexes2))
    assert created == [] and plan2 is not None and plan2.actions == ()
    assert len(patched) == 1, [p["conditions"] for p in patched]


def test_invalid_spec_is_reported_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    warned: list[str] = []
    monkeypatch.setattr(handlers.kopf, "warn", lambda body, reason, message: warned.append(message))
    body = {"metadata": {}, "spec": {"image": "", "training": {"totalSteps": 5}}}
    result = asyncio.run(handlers.reconcile_once("r", "ns", "u", body, None, {}))
    assert result == (None, None)
    assert "spec.image" in warned[0]


def test_cli_options() -> None:
    args = parse_args(["-n", "a", "-n", "b", "--peering", "diloco", "--priority", "10"])
    assert args.namespace == ["a", "b"] and args.peering == "diloco" and args.priority == 10
    assert parse_args([]).liveness.endswith("/healthz")
    with pytest.raises(SystemExit):
        parse_args(["--poll-interval", "0"])
    with pytest.raises(SystemExit):
        parse_args(["-A", "-n", "x"])


def test_operator_imports_without_jax() -> None:
    """The operator image has no JAX: importing every operator module must not pull it in."""
    import subprocess
    import sys

    code = (
        "import sys, diloco_operator.k8s.main, diloco_operator.api.crdgen;"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_leftover_pods_of_a_recreated_run_do_not_count() -> None:
    """Delete + re-apply a run: the old Job's terminating pods carry the same unit name and
    attempt, but another controller-uid; they must not be taken as signals of the new unit."""
    new_job = job(attempt=0, hosts=1)
    new_job["metadata"]["uid"] = "new-uid"
    old_pod = pod(0, attempt=0, deleting=True)
    old_pod["metadata"]["labels"]["batch.kubernetes.io/controller-uid"] = "old-uid"
    fresh = pod(0, attempt=0)
    fresh["metadata"]["labels"]["batch.kubernetes.io/controller-uid"] = "new-uid"
    o = observe(new_job, [old_pod, fresh])
    assert (o.phase, o.ready, o.failure) == ("Running", True, None)
    # the same leftover pod under the new Job's uid is a real deletion signal
    old_pod["metadata"]["labels"]["batch.kubernetes.io/controller-uid"] = "new-uid"
    assert observe(new_job, [old_pod]).failure == "PodDeleted"


def test_a_run_is_woken_by_what_its_user_changes_not_by_its_status() -> None:
    """Each pass writes the status it computed; were that write to wake the next pass at once,
    a status that changes every pass (an away run's lastContact) would make a busy loop."""
    event = asyncio.Event()
    state.STATE.wakers[("ns", "r")] = event
    body: dict[str, Any] = {"metadata": {"generation": 1, "labels": {"a": "1"}}, "status": {}}

    def woken_by(change: dict[str, Any]) -> bool:
        body.update(change)
        event.clear()
        handlers.run_changed(namespace="ns", name="r", body=body)
        return event.is_set()

    try:
        assert woken_by({})  # first sighting
        assert not woken_by({"status": {"syncer": {"lastContact": "2026-12-05T15:00:00Z"}}})
        assert not woken_by({"status": {"syncer": {"lastContact": "2026-12-05T15:00:02Z"}}})
        assert woken_by({"metadata": {"generation": 2, "labels": {"a": "1"}}})  # kubectl scale
        assert woken_by({"metadata": {"generation": 2, "labels": {"a": "2"}}})  # a queue label
        assert not woken_by({"status": {"phase": "Running"}})
    finally:
        state.STATE.wakers.clear()
        state.STATE.intents.clear()
