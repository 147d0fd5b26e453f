"""A home syncer reached from other clusters through a Gateway API route (`syncer.expose.gateway`):
the route the operator makes for each kind, the Service behind it, the certificate's names and
what the NetworkPolicy admits."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography import x509
from diloco_operator.api import parse_spec
from diloco_operator.k8s import builders
from diloco_operator.k8s.netpolicy import OperatorIdentity, syncer_network_policy

HOST = "syncer.run.example.internal"


def gateway_run(kind: str = "TLSRoute", **route: Any) -> builders.Run:
    spec = parse_spec(
        {
            "image": "t",
            "training": {"totalSteps": 10},
            "syncer": {
                "tls": {},
                "expose": {
                    "type": "Gateway",
                    "gateway": {
                        "parentRef": {"name": "gw", "namespace": "infra", "sectionName": "tls"},
                        "hostname": HOST,
                        "kind": kind,
                        **route,
                    },
                },
            },
        }
    )
    return builders.Run("r", "ml", "uid", spec)


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_a_tls_route_passes_the_syncers_own_tls_through_by_sni() -> None:
    objs = builders.run_objects(gateway_run())
    (route,) = of_kind(objs, "TLSRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["name"] == "r-syncer"
    assert route["metadata"]["ownerReferences"][0]["uid"] == "uid"  # goes with the run
    assert route["spec"] == {
        "parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "tls"}],
        "hostnames": [HOST],
        "rules": [{"backendRefs": [{"name": "r-syncer", "port": 8470}]}],
    }
    assert not of_kind(objs, "HTTPRoute")
    # The Service stays in-cluster; the Gateway is the way in.
    (service,) = of_kind(objs, "Service")
    assert "type" not in service["spec"]
    assert all("appProtocol" not in p for p in service["spec"]["ports"])
    # The route's Service is created before it, and the route before any syncer pod.
    kinds = [o["kind"] for o in objs]
    assert kinds.index("Service") < kinds.index("TLSRoute") < kinds.index("Deployment")


def test_the_operator_made_certificate_names_the_routes_hostname() -> None:
    objs = builders.run_objects(gateway_run())
    (secret,) = [o for o in of_kind(objs, "Secret") if o["type"] == "kubernetes.io/tls"]
    cert = x509.load_pem_x509_certificate(secret["stringData"]["tls.crt"].encode())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert HOST in dns and "r-syncer.ml.svc" in dns


def test_an_http_route_carries_the_protocol_only_and_the_gateway_speaks_https_onwards() -> None:
    objs = builders.run_objects(gateway_run("HTTPRoute"))
    (route,) = of_kind(objs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    assert rule["backendRefs"] == [{"name": "r-syncer", "port": 8470}]
    (service,) = of_kind(objs, "Service")
    assert [p["appProtocol"] for p in service["spec"]["ports"]] == ["HTTPS"]
    assert "type" not in service["spec"]


def test_the_policy_admits_the_gateways_proxies_or_any_source_when_unsaid() -> None:
    def from_outside(run: builders.Run) -> list[str]:
        policy = syncer_network_policy(run, OperatorIdentity("ops"))
        peers = [f for r in policy["spec"]["ingress"] for f in r["from"]]
        return [p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p]

    ranged = gateway_run(sourceRanges=["10.129.0.0/23"])
    assert from_outside(ranged) == ["10.129.0.0/23"]
    assert from_outside(gateway_run()) == ["0.0.0.0/0", "::/0"]


def test_no_route_without_a_gateway() -> None:
    for expose in (None, {"type": "LoadBalancer"}, {"type": "ClusterIP"}):
        syncer: dict[str, Any] = {"tls": {}}
        if expose is not None:
            syncer["expose"] = expose
        spec = parse_spec({"image": "t", "training": {"totalSteps": 10}, "syncer": syncer})
        kinds = {o["kind"] for o in builders.run_objects(builders.Run("r", "ml", "u", spec))}
        assert not kinds & {"TLSRoute", "HTTPRoute"}


@pytest.mark.parametrize(
    "expose",
    [
        {"type": "Gateway"},
        {"type": "LoadBalancer", "gateway": {"parentRef": {"name": "gw"}, "hostname": HOST}},
    ],
)
def test_a_gateway_route_goes_with_type_gateway_only(expose: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"syncer\.expose\.gateway"):
        parse_spec(
            {
                "image": "t",
                "training": {"totalSteps": 10},
                "syncer": {"tls": {}, "expose": expose},
            }
        )
