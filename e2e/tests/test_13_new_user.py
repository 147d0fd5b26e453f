"""A new user: the release as published, installed with the README's steps into a cluster that has
never seen the project, runs the CPU example to completion (docs/release.md).

- The chart is packaged and pushed to an OCI registry as a release does (`make release-chart`,
  `helm push`; the registry is `crane registry serve`, go-containerregistry's in-memory OCI
  registry, standing in for ghcr.io), and the images carry their release names on the real node
  (what a pull of `ghcr.io/elastic-diloco/...:<version>` would have left there).
- The cluster is made new: the suite's operator stops, every DilocoRun is released and the CRD
  deleted. The README's `helm install oci://.../diloco-operator --version <version>` installs it
  again (Helm installs the chart's crds/) and the chart's operator, with the chart's default
  image. `kubectl apply` of examples/kind-cpu.yaml trains to its budget: Succeeded, a final loss.

What this machine forces on the README's steps, and only that: the registry's address and
`--plain-http`; the operator and the run's pods placed on the real node (the other nodes are KWOK
fakes) with its toleration; the example's requests and budget cut to two cores. Afterwards the
suite's operator resumes against the same CRD.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runs
import yaml
from conftest import REPO, Operator, helm_env, kubectl, say, wait_for
from real_pods import ctr, helm, on_real_node

from e2e.cluster import harness

pytestmark = pytest.mark.timeout(900)

RELEASE = "first"
RELEASE_NS = "diloco-first"
CRD = "dilocoruns.diloco.dev"
VERSION = subprocess.run(
    ["make", "-s", "print-version"], cwd=REPO, capture_output=True, text=True, check=True
).stdout.strip()
PUBLISHED = "ghcr.io/elastic-diloco"
TOTAL_STEPS = 300


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    """An OCI registry on loopback: `crane registry serve` (built by e2e/cluster/build.sh)."""
    crane = Path(bash_output("bash", "e2e/cluster/build.sh", "crane").splitlines()[-1]) / "crane"
    address = f"127.0.0.1:{harness.free_port()}"
    proc = subprocess.Popen(
        [str(crane), "registry", "serve", "--address", address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for("the registry listening", lambda: reachable(address), timeout=30)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def bash_output(*argv: str) -> str:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout


def reachable(address: str) -> bool:
    host, port = address.split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


@pytest.fixture(scope="module")
def published(cluster: harness._ClusterBase, registry: str, real: dict[str, Any]) -> str:
    """The chart pushed to the registry as the release workflow does; the images under their
    release names in the node's containerd. Returns the chart's OCI repository."""
    binary, env = helm_env(cluster)
    out = subprocess.run(
        ["make", "-s", "release-chart", f"HELM={binary}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    say(out.stdout.strip())
    package = REPO / "dist" / f"diloco-operator-{VERSION}.tgz"
    helm(cluster, "push", str(package), f"oci://{registry}/charts", "--plain-http")
    for role, name in (("operator", "diloco-operator"), ("trainer", "diloco-trainer-cpu")):
        tag_on_node(cluster, real["images"][role], f"{PUBLISHED}/{name}:{VERSION}")
    return f"oci://{registry}/charts/diloco-operator"


def tag_on_node(cluster: harness._ClusterBase, image: str, name: str) -> None:
    """Give an image in the node's containerd another name (containerd stores short names in
    their normalised form, docker.io/library/NAME)."""
    known = ctr(cluster, "images", "ls", "-q").split()
    (source,) = [ref for ref in known if ref == image or ref.endswith(f"/{image}")]
    ctr(cluster, "images", "tag", "--force", source, name)


@pytest.fixture(scope="module")
def new_cluster(cluster: harness._ClusterBase, operator: Operator) -> Iterator[None]:
    """No DilocoRun CRD and no operator: what a cluster that never had the project looks like
    to it (the suite's own release stays installed, scaled to zero)."""
    operator.stop()
    subprocess.run(
        [str(REPO / ".venv" / "bin" / "diloco-operator"), "--release-runs", "--all-namespaces"],
        env={**cluster.env(), "KUBECONFIG": str(cluster.kubeconfig)},
        capture_output=True,
        check=True,
    )
    kubectl(cluster, "delete", "crd", CRD, "--wait=true", "--timeout=120s")
    try:
        yield
    finally:
        kubectl(cluster, "get", "crd", CRD)  # the new install's CRD serves the suite from here
        operator.start()


def readme_install(repository: str, ns: str) -> list[str]:
    """The README's install command, with this repository for ghcr.io's."""
    readme = (REPO / "README.md").read_text()
    line = f"helm install diloco oci://{PUBLISHED}/charts/diloco-operator --version {VERSION}"
    assert line in readme, "the README's install command changed: update this test"
    return [
        "install",
        RELEASE,
        repository,
        "--version",
        VERSION,
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "--set",
        f"watchNamespaces={{{ns}}}",
        "--plain-http",
    ]


def example(ns: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "kind-cpu.yaml").read_text())
    spec = doc["spec"]
    assert spec["image"] == f"{PUBLISHED}/diloco-trainer-cpu:{VERSION}"
    for group in spec["unitGroups"]:
        group.update(on_real_node())
        group["resources"]["requests"] = {"cpu": "100m", "memory": "256Mi"}
    spec["syncer"].update(on_real_node())
    spec["syncer"]["resources"]["requests"] = {"cpu": "100m", "memory": "256Mi"}
    spec["training"]["totalSteps"] = TOTAL_STEPS
    return doc


