"""The set-up of the two-cluster tests (test_12_two_clusters.py, docs/e2e.md "Two clusters"):
a second cluster with its own real node beside the session's, its operator, the home syncer's
certificate, the link between them (a toxiproxy on the away gateway), the run as each cluster
describes it, and what a user carries to the away cluster (a join credential and the CA).
Loaded as a plugin by conftest.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, VENV_BIN, Operator, installed_chart, kubectl, say, wait_for
from diloco_operator.api.pod_security import TOKEN_KEY
from diloco_operator.k8s.join_credential import credential_secret
from diloco_trainer.join_credentials import mint_join_credential, parse_join_credential
from real_pods import on_real_node

from bench.lib.toxiproxy import Link, Shape, wan_link
from e2e.cluster import harness, real_node_config

RUN = "two"
HOME, AWAY = "home", "away"
HOME_UNIT, AWAY_UNIT = f"{RUN}-{HOME}-0", f"{RUN}-{AWAY}-0"
SYNCER_PORT = 8470
TLS_SECRET = f"{RUN}-syncer-tls"
OFFLINE_AFTER_S = 10
CUT_SECONDS = 60
TOTAL_STEPS = 10_000
BUDGET_LEFT = 400
AWAY_COMPRESSION = {"scheme": "int2", "errorFeedback": True}


def apply(c: harness._ClusterBase, ns: str, doc: dict[str, Any]) -> None:
    kubectl(c, "apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def get(c: harness._ClusterBase, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    r = kubectl(c, "get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


# ----------------------------------------------------------------------------------------------
# the two clusters and the link


@pytest.fixture(scope="module")
def away(cluster: harness._ClusterBase, real: dict[str, Any]) -> Iterator[harness._ClusterBase]:
    """A second cluster beside the home one: another kind cluster on kind's network when home
    is a kind cluster (e2e/kind/cluster.sh), else a second local cluster whose real node sits
    beside the home one (AWAY site)."""
    home_kind = cluster.info().get("kind")
    if home_kind:
        yield from kind_cluster(f"{home_kind}-away")
        return
    assert isinstance(cluster, harness.LocalCluster)
    state = cluster.state_dir.parent / f"away-{cluster.state_dir.name}"
    c = harness.LocalCluster(state, node_pools=[], site=real_node_config.AWAY)
    t0 = time.monotonic()
    c.start(timeout=300)
    say(f"away cluster up in {time.monotonic() - t0:.1f}s ({state})")
    try:
        yield c
    finally:
        c.stop()


def kind_cluster(name: str) -> Iterator[harness._ClusterBase]:
    """A kind cluster made (or found) by e2e/kind/cluster.sh, deleted at the end unless
    DILOCO_E2E_KEEP."""
    script = REPO / "e2e" / "kind" / "cluster.sh"
    t0 = time.monotonic()
    up = subprocess.run(["bash", str(script), "up", name], capture_output=True, text=True)
    assert up.returncode == 0, f"cluster.sh up {name} failed:\n{up.stderr[-3000:]}"
    say(f"kind cluster {name} up in {time.monotonic() - t0:.1f}s")
    try:
        yield harness.ExistingCluster(up.stdout.strip().splitlines()[-1])
    finally:
        if os.environ.get("DILOCO_E2E_KEEP", "") in ("", "0", "false"):
            subprocess.run(["bash", str(script), "down", name], capture_output=True)


def link_host(home: harness._ClusterBase) -> str:
    """Where the link listens, on this host: the address away pods reach it at (kind's network
    gateway; the away node's bridge gateway on the local clusters)."""
    return str(home.info().get("gateway") or real_node_config.AWAY.gateway)


@pytest.fixture(scope="module")
def away_operator(
    away: harness._ClusterBase, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """The away cluster's operator: a local process with the chart's ServiceAccount there."""
    with installed_chart(away, incluster=False) as names:
        op = Operator(away, names, tmp_path_factory.mktemp("away-operator"))
        op.start()
        try:
            yield op
        finally:
            op.stop()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that signed nothing of this run (what a wrong CA Secret would hold)."""
    d = tmp_path_factory.mktemp("other-ca")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=another CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ],
        cwd=d,
        check=True,
        capture_output=True,
    )
    return d / "ca.crt"


@pytest.fixture(scope="module")
def home_run(
    cluster: harness._ClusterBase, real: dict[str, Any], incluster: str, namespace: str
) -> str:
    """The home run: its syncer over HTTPS with the certificate the operator makes (a private CA
    of the run; it also names the link's address, which away learners dial) and one unit on the
    home node; the away group remote. On kind the syncer Service is a LoadBalancer, whose node
    port the link forwards to (no load balancer answers for it there)."""
    doc = manifest(real["images"]["trainer"], HOME)
    doc["spec"]["syncer"]["tls"] = {"ipAddresses": [link_host(cluster)]}
    if cluster.info().get("kind"):
        doc["spec"]["syncer"]["expose"] = {"type": "LoadBalancer"}
    apply(cluster, namespace, doc)
    return namespace


@pytest.fixture(scope="module")
def home_ca(
    cluster: harness._ClusterBase, home_run: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The home syncer's CA, as a user copies it from the home cluster (docs/multi-cluster.md)."""
    secret = wait_for(
        "the operator-made syncer certificate",
        lambda: get(cluster, "secret", TLS_SECRET, home_run),
        timeout=120,
    )
    path = tmp_path_factory.mktemp("home-ca") / "ca.crt"
    path.write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
    return path


@pytest.fixture(scope="module")
def link(
    cluster: harness._ClusterBase, home_run: str, away: harness.LocalCluster
) -> Iterator[Link]:
    """The only path from the away cluster to the home syncer: a proxy on the away gateway
    that forwards to the syncer Service's address (kube-proxy routes it to the pod)."""
    svc = wait_for(
        "the home syncer Service",
        lambda: get(cluster, "svc", f"{RUN}-syncer", home_run),
        timeout=120,
    )
    node_ip = cluster.info().get("node_ip")
    upstream = (  # a kind node's port of the Service, else the Service (kube-proxy on the host)
        (node_ip, svc["spec"]["ports"][0]["nodePort"])
        if node_ip
        else (svc["spec"]["clusterIP"], SYNCER_PORT)
    )
    with wan_link(
        upstream[1],
        Shape(),
        "home-syncer",
        upstream_host=upstream[0],
        listen_host=link_host(cluster),
    ) as link:
        yield link


def address(link: Link) -> str:
    return link.url.replace("http://", "https://")


@pytest.fixture(scope="module")
def away_run(
    cluster: harness._ClusterBase,
    away: harness._ClusterBase,
    away_operator: Operator,
    real: dict[str, Any],
    home_run: str,
    link: Link,
    home_ca: Path,
) -> str:
    """The away run, in a namespace of the same name: its CA Secret and join credential first."""
    ns = home_run
    kubectl(away, "create", "namespace", ns)
    carry(away, ns, "join", cli_credential(cluster, ns, AWAY, "1h", "join"), home_ca)
    doc = manifest(real["images"]["trainer"], AWAY, external(address(link), "join"))
    apply(away, ns, doc)
    return ns


def cli_credential(
    home: harness._ClusterBase, home_ns: str, group: str, expires_in: str, name: str
) -> str:
    """A join credential Secret minted at home with `diloco join-credential`, as a user does."""
    minted = subprocess.run(
        [
            str(VENV_BIN / "diloco"),
            "join-credential",
            RUN,
            "--group",
            group,
            "--expires-in",
            expires_in,
            "-n",
            home_ns,
            "--secret-name",
            name,
        ],
        env=home.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return minted.stdout


def carry(away: harness._ClusterBase, ns: str, name: str, secret: str, ca: Path) -> None:
    """What a user carries to the away namespace: the credential Secret and the CA, as
    `<name>-ca`."""
    kubectl(away, "apply", "-n", ns, "-f", "-", input=secret)
    kubectl(away, "create", "secret", "generic", f"{name}-ca", "-n", ns, f"--from-file=ca.crt={ca}")


def external(addr: str, secret: str) -> dict[str, Any]:
    return {
        "address": addr,
        "ca": {"name": f"{secret}-ca", "key": "ca.crt"},
        "credential": {"name": secret, "key": "credential"},
    }


def manifest(image: str, local: str, joins: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole run as either cluster describes it: the group it does not run is remote."""
    placement = on_real_node()
    groups = [
        {
            "name": g,
            **({"replicas": 1} if g != HOME else {}),  # the first group: spec.replicas
            # the link is the thin part: the away group pushes 2 bits, home the run's 8
            **({"compression": AWAY_COMPRESSION} if g == AWAY else {}),
            **(
                {"remote": True}
                if g != local
                else {
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "256Mi"},
                        "limits": {"memory": "1536Mi"},
                    },
                    **placement,
                }
            ),
        }
        for g in (HOME, AWAY)
    ]
    syncer: dict[str, Any] = (
        {"external": joins}
        if joins
        else {
            "port": SYNCER_PORT,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
            "checkpoint": {"ephemeral": True},
            **placement,
        }
    )
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": RUN},
        "spec": {
            "image": image,
            "imagePullPolicy": "Never",
            "replicas": 1,
            "unitGroups": groups,
            "training": {
                "model": {"preset": "tiny", "seqLen": 64},
                "data": {"source": "stdlib", "batchSize": 8, "maxBytes": 400000},
                "innerSteps": 10,
                "fragments": 2,
                "compression": {"scheme": "int8"},
                "totalSteps": TOTAL_STEPS,
                "heartbeatSeconds": 1,
                "eval": {"everySeconds": 10, "batches": 2},
            },
            "syncer": syncer,
            "failurePolicy": {
                "restartBackoffSeconds": 1.0,
                "healthyAfterSeconds": 5,
                "offlineAfterSeconds": OFFLINE_AFTER_S,
            },
        },
    }


# ----------------------------------------------------------------------------------------------


def run_secret(home: harness._ClusterBase, ns: str) -> str:
    """The home run's secret (what only the home cluster holds)."""
    got = kubectl(home, "get", "secret", f"{RUN}-token", "-n", ns, "-o", "json").stdout
    return base64.b64decode(json.loads(got)["data"][TOKEN_KEY]).decode()


def crafted(name: str, secret: str, run: str, expires_at: int) -> str:
    """A credential Secret as `diloco join-credential` prints it, for what the command will not
    mint: one already expired, one of another run."""
    cred = parse_join_credential(mint_join_credential(secret, run, AWAY, expires_at))
    return json.dumps(credential_secret(name, cred))
