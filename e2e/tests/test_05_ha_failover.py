"""HA with the chart's peering (ha.enabled): two operator replicas, each with the chart's flags
(--peering, --priority=auto, --peering-lifetime) and the chart's ServiceAccount. Only the older
replica acts; when it is SIGKILLed (no goodbye in the peering object) the other takes over
within the stated bound, and no child is created twice or recreated.

The session's standalone operator is stopped for the test (it would act too) and started again
afterwards; the release is switched to ha.enabled for the test and back."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CHART,
    RELEASE,
    SYSTEM_NS,
    VENV_BIN,
    Operator,
    _pdeathsig,
    kubectl,
    say,
    service_account_kubeconfig,
    wait_for,
)
from runs import all_units_online, apply, example, items, job_attempt, live_jobs, run_selector

from e2e.cluster import harness

RUN = "v6e-100m"
LIFETIME_S = 15  # the chart's default ha.peeringLifetimeSeconds
# The stated failover bound: the dead leader's keep-alive expires (at most LIFETIME_S after the
# kill), then the survivor resumes, re-lists and runs a pass (a few seconds on a loaded box).
TAKEOVER_BOUND_S = LIFETIME_S + 15


def helm(cluster: Any, *args: str) -> None:
    binary = str(harness.expected_binaries().helm)
    if not os.access(binary, os.X_OK):
        binary = "helm"
    r = subprocess.run(
        [binary, *args, "--kubeconfig", str(cluster.kubeconfig)],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def ha_release(cluster: Any, chart: dict[str, str], operator: Operator) -> Iterator[None]:
    """The release with ha.enabled (peering object + peering RBAC), its Deployment kept at 0
    replicas (the replicas run as local processes), and the session operator stopped."""
    if operator.mode != "local":
        pytest.skip("two local replicas: DILOCO_E2E_OPERATOR=local only")
    operator.stop()
    base = ["upgrade", RELEASE, str(CHART), "-n", SYSTEM_NS, "--reuse-values"]
    helm(cluster, *base, "--set", "ha.enabled=true")
    kubectl(cluster, "scale", "deploy", chart["deployment"], "-n", SYSTEM_NS, "--replicas=0")
    try:
        yield
    finally:
        helm(cluster, *base, "--set", "ha.enabled=false")
        kubectl(cluster, "scale", "deploy", chart["deployment"], "-n", SYSTEM_NS, "--replicas=0")
        operator.start()


class Replica:
    """One operator replica as the chart's Deployment would run it (local process)."""

    def __init__(self, cluster: Any, chart: dict[str, str], workdir: Path, name: str) -> None:
        self.name = name
        self.kubeconfig = workdir / f"{name}.kubeconfig"
        self.log_path = workdir / f"{name}.log"
        service_account_kubeconfig(cluster, chart["serviceAccount"], self.kubeconfig)
        self.health_port = harness.free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "POD_ID": name}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        argv = [
            str(VENV_BIN / "diloco-operator"),
            "--all-namespaces",
            "--peering=diloco-operator",
            "--priority=auto",
            f"--peering-lifetime={LIFETIME_S}",
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
            "--metrics-port=0",
            "--poll-interval=2",
            "--syncer-url=http://127.0.0.1:9/{namespace}/{name}",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_pdeathsig
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


RESUMED = "Resuming operations"  # kopf's log line when a paused replica starts acting


def peers(cluster: Any) -> set[str]:
    """Identities with a keep-alive in the chart's ClusterKopfPeering."""
    obj = cluster.kubectl_json("get", "clusterkopfpeering", "diloco-operator")
    return set(obj.get("status") or {})


def children(cluster: Any, namespace: str) -> dict[str, str]:
    """kind/name -> uid of every object labelled with the run."""
    found = {}
    for kind in ("jobs", "services", "deployments", "secrets", "configmaps"):
        for obj in items(cluster, kind, namespace, run_selector(RUN)):
            found[f"{obj['kind']}/{obj['metadata']['name']}"] = obj["metadata"]["uid"]
    return found


def test_leader_sigkilled_the_other_replica_takes_over_without_duplicates(
    cluster: Any,
    chart: dict[str, str],
    ha_release: None,
    tpu_nodes: Any,
    namespace: str,
    tmp_path: Path,
) -> None:
    # Replicas start paused until they have read the peering object. The leader resumes (no
    # peer above it); the standby, started later (a lower priority), finds it there and stays
    # paused, as when a pod is added or restarted next to a running leader.
    leader = Replica(cluster, chart, tmp_path, "replica-a")
    standby: Replica | None = None
    try:
        wait_for("the leader active", lambda: RESUMED in leader.log(), timeout=60)
        standby = Replica(cluster, chart, tmp_path, "replica-b")
        wait_for(
            "both replicas in the peering object",
            lambda: {"replica-a", "replica-b"} <= peers(cluster),
            timeout=60,
        )
        time.sleep(3)  # the standby has processed the peering object by now
        assert RESUMED not in standby.log(), standby.log()
        apply(cluster, namespace, example("gke-tpu-v6e", replicas=2))
        wait_for("2 units Online", lambda: all_units_online(cluster, namespace, RUN, 2), 120)
        assert "created kind=Job" in leader.log() and "created kind=" not in standby.log()
        before = children(cluster, namespace)
        attempts = {n: job_attempt(j) for n, j in live_jobs(cluster, namespace, RUN).items()}

        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(timeout=10)
        killed = time.monotonic()
        # Work only an active operator does: a third unit.
        kubectl(cluster, "scale", "dlr", RUN, "-n", namespace, "--replicas=3")
        wait_for(
            "the standby creating the third unit",
            lambda: f"{RUN}-v6e-2" in live_jobs(cluster, namespace, RUN),
            timeout=TAKEOVER_BOUND_S + 30,
        )
        took = time.monotonic() - killed
        say(f"takeover: the standby created the new unit {took:.1f}s after the SIGKILL")
        assert RESUMED in standby.log()
        assert took <= TAKEOVER_BOUND_S, f"takeover took {took:.1f}s > {TAKEOVER_BOUND_S}s"
        wait_for("3 units Online", lambda: all_units_online(cluster, namespace, RUN, 3), 120)

        after = children(cluster, namespace)
        # Every child of before is still the same object (none recreated or replaced) ...
        assert {k: after.get(k) for k in before} == before
        # ... the only new ones are the third unit's Job, Service and token Secret ...
        assert sorted(set(after) - set(before)) == [
            f"Job/{RUN}-v6e-2",
            f"Secret/{RUN}-v6e-2-token",
            f"Service/{RUN}-v6e-2",
        ]
        # ... and no unit was restarted by the handover.
        jobs_now = live_jobs(cluster, namespace, RUN)
        assert {n: job_attempt(jobs_now[n]) for n in attempts} == attempts
        assert len(jobs_now) == 3
    finally:
        # Gone before the namespace goes (the active replica removes kopf's finalizer), so no
        # operator later finds a run whose namespace refuses new children.
        kubectl(cluster, "delete", "dlr", RUN, "-n", namespace, "--timeout=60s", check=False)
        for replica in (leader, standby):
            if replica is not None:
                replica.stop()
        say(f"replica logs: {tmp_path}")
