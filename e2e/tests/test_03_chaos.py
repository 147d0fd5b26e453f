"""Chaos on a real control plane with examples/gke-tpu-v6e.yaml (two exclusive v6e 2x4 slices,
short restart backoff): a unit's pod Failed, a node NotReady, the syncer pod deleted, scale up and
down, the operator SIGKILLed mid-change, and finally garbage collection of every child.

The tests run in file order on one run and each leaves it healthy (every unit Online)."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
from conftest import Operator, say, wait_for
from runs import (
    NODEPOOL_LABEL,
    all_units_online,
    apply,
    condition,
    env_of,
    events,
    example,
    items,
    job_attempt,
    jobs,
    live_jobs,
    node_of,
    pods_of,
    run_selector,
    running,
    status,
    unit_status,
)

from e2e.cluster.harness import NODE_NOT_READY_LABEL

RUN = "v6e-100m"
BACKOFF_S = 2
FAILURE_REASONS = {"PodFailed", "JobFailed", "DisruptionTarget"}


def unit(i: int) -> str:
    return f"{RUN}-v6e-{i}"


@pytest.fixture(scope="module")
def run(cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str) -> str:
    doc = example(
        "gke-tpu-v6e",
        replicas=2,
        failurePolicy={"restartBackoffSeconds": BACKOFF_S, "maxUnitRestarts": 20},
    )
    apply(cluster, namespace, doc)
    wait_for("2 units Online", lambda: all_units_online(cluster, namespace, RUN, 2), timeout=90)
    return RUN


def healthy(cluster: Any, namespace: str, n: int) -> bool:
    """Every unit Online, and exactly one live Job per unit."""
    return (
        all_units_online(cluster, namespace, RUN, n)
        and len(live_jobs(cluster, namespace, RUN)) == n
    )


def running_pods(cluster: Any, namespace: str, name: str, attempt: int) -> list[dict[str, Any]]:
    pods = [p for p in pods_of(cluster, namespace, name, attempt) if running(p)]
    return pods if len(pods) == 2 else []


def test_exclusive_slices(cluster: Any, namespace: str, run: str) -> None:
    pools: dict[str, set[str]] = {}
    for i in range(2):
        pods = wait_for(
            f"{unit(i)} pods Running", partial(running_pods, cluster, namespace, unit(i), 0)
        )
        pools[unit(i)] = {
            node_of(cluster, p["spec"]["nodeName"])["metadata"]["labels"][NODEPOOL_LABEL]
            for p in pods
        }
        affinity = pods[0]["spec"]["affinity"]
        assert (
            affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
                "topologyKey"
            ]
            == NODEPOOL_LABEL
        )
    for name, job in live_jobs(cluster, namespace, RUN).items():
        spec = job["spec"]
        assert spec["completions"] == spec["parallelism"] == 2, name  # 2x4 = 2 hosts x 4 chips
        (container,) = spec["template"]["spec"]["containers"]
        res = container["resources"]
        assert res["requests"] == {"cpu": "8", "memory": "64Gi", "google.com/tpu": "4"}, name
        assert res["limits"] == {"google.com/tpu": "4"}, name
        assert (
            spec["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
        )
    # Both hosts of a slice in one node pool; the two slices in different pools.
    assert all(len(p) == 1 for p in pools.values()), pools
    assert pools[unit(0)] != pools[unit(1)], pools


def _wait_offline(cluster: Any, namespace: str, name: str, reasons: set[str]) -> dict[str, Any]:
    def offline() -> dict[str, Any] | None:
        u = unit_status(cluster, namespace, RUN).get(name)
        if u and u["state"] in ("Offline", "Recreating") and u.get("lastFailure"):
            return u
        return None

    u = wait_for(f"{name} Offline with lastFailure", offline, timeout=30, every=0.1)
    assert u["lastFailure"]["reason"] in reasons, u
    return u


def _wait_replaced(cluster: Any, namespace: str, name: str, attempt: int) -> dict[str, Any]:
    def replaced() -> dict[str, Any] | None:
        job = live_jobs(cluster, namespace, RUN).get(name)
        return job if job and job_attempt(job) == attempt else None

    job = wait_for(f"{name} Job with attempt {attempt}", replaced, timeout=60)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["DILOCO_ATTEMPT"] == str(attempt)
    assert job["spec"]["template"]["metadata"]["labels"]["diloco.dev/attempt"] == str(attempt)
    return job


def test_pod_failed_unit_offline_then_recreated(cluster: Any, namespace: str, run: str) -> None:
    victim = unit(0)
    before = unit_status(cluster, namespace, RUN)[victim]
    attempt = before["attempt"]
    pod = running_pods(cluster, namespace, victim, attempt)[0]["metadata"]["name"]
    patch = {"status": {"phase": "Failed", "reason": "Error", "message": "e2e: learner crashed"}}
    cluster.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    u = _wait_offline(cluster, namespace, victim, FAILURE_REASONS)
    assert u["attempt"] == attempt
    st = status(cluster, namespace, RUN)
    degraded = condition(st, "Degraded")
    assert degraded and degraded["status"] == "True", st.get("conditions")
    evs = wait_for("UnitOffline event", lambda: events(cluster, namespace, RUN, "UnitOffline"))
    assert any(victim in e["message"] and e["type"] == "Warning" for e in evs), evs

    _wait_replaced(cluster, namespace, victim, attempt + 1)
    wait_for("units Online again", lambda: healthy(cluster, namespace, 2), timeout=60)
    after = unit_status(cluster, namespace, RUN)[victim]
    assert after["attempt"] == attempt + 1 and after["restarts"] == before["restarts"] + 1
    assert after["lastFailure"]["reason"] in FAILURE_REASONS
    assert wait_for(
        "Degraded cleared",
        lambda: (
            (c := condition(status(cluster, namespace, RUN), "Degraded")) and c["status"] == "False"
        ),
    )
    assert events(cluster, namespace, RUN, "UnitRecreated")


def test_node_not_ready_units_recreated_elsewhere(cluster: Any, namespace: str, run: str) -> None:
    """The slice's node pool goes NotReady (a multi-host slice fails as a whole: both hosts).
    Only one host NotReady would pin the replacement's second pod to the broken host through
    the exclusive-topology pod affinity (it stays Pending until the node recovers)."""
    victim = unit(1)
    attempt = unit_status(cluster, namespace, RUN)[victim]["attempt"]
    pods = wait_for(
        "victim pods Running", lambda: running_pods(cluster, namespace, victim, attempt)
    )
    broken = sorted(p["spec"]["nodeName"] for p in pods)
    for node in broken:
        cluster.kubectl("label", "node", node, f"{NODE_NOT_READY_LABEL}=true")
    try:
        for node in broken:
            wait_for(f"node {node} NotReady", partial(_node_not_ready, cluster, node), timeout=60)
        u = _wait_offline(cluster, namespace, victim, {"NodeNotReady"})
        assert any(node in u["lastFailure"]["message"] for node in broken), u
        _wait_replaced(cluster, namespace, victim, attempt + 1)
        new = wait_for(
            "replacement pods Running",
            lambda: running_pods(cluster, namespace, victim, attempt + 1),
            timeout=90,
        )
        assert not {p["spec"]["nodeName"] for p in new} & set(broken)
        wait_for("units Online again", lambda: healthy(cluster, namespace, 2), timeout=60)
    finally:
        for node in broken:
            cluster.kubectl("label", "node", node, f"{NODE_NOT_READY_LABEL}-")
    # Ready, and seen Ready by the node lifecycle controller: until it lifts its not-ready taint,
    # a pod the scheduler puts there (the scale-up below) is marked not Ready, and KWOK never
    # marks it Ready again.
    for node in broken:
        wait_for(f"node {node} Ready again", partial(_node_ready, cluster, node), timeout=60)
        wait_for(f"node {node} untainted", partial(_node_untainted, cluster, node), timeout=90)


def _node_not_ready(cluster: Any, node: str) -> bool:
    return not _node_ready(cluster, node)


NODE_HEALTH_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def _node_untainted(cluster: Any, node: str) -> bool:
    taints = node_of(cluster, node).get("spec", {}).get("taints") or []
    return not any(t["key"] in NODE_HEALTH_TAINTS for t in taints)


def _node_ready(cluster: Any, node: str) -> bool:
    conds = node_of(cluster, node).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_syncer_pod_deleted_comes_back(cluster: Any, namespace: str, run: str) -> None:
    sel = run_selector(RUN, "syncer")
    first = wait_for(
        "syncer pod Running",
        lambda: [p for p in items(cluster, "pods", namespace, sel) if running(p)],
    )
    old = first[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", old, "-n", namespace, "--wait=false")

    def back() -> list[dict[str, Any]]:
        return [
            p
            for p in items(cluster, "pods", namespace, sel)
            if running(p) and p["metadata"]["name"] != old
        ]

    wait_for("a new syncer pod Running", back, timeout=60)
    deploy = cluster.kubectl_json("get", "deploy", f"{RUN}-syncer", "-n", namespace)
    wait_for(
        "syncer Deployment available",
        lambda: (
            cluster.kubectl_json("get", "deploy", f"{RUN}-syncer", "-n", namespace)["status"].get(
                "availableReplicas"
            )
            == 1
        ),
    )
    assert deploy["spec"]["replicas"] == 1


def _uids(cluster: Any, namespace: str) -> dict[str, str]:
    return {n: j["metadata"]["uid"] for n, j in live_jobs(cluster, namespace, RUN).items()}


def test_scale_up_then_down_removes_the_highest_index(
    cluster: Any, namespace: str, run: str
) -> None:
    before = _uids(cluster, namespace)
    assert set(before) == {unit(0), unit(1)}
    cluster.kubectl("scale", f"dlr/{RUN}", "-n", namespace, "--replicas=3")
    wait_for("3 units Online", lambda: healthy(cluster, namespace, 3), timeout=90)
    after_up = _uids(cluster, namespace)
    assert {k: after_up[k] for k in before} == before  # untouched
    assert status(cluster, namespace, RUN)["replicas"] == 3

    cluster.kubectl("scale", f"dlr/{RUN}", "-n", namespace, "--replicas=2")
    wait_for(f"{unit(2)} removed", lambda: unit(2) not in jobs(cluster, namespace, RUN), timeout=60)
    wait_for("2 units Online", lambda: healthy(cluster, namespace, 2), timeout=30)
    assert _uids(cluster, namespace) == before
    assert status(cluster, namespace, RUN)["replicas"] == 2
    assert not items(cluster, "svc", namespace, f"diloco.dev/unit={unit(2)}")


def _children(cluster: Any, namespace: str) -> dict[str, list[str]]:
    kinds = ["jobs", "svc", "deploy", "secrets", "configmaps"]
    return {
        k: sorted(o["metadata"]["name"] for o in items(cluster, k, namespace, run_selector(RUN)))
        for k in kinds
    }


def test_operator_sigkilled_mid_change_no_duplicates(
    cluster: Any, namespace: str, run: str, operator: Operator
) -> None:
    before = _uids(cluster, namespace)
    token = cluster.kubectl_json("get", "secret", f"{RUN}-token", "-n", namespace)["data"]["token"]
    cluster.kubectl("scale", f"dlr/{RUN}", "-n", namespace, "--replicas=4")
    # Kill it while it reacts to the scale (the new Jobs may or may not exist yet).
    wait_for(
        "the operator to start on the change",
        lambda: unit(2) in jobs(cluster, namespace, RUN) or None,
        timeout=30,
        every=0.05,
    )
    operator.kill()
    say("operator SIGKILLed mid-change; restarting")
    operator.start()
    wait_for(
        "4 units Online after the restart", lambda: healthy(cluster, namespace, 4), timeout=120
    )
    after = _uids(cluster, namespace)
    assert {k: after[k] for k in before} == before, "a surviving unit was recreated"
    children = _children(cluster, namespace)
    units = [unit(i) for i in range(4)]
    assert children["jobs"] == units
    assert children["svc"] == sorted([*units, f"{RUN}-syncer"])
    assert children["deploy"] == [f"{RUN}-syncer"]
    # the run secret and one token per unit, each once
    assert children["secrets"] == sorted([f"{RUN}-token", *(f"{u}-token" for u in units)])
    assert children["configmaps"] == [f"{RUN}-config"]
    assert [u["name"] for u in status(cluster, namespace, RUN)["units"]].count(unit(3)) == 1
    same = cluster.kubectl_json("get", "secret", f"{RUN}-token", "-n", namespace)["data"]["token"]
    assert same == token, "the restarted operator replaced the run's token"

    cluster.kubectl("scale", f"dlr/{RUN}", "-n", namespace, "--replicas=1")
    wait_for(
        "scaled down to 1", lambda: set(jobs(cluster, namespace, RUN)) == {unit(0)}, timeout=60
    )
    assert _uids(cluster, namespace)[unit(0)] == before[unit(0)]


def test_deleting_the_run_garbage_collects_every_child(
    cluster: Any, namespace: str, run: str
) -> None:
    cluster.kubectl("delete", "dlr", RUN, "-n", namespace, "--wait=false")
    kinds = "jobs,pods,svc,deploy,replicasets,secrets,configmaps,pvc"

    def leftovers() -> list[str]:
        return cluster.kubectl(
            "get", kinds, "-n", namespace, "-l", run_selector(RUN), "-o", "name"
        ).stdout.split()

    wait_for("every child of the run gone", lambda: not leftovers() or None, timeout=120)
    wait_for(
        "the run gone",
        lambda: cluster.kubectl("get", "dlr", RUN, "-n", namespace, check=False).returncode != 0,
        timeout=60,
    )