def with_final_loss(cluster: harness._ClusterBase, ns: str, run: str) -> dict[str, Any] | None:
    status = runs.status(cluster, ns, run)
    return status if status.get("finalLoss") is not None else None


def test_a_new_user_installs_the_release_and_runs_the_cpu_example(
    cluster: harness._ClusterBase,
    registry: str,
    published: str,
    new_cluster: None,
    namespace: str,
    tmp_path: Path,
) -> None:
    assert kubectl(cluster, "get", "crd", CRD, check=False).returncode != 0
    values = tmp_path / "node.json"
    values.write_text(json.dumps(on_real_node()))
    t0 = time.monotonic()
    helm(cluster, *readme_install(published, namespace), "-f", str(values))
    try:
        deploy = f"{RELEASE}-diloco-operator"
        kubectl(
            cluster, "rollout", "status", f"deploy/{deploy}", "-n", RELEASE_NS, "--timeout=180s"
        )
        pod = runs.items(cluster, "pods", RELEASE_NS, f"app.kubernetes.io/instance={RELEASE}")[0]
        image = pod["spec"]["containers"][0]["image"]
        assert image == f"{PUBLISHED}/diloco-operator:{VERSION}"  # the chart's default
        say(f"helm install from {published} -> operator ready in {time.monotonic() - t0:.1f}s")

        doc = example(namespace)
        run = doc["metadata"]["name"]
        runs.apply(cluster, namespace, doc)
        wait_for(
            f"{run} Succeeded",
            lambda: runs.status(cluster, namespace, run).get("phase") == "Succeeded",
            timeout=600,
        )
        # The syncer evaluates the final model once the budget is reached, after in-flight
        # merges land: its loss reaches the status a pass or two after the phase.
        done = wait_for(
            "finalLoss in status", lambda: with_final_loss(cluster, namespace, run), 180
        )
        say(
            f"examples/kind-cpu.yaml: Succeeded {time.monotonic() - t0:.1f}s after the install, "
            f"final loss {done['finalLoss']}, outer step {done.get('outerStep')}"
        )
        kubectl(cluster, "delete", "dlr", run, "-n", namespace, "--wait=true", "--timeout=120s")
    finally:
        helm(cluster, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait")
