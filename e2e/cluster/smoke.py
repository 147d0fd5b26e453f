#!/usr/bin/env python3
"""Smoke test of the local control plane, run by hand (not collected by pytest):

    python3 e2e/cluster/smoke.py [--state-dir DIR] [--keep]

Starts a cluster (or uses DILOCO_E2E_KUBECONFIG / KUBECONFIG, see harness.cluster), then checks:
fake TPU nodes Ready with the GKE labels; RBAC enforced for a service account; an Indexed Job
for a tpu-v6e-slice 2x4 lands on the v6e nodes and runs; a pod made Failed by a status patch fails
the Job (backoffLimit 0); kwok's pod chaos label fails a pod; a node labelled not-ready goes
NotReady, gets the not-ready taint from the node lifecycle controller, and recovers; a Deployment
on the CPU pool becomes available. Then stops the cluster and checks no process is left.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

Cluster = harness._ClusterBase
T = TypeVar("T")
NS = "smoke"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[smoke +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def wait(what: str, fn: Callable[[], T | None], timeout: float = 90, every: float = 0.5) -> T:
    end = time.monotonic() + timeout
    t = time.monotonic()
    last: T | None = None
    while time.monotonic() < end:
        last = fn()
        if last:
            say(f"ok: {what} ({time.monotonic() - t:.1f}s)")
            return last
        time.sleep(every)
    raise AssertionError(f"timed out ({timeout}s) waiting for {what}; last: {last!r}")


def pods(c: Cluster, selector: str) -> list[dict[str, Any]]:
    return c.kubectl_json("get", "pods", "-n", NS, "-l", selector)["items"]


def node(c: Cluster, name: str) -> dict[str, Any]:
    return c.kubectl_json("get", "node", name)


def ready(obj: dict) -> str | None:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond["type"] == "Ready":
            return cond["status"]
    return None


def indexed_job(name: str, backoff: int) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": backoff,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {
                        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                        "cloud.google.com/gke-tpu-topology": "2x4",
                    },
                    "tolerations": [
                        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
                    ],
                    "containers": [
                        {
                            "name": "learner",
                            "image": "registry.invalid/diloco/learner:fake",
                            "resources": {
                                "limits": {"google.com/tpu": "4"},
                                "requests": {"cpu": "1", "memory": "1Gi"},
                            },
                        }
                    ],
                },
            },
        },
    }


def run_checks(c: Cluster) -> None:
    v6e, v5p = check_nodes(c)
    c.kubectl("create", "namespace", NS)
    wait(
        "default ServiceAccount in the namespace",
        lambda: c.kubectl("get", "sa", "default", "-n", NS, check=False).returncode == 0,
    )
    check_rbac(c)
    running = check_indexed_job(c, v6e)
    check_failed_pod_fails_the_job(c, running[0]["metadata"]["name"])
    check_chaos_label_fails_a_pod(c)
    check_node_not_ready_and_back(c, v5p[0])
    check_deployment(c)
    c.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", timeout=130)
    say("ok: namespace deleted (pods finalized by kwok, garbage collector)")


def check_nodes(c: Cluster) -> tuple[set[str], list[str]]:
    """Every node Ready; the TPU nodes labelled, tainted and with 4 chips; (v6e, v5p) names."""
    k = c.kubectl
    nodes = c.kubectl_json("get", "nodes")["items"]
    say(
        f"{len(nodes)} nodes:\n"
        + k(
            "get",
            "nodes",
            "-L",
            "cloud.google.com/gke-tpu-accelerator,cloud.google.com/gke-tpu-topology,"
            "cloud.google.com/gke-nodepool",
        ).stdout
    )
    v6e = {
        n["metadata"]["name"]
        for n in nodes
        if n["metadata"]["labels"].get("cloud.google.com/gke-tpu-accelerator") == "tpu-v6e-slice"
    }
    v5p = sorted(
        n["metadata"]["name"]
        for n in nodes
        if n["metadata"]["labels"].get("cloud.google.com/gke-tpu-accelerator") == "tpu-v5p-slice"
    )
    assert len(v6e) >= 2 and v5p, (v6e, v5p)
    for n in nodes:
        assert ready(n) == "True", n["metadata"]["name"]
        if n["metadata"]["name"] in v6e:
            assert n["status"]["allocatable"].get("google.com/tpu") == "4", n["status"]
            assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in n[
                "spec"
            ]["taints"], n["spec"]
    say("ok: nodes Ready, TPU labels, google.com/tpu=4 allocatable, TPU taint")
    return v6e, v5p


def check_rbac(c: Cluster) -> None:
    """RBAC enforced for a service account (a real signed token), admin is cluster-admin."""
    k = c.kubectl
    k("create", "serviceaccount", "nobody", "-n", NS)
    token = k("create", "token", "nobody", "-n", NS).stdout.strip()
    r = _as_token(c, token, "get", "pods", "-n", NS)
    assert r.returncode != 0 and "forbidden" in r.stderr.lower(), (r.returncode, r.stderr)
    say(f"ok: service account is forbidden: {r.stderr.strip()[:140]}")
    k(
        "create",
        "rolebinding",
        "nobody-view",
        "--clusterrole=view",
        f"--serviceaccount={NS}:nobody",
        "-n",
        NS,
    )
    wait(
        "service account allowed after a RoleBinding",
        lambda: _as_token(c, token, "get", "pods", "-n", NS).returncode == 0,
        timeout=30,
    )
    assert k("auth", "can-i", "*", "*").stdout.strip() == "yes"


def check_indexed_job(c: Cluster, v6e: set[str]) -> list[dict[str, Any]]:
    """An Indexed Job on the v6e slice: one pod per node, indexes 0 and 1, Running for good."""
    k = c.kubectl
    k("apply", "-f", "-", input=json.dumps(indexed_job("learners", backoff=0)))
    running = wait(
        "Indexed Job pods Running",
        lambda: (
            lambda ps: (
                ps
                if len(ps) == 2 and all(p["status"].get("phase") == "Running" for p in ps)
                else None
            )
        )(pods(c, "app=learners")),
        timeout=120,
    )
    placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in running}
    assert all(n in v6e for n in placed.values()), placed
    assert len(set(placed.values())) == 2, f"4 chips per host: one pod per node, got {placed}"
    idx = sorted(
        p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in running
    )
    assert idx == ["0", "1"], idx
    say(
        f"ok: pods on v6e nodes {placed}, completion indexes {idx}, podIPs "
        f"{[p['status'].get('podIP') for p in running]}"
    )
    time.sleep(3)
    assert all(p["status"]["phase"] == "Running" for p in pods(c, "app=learners")), (
        "Job pods must stay Running (no auto-complete)"
    )
    return running


def check_failed_pod_fails_the_job(c: Cluster, victim: str) -> None:
    """A pod made Failed by a status patch -> the Job controller fails the Job (backoffLimit 0)."""
    k = c.kubectl
    t = time.monotonic()
    k(
        "patch",
        "pod",
        victim,
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Failed", "reason": "Smoke", "message": "patched"}}),
    )
    job = wait(
        "Job Failed (BackoffLimitExceeded) after the status patch",
        lambda: (
            lambda j: (
                j
                if any(
                    cd["type"] == "Failed" and cd["status"] == "True"
                    for cd in j.get("status", {}).get("conditions") or []
                )
                else None
            )
        )(c.kubectl_json("get", "job", "learners", "-n", NS)),
        timeout=60,
    )
    conds = [(cd["type"], cd.get("reason")) for cd in job["status"]["conditions"]]
    say(
        f"ok: job conditions {conds} {time.monotonic() - t:.1f}s after the patch; "
        f"failed={job['status'].get('failed')}"
    )
    wait(
        "the Job's other pod deleted",
        lambda: all(
            p["status"].get("phase") in ("Failed", "Succeeded") for p in pods(c, "app=learners")
        ),
        timeout=60,
    )


def check_chaos_label_fails_a_pod(c: Cluster) -> None:
    """A Job with retries recreates a failed pod; kwok's chaos label fails a pod."""
    k = c.kubectl
    k("apply", "-f", "-", input=json.dumps(indexed_job("retry", backoff=3)))
    ps = wait(
        "retry Job pods Running",
        lambda: (
            lambda ps: (
                ps
                if len(ps) == 2 and all(p["status"].get("phase") == "Running" for p in ps)
                else None
            )
        )(pods(c, "app=retry")),
        timeout=120,
    )
    k("label", "pod", ps[0]["metadata"]["name"], "-n", NS, f"{harness.POD_FAIL_LABEL}=true")
    wait(
        "kwok chaos stage fails the pod and the Job replaces it",
        lambda: (
            lambda ps: (
                len([p for p in ps if p["status"].get("phase") == "Failed"]) == 1
                and len([p for p in ps if p["status"].get("phase") == "Running"]) == 2
            )
        )(pods(c, "app=retry")),
        timeout=90,
    )


