"""The chart on a real API server: CRD established, RBAC exactly as narrow as the docs say, and
the operator (running with that ServiceAccount's token) alive and exporting metrics."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from conftest import CRD_NAME, SYSTEM_NS, Operator, crd_established


def test_crd_is_established_with_scale_and_status(cluster: Any, chart: dict[str, str]) -> None:
    assert crd_established(cluster)
    crd = cluster.kubectl_json("get", "crd", CRD_NAME)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    assert version["served"] and version["storage"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert "dlr" in crd["spec"]["names"]["shortNames"]


def _can(cluster: Any, sa: str, verb: str, resource: str, ns: str = "default") -> bool:
    r = cluster.kubectl(
        "auth",
        "can-i",
        verb,
        resource,
        "-n",
        ns,
        f"--as=system:serviceaccount:{SYSTEM_NS}:{sa}",
        check=False,
    )
    return r.stdout.strip() == "yes"


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("create", "jobs.batch", True),
        ("delete", "jobs.batch", True),
        ("watch", "pods", True),
        ("patch", "dilocoruns.diloco.dev/status", True),
        ("create", "secrets", True),
        ("list", "nodes", True),
        # least privilege: nothing the code does not call
        ("create", "pods", False),
        ("delete", "secrets", False),
        ("list", "secrets", False),
        ("update", "deployments.apps", False),
        ("delete", "deployments.apps", False),
        ("patch", "nodes", False),
        ("delete", "dilocoruns.diloco.dev", False),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", False),
    ],
)
def test_service_account_rbac_is_least_privilege(
    cluster: Any, chart: dict[str, str], verb: str, resource: str, allowed: bool
) -> None:
    assert _can(cluster, chart["serviceAccount"], verb, resource) is allowed


def test_operator_runs_with_the_chart_service_account(operator: Operator) -> None:
    if operator.mode != "local":
        pytest.skip("metrics are checked on the local operator process")
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics") as r:
        text = r.read().decode()
    assert "diloco_operator_runs" in text
    # No RBAC denial in its log (kopf logs APIForbiddenError / "forbidden" for a 403).
    log = operator.log_tail(400)
    assert "forbidden" not in log.lower(), log
