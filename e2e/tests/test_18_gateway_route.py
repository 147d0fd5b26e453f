"""A syncer reached from other clusters through a Gateway API route (`syncer.expose.gateway`), on a
real control plane with the chart's RBAC and the Gateway API's own CRDs (standard channel, from
the Go module proxy: e2e/cluster/build.sh gatewayapi). In order:

1. without the Gateway API in the cluster, the run says so (ChildrenCreated=False naming the
   CRDs to install) and creates no syncer pod: a syncer nobody can reach from outside would
   only hold the run up;
2. once the CRDs are installed the run goes on by itself: a TLSRoute the API server accepted
   under its own schema and rules (parent, SNI hostname, the syncer Service as backend),
   owned by the run, and the syncer Deployment;
3. an HTTPRoute run: accepted too, only the protocol's paths routed, the Service port says HTTPS;
4. deleting the runs removes their routes (owner references, the garbage collector).

No Gateway implementation runs here: what traffic through a Gateway does is the load balancer
path's (test_12), the route's part is what the API server accepts and the operator owns.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from conftest import Operator, kubectl, wait_for
from cryptography import x509
from runs import apply, condition, events, example, items, run_selector, status

from e2e.cluster import harness

RUN = "v6e-100m"
HOST = "syncer.home.example.internal"
CRDS = ("tlsroutes", "httproutes")


def crd_files() -> list[Path]:
    version = harness.read_versions()["GATEWAY_API_VERSION"]
    folder = harness.cache_root() / f"gateway-api-{version}" / "crds"
    files = [folder / f"gateway.networking.k8s.io_{plural}.yaml" for plural in CRDS]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        pytest.fail(
            f"the Gateway API CRDs are not built (bash e2e/cluster/build.sh gatewayapi): {missing}"
        )
    return files


def gateway_run(name: str, kind: str) -> dict[str, Any]:
    doc = example(
        "gke-tpu-v6e",
        replicas=1,
        syncer={
            "tls": {},
            "expose": {
                "type": "Gateway",
                "gateway": {
                    "parentRef": {"name": "internal", "namespace": "infra", "sectionName": "tls"},
                    "hostname": HOST,
                    "kind": kind,
                },
            },
        },
    )
    doc["metadata"]["name"] = name
    return doc


def route(c: harness._ClusterBase, ns: str, kind: str, run: str) -> dict[str, Any] | None:
    found = items(c, kind.lower() + "s.gateway.networking.k8s.io", ns, run_selector(run))
    return found[0] if found else None


@pytest.fixture
def gateway_crds(cluster: harness._ClusterBase) -> Any:
    """Installs the route CRDs for the test and removes them after: the other modules run on
    a cluster without the Gateway API."""
    files = crd_files()

    def install() -> None:
        for f in files:
            kubectl(cluster, "apply", "--server-side", "-f", str(f))
        for plural in CRDS:
            kubectl(
                cluster,
                "wait",
                "--for=condition=Established",
                f"crd/{plural}.gateway.networking.k8s.io",
                "--timeout=60s",
            )

    yield install
    for plural in CRDS:
        kubectl(cluster, "delete", "crd", f"{plural}.gateway.networking.k8s.io", check=False)


def test_a_gateway_route_is_refused_without_the_crds_then_made_once_they_are_installed(
    cluster: harness._ClusterBase,
    operator: Operator,
    tpu_nodes: Any,
    namespace: str,
    gateway_crds: Any,
) -> None:
    ns = namespace
    apply(cluster, ns, gateway_run(RUN, "TLSRoute"))

    def refused() -> dict[str, Any] | None:
        c = condition(status(cluster, ns, RUN), "ChildrenCreated")
        return c if c and c["status"] == "False" else None

    cond = wait_for("ChildrenCreated=False for the missing Gateway API", refused, 60)
    assert cond["reason"] == "ChildRejected", cond
    assert f"TLSRoute {RUN}-syncer" in cond["message"], cond
    assert "install the Gateway API CRDs" in cond["message"], cond
    assert events(cluster, ns, RUN, "ChildRejected")
    # Nothing after the refused route: no syncer that could not be reached anyway.
    assert not items(cluster, "deployments", ns, run_selector(RUN, "syncer"))

    gateway_crds()
    made = wait_for("the TLSRoute", lambda: route(cluster, ns, "TLSRoute", RUN), 60)
    wait_for(
        "ChildrenCreated=True",
        lambda: (
            (c := condition(status(cluster, ns, RUN), "ChildrenCreated")) and c["status"] == "True"
        ),
        60,
    )
    wait_for(
        "the syncer Deployment",
        lambda: items(cluster, "deployments", ns, run_selector(RUN, "syncer")),
        60,
    )
    spec = made["spec"]
    assert [p["name"] for p in spec["parentRefs"]] == ["internal"]
    assert spec["parentRefs"][0]["namespace"] == "infra"
    assert spec["parentRefs"][0]["sectionName"] == "tls"
    assert spec["hostnames"] == [HOST]
    (rule,) = spec["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["name"], backend["port"]) == (f"{RUN}-syncer", 8470)
    owner = made["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("DilocoRun", RUN, True)
    service = cluster.kubectl_json("get", "service", f"{RUN}-syncer", "-n", ns)
    assert service["spec"]["type"] == "ClusterIP"  # the Gateway is the way in
    # The operator-made certificate names the route's hostname (the SNI the route matches).
    secret = cluster.kubectl_json("get", "secret", f"{RUN}-syncer-tls", "-n", ns)
    pem = base64.b64decode(secret["data"]["tls.crt"])
    sans = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert HOST in sans.value.get_values_for_type(x509.DNSName)

    # An HTTPRoute run beside it: the Gateway ends TLS and speaks HTTPS to the syncer.
    other = "v6e-http"
    apply(cluster, ns, gateway_run(other, "HTTPRoute"))
    http = wait_for("the HTTPRoute", lambda: route(cluster, ns, "HTTPRoute", other), 60)
    (rule,) = http["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    port = wait_for(
        "its syncer Service",
        lambda: items(cluster, "services", ns, run_selector(other, "syncer")),
        60,
    )[0]["spec"]["ports"][0]
    assert port["appProtocol"] == "HTTPS"

    for run in (RUN, other):
        kubectl(cluster, "delete", "dlr", run, "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(
        "both routes gone with their runs",
        lambda: (
            route(cluster, ns, "TLSRoute", RUN) is None
            and route(cluster, ns, "HTTPRoute", other) is None
        ),
        60,
    )
