"""What the children need for a run that crosses the cluster boundary (docs/multi-cluster.md):
the syncer serving HTTPS from its certificate Secret, learners verifying it with the CA alone
(never the private key), an away run's units joining with tokens derived from its join
credential, and the syncer exposed to other clusters (a load balancer or a Gateway API route)."""

from __future__ import annotations

from typing import Any

from diloco_trainer.auth import unit_token
from diloco_trainer.join_credentials import parse_join_credential, unit_token_from_credential

from diloco_operator.api.clusters import CA_KEY, INTERNAL_LB_ANNOTATION
from diloco_operator.k8s.object_meta import SYNCER, child_meta
from diloco_operator.k8s.run_ref import Run

TLS_DIR = "/var/run/diloco/tls"
CA_DIR = "/var/run/diloco/syncer-ca"
CA_FILE = CA_KEY  # learners see the bundle under the name the Secret gives it at home
# The unit's Secret holds its token and, in an away run, the credential's public part (which
# the learner sends in X-Diloco-Join) under this key.
JOIN_KEY = "join"
# kubernetes.io/tls Secret keys (cert-manager writes these and CA_KEY).
TLS_CERT, TLS_KEY = "tls.crt", "tls.key"
GATEWAY_GROUP = "gateway.networking.k8s.io"
PROTOCOL_PREFIX = "/v1/"  # every path of the learner-syncer protocol (docs/protocol.md)


def ca_source(run: Run) -> tuple[str, str] | None:
    """(Secret, key) of the CA bundle learners verify the syncer with; None for plain HTTP."""
    syncer = run.spec.syncer
    if syncer.external is not None:
        return syncer.external.ca.name, syncer.external.ca.key
    if syncer.tls is not None:
        return syncer.tls.secret(run.name), CA_KEY
    return None


def add_learner_transport(pod_spec: dict[str, Any], run: Run, unit_secret: str) -> None:
    """The CA bundle (only that key of its Secret) as DILOCO_CA_FILE and, in an away run, the
    join credential's public part as DILOCO_JOIN."""
    container = pod_spec["containers"][0]
    env = container["env"]
    source = ca_source(run)
    if source is not None:
        secret, key = source
        pod_spec["volumes"].append(
            {
                "name": "syncer-ca",
                "secret": {"secretName": secret, "items": [{"key": key, "path": CA_FILE}]},
            }
        )
        container["volumeMounts"].append(
            {"name": "syncer-ca", "mountPath": CA_DIR, "readOnly": True}
        )
        env.append({"name": "DILOCO_CA_FILE", "value": f"{CA_DIR}/{CA_FILE}"})
    if run.spec.syncer.external is not None:
        ref = {"secretKeyRef": {"name": unit_secret, "key": JOIN_KEY}}
        env.append({"name": "DILOCO_JOIN", "valueFrom": ref})


def add_syncer_tls(template: dict[str, Any], run: Run, containers: tuple[str, ...]) -> None:
    """Serve HTTPS from the certificate Secret: mounted whole (the syncer picks a renewed pair
    up from the files), and every probe of the syncer containers asks over HTTPS."""
    tls = run.spec.syncer.tls
    if tls is None:
        return
    spec = template["spec"]
    # Shards also verify each other (shard 0 reads its peers' fragments): with the run's CA.
    sharded = run.spec.syncer.shards > 1
    keys = (TLS_CERT, TLS_KEY, CA_KEY) if sharded else (TLS_CERT, TLS_KEY)
    spec["volumes"].append(
        {
            "name": "syncer-tls",
            "secret": {
                "secretName": tls.secret(run.name),
                "items": [{"key": k, "path": k} for k in keys],
            },
        }
    )
    for container in spec["containers"]:
        if container["name"] not in containers:
            continue
        container["volumeMounts"].append(
            {"name": "syncer-tls", "mountPath": TLS_DIR, "readOnly": True}
        )
        container["env"] += [
            {"name": "DILOCO_TLS_CERT", "value": f"{TLS_DIR}/{TLS_CERT}"},
            {"name": "DILOCO_TLS_KEY", "value": f"{TLS_DIR}/{TLS_KEY}"},
        ]
        if sharded:
            container["env"].append({"name": "DILOCO_CA_FILE", "value": f"{TLS_DIR}/{CA_KEY}"})
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                container[probe]["httpGet"]["scheme"] = "HTTPS"


def expose(service: dict[str, Any], run: Run) -> dict[str, Any]:
    """The syncer Service as other clusters reach it: a (by default internal) load balancer;
    behind an HTTPRoute, a port that says HTTPS (a Gateway that ends TLS speaks it onwards)."""
    exposure = run.spec.syncer.expose
    if exposure is not None and exposure.gateway is not None:
        if exposure.gateway.kind == "HTTPRoute":
            for port in service["spec"]["ports"]:
                port["appProtocol"] = "HTTPS"
        return service
    if exposure is None or exposure.type != "LoadBalancer":
        return service
    spec = service["spec"]
    spec["type"] = "LoadBalancer"
    if exposure.load_balancer_source_ranges:
        spec["loadBalancerSourceRanges"] = list(exposure.load_balancer_source_ranges)
    annotations = dict(exposure.annotations or {})
    if exposure.internal:
        annotations.setdefault(INTERNAL_LB_ANNOTATION, "Internal")
    if annotations:
        service["metadata"].setdefault("annotations", {}).update(annotations)
    return service


def syncer_route(run: Run) -> dict[str, Any] | None:
    """The Gateway API route to the syncer Service (`syncer.expose.gateway`), or None. One route
    for the one syncer: an exposed syncer is never sharded (api.clusters.check_shards)."""
    exposure = run.spec.syncer.expose
    route = exposure.gateway if exposure is not None else None
    if route is None:
        return None
    parent: dict[str, Any] = {"name": route.parent_ref.name}
    if route.parent_ref.namespace:
        parent["namespace"] = route.parent_ref.namespace
    if route.parent_ref.section_name:
        parent["sectionName"] = route.parent_ref.section_name
    rule: dict[str, Any] = {
        "backendRefs": [{"name": run.syncer_name, "port": run.spec.syncer.port}]
    }
    if route.kind == "HTTPRoute":
        # The learners' protocol, nothing else the syncer serves.
        rule["matches"] = [{"path": {"type": "PathPrefix", "value": PROTOCOL_PREFIX}}]
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": route.kind,
        "metadata": child_meta(run, run.syncer_name, SYNCER),
        "spec": {"parentRefs": [parent], "hostnames": [route.hostname], "rules": [rule]},
    }


def unit_secret_data(run: Run, unit: str, key: str, token_key: str) -> dict[str, str]:
    """A unit's Secret data: its bearer token derived from `key` (the run secret at home, the
    join credential in an away run) and, away, the credential's public part."""
    if run.spec.syncer.external is None:
        return {token_key: unit_token(key, unit)}
    credential = parse_join_credential(key)
    return {token_key: unit_token_from_credential(credential, unit), JOIN_KEY: credential.public}