def check_node_not_ready_and_back(c: Cluster, n: str) -> None:
    """Node NotReady via kwok's chaos stage label, and back."""
    k = c.kubectl
    t = time.monotonic()
    k("label", "node", n, f"{harness.NODE_NOT_READY_LABEL}=true")
    wait(f"node {n} NotReady", lambda: ready(node(c, n)) == "False", timeout=60)
    wait(
        f"node lifecycle controller taints {n} not-ready",
        lambda: any(
            tt["key"] == "node.kubernetes.io/not-ready"
            for tt in node(c, n)["spec"].get("taints") or []
        ),
        timeout=90,
    )
    say(f"   NotReady + taint {time.monotonic() - t:.1f}s after the label")
    k("label", "node", n, f"{harness.NODE_NOT_READY_LABEL}-")
    wait(f"node {n} Ready again", lambda: ready(node(c, n)) == "True", timeout=60)
    wait(
        f"not-ready taint removed from {n}",
        lambda: (
            not any(
                tt["key"].startswith("node.kubernetes.io/")
                for tt in node(c, n)["spec"].get("taints") or []
            )
        ),
        timeout=90,
    )


def check_deployment(c: Cluster) -> None:
    """A Deployment on the CPU pool (deployment + replicaset controllers, scheduler)."""
    k = c.kubectl
    k(
        "create",
        "deployment",
        "syncer",
        "-n",
        NS,
        "--image=registry.invalid/diloco/syncer:fake",
        "--replicas=1",
    )
    k("rollout", "status", "deployment/syncer", "-n", NS, "--timeout=90s", timeout=100)
    p = pods(c, "app=syncer")[0]
    assert p["spec"]["nodeName"].startswith("gke-e2e-default-pool"), p["spec"]["nodeName"]
    say(f"ok: Deployment available on {p['spec']['nodeName']}")


def _as_token(c: Cluster, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """kubectl with only a bearer token (no client certificate) against c's API server."""
    import tempfile

    cfg = json.loads(Path(c.kubeconfig).read_text())
    cfg["users"] = [{"name": "tok", "user": {"token": token}}]
    cfg["contexts"][0]["context"]["user"] = "tok"
    with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig") as f:
        json.dump(cfg, f)
        f.flush()
        return subprocess.run(
            [c.kubectl_path, "--kubeconfig", f.name, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    a = ap.parse_args()
    sd = a.state_dir or harness.cache_root() / "state-smoke"
    with harness.cluster(sd, keep=a.keep) as c:
        say(f"cluster ready: {getattr(c, 'timings', {})}")
        run_checks(c)
    if isinstance(c, harness.LocalCluster) and not a.keep:
        left = c._scan_leftovers()
        assert not left, f"leftover processes: {left}"
        say("ok: cluster stopped, no leftover process")
    say("SMOKE PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
