"""Fixtures and helpers of the tests whose pods are real containers on the local cluster's real
node (e2e/cluster/real_node.py): the node's facts, placement on it, and the chart's operator
running in-cluster from its image. Loaded as a plugin by conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CHART,
    RELEASE,
    REPO,
    SYSTEM_NS,
    Operator,
    extra_helm_args,
    get_json,
    helm_env,
    kubectl,
    say,
    wait_for,
)

from e2e.cluster import harness, real_node


@pytest.fixture(scope="module")
def real(cluster: harness._ClusterBase) -> dict[str, Any]:
    """The real node and the images built for it; skips where the cluster has no real node."""
    info = cluster.info()
    if not info.get("real_node") or not info.get("images"):
        if os.environ.get("DILOCO_E2E_REQUIRE"):
            pytest.fail("DILOCO_E2E_REQUIRE: the cluster has no real node (needs root)")
        pytest.skip("the cluster has no real node (e2e/cluster/real_node.py needs root)")
    return info


def helm(c: harness._ClusterBase, *args: str) -> None:
    binary, env = helm_env(c)
    r = subprocess.run(
        [binary, *args, "--kubeconfig", str(c.kubeconfig)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, f"helm {' '.join(args)} failed: {r.stderr}"


def ctr(cluster: harness._ClusterBase, *args: str) -> str:
    """The stdout of `ctr` against the real node's containerd (namespace k8s.io): a kind node's
    inside its container, the local real node's on its socket."""
    info = cluster.info()
    if info.get("kind"):
        argv = ["docker", "exec", info["real_node"], "ctr", "-n", "k8s.io", *args]
        env = {**os.environ, "DOCKER_HOST": info["docker_host"]}
        return subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    assert isinstance(cluster, harness.LocalCluster)
    sock = cluster.state_dir / "node" / "containerd.sock"
    argv = ["ctr", "--address", str(sock), "-n", "k8s.io", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def container_pid(
    cluster: harness._ClusterBase, pod: dict[str, Any], container: str | None = None
) -> int:
    """The host PID of a container's main process (default: the pod's first container), from
    the node's containerd."""
    statuses = pod["status"]["containerStatuses"]
    status = next(c for c in statuses if c["name"] == container) if container else statuses[0]
    cid = status["containerID"].removeprefix("containerd://")
    out = ctr(cluster, "tasks", "ls")
    for line in out.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == cid:
            return host_pid(cluster, int(pid))
    raise AssertionError(f"container {cid} has no task on the node:\n{out}")


def children(pid: int) -> list[int]:
    """The host PIDs of a process's children: a supervised learner's, one."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def host_pid(cluster: harness._ClusterBase, node_pid: int) -> int:
    """The host's PID of a process the real node's containerd calls `node_pid`. The same number
    on the local real node; a kind node is a container with a PID namespace of its own, so
    there it is the process below the node's init whose PID one namespace down is `node_pid`."""
    info = cluster.info()
    if not info.get("kind"):
        return node_pid
    env = {**os.environ, "DOCKER_HOST": info["docker_host"]}
    inspect = ["docker", "inspect", "-f", "{{.State.Pid}}", info["real_node"]]
    init = int(subprocess.run(inspect, capture_output=True, text=True, check=True, env=env).stdout)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
            nspid = fields.get("NSpid", "").split()
            if len(nspid) > 1 and int(nspid[1]) == node_pid and _descends(int(proc.name), init):
                return int(proc.name)
    raise AssertionError(f"no host process is PID {node_pid} of kind node {info['real_node']}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent
    return False


def on_real_node() -> dict[str, Any]:
    return {
        "nodeSelector": {real_node.NODE_LABEL: "true"},
        "tolerations": [real_node.TOLERATION],
    }


def real_node_run(
    name: str,
    image: str,
    *,
    replicas: int = 1,
    group: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    syncer: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A DilocoRun whose pods all run on the real node: one CPU unit group `cpu` training the
    tiny model on the stdlib corpus, with small requests. `group`, `training` and `syncer` are
    laid over those; `spec` adds the rest (failurePolicy, chaos, ...)."""
    placement = on_real_node()
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "imagePullPolicy": "Never",
            "replicas": replicas,
            "unitGroups": [
                {
                    "name": "cpu",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "256Mi"},
                        "limits": {"memory": "1536Mi"},
                    },
                    **placement,
                    **(group or {}),
                }
            ],
            "training": {
                "model": {"preset": "tiny", "seqLen": 64},
                "data": {"source": "stdlib", "batchSize": 8, "maxBytes": 400000},
                "innerSteps": 10,
                "heartbeatSeconds": 1,
                **(training or {}),
            },
            "syncer": {
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                **placement,
                **(syncer or {}),
            },
            **spec,
        },
    }


# The chart as published at the previous release (`helm package` of it): where an upgrade starts.
PREVIOUS_CHART = REPO / "e2e" / "fixtures" / "charts" / "diloco-operator-0.1.0.tgz"
CRD_FILE = "diloco.dev_dilocoruns.yaml"


@pytest.fixture(scope="module")
def incluster(
    cluster: harness._ClusterBase,
    real: dict[str, Any],
    operator: Operator,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """The chart's operator, in-cluster from its image on the real node, with chaos on. The
    session's local operator steps aside meanwhile (two operators must never share runs)."""
    with chart_operator(cluster, real, operator, tmp_path_factory, CHART) as pod:
        yield pod


@pytest.fixture(scope="module")
def incluster_previous_release(
    cluster: harness._ClusterBase,
    real: dict[str, Any],
    operator: Operator,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """As `incluster`, from the previous release's chart and with its CRD in the cluster, as an
    install of that release leaves them (a test then upgrades with `upgrade_chart`). The image is
    this tree's: only the chart and the CRD are the previous release's."""
    with tarfile.open(PREVIOUS_CHART) as tgz:
        member = tgz.extractfile(f"diloco-operator/crds/{CRD_FILE}")
        assert member is not None
        previous_crd = tmp_path_factory.mktemp("crd") / CRD_FILE
        previous_crd.write_bytes(member.read())
    kubectl(cluster, "replace", "-f", str(previous_crd))
    try:
        # As installed afresh: none of the values the suite's release got from this tree's chart.
        fresh = ["--reset-values", "--set", "clusterWide=true", *extra_helm_args()]
        with chart_operator(
            cluster, real, operator, tmp_path_factory, PREVIOUS_CHART, fresh
        ) as pod:
            try:
                yield pod
            finally:  # whatever the test did, later modules get this tree's chart (a second
                # upgrade to the same chart changes no object)
                upgrade_chart(cluster)
    finally:  # and its CRD
        kubectl(cluster, "replace", "-f", str(CHART / "crds" / CRD_FILE))


def upgrade_chart(cluster: harness._ClusterBase) -> None:
    """`helm upgrade` to this tree's chart the way docs/operator.md says: the new chart's
    defaults, then the values the release was installed with."""
    helm(cluster, "upgrade", RELEASE, str(CHART), "-n", SYSTEM_NS, "--reset-then-reuse-values")


@contextlib.contextmanager
def chart_operator(
    cluster: harness._ClusterBase,
    real: dict[str, Any],
    operator: Operator,
    tmp_path_factory: pytest.TempPathFactory,
    chart: Path,
    how: Sequence[str] = ("--reuse-values",),
) -> Iterator[str]:
    repo, tag = real["images"]["operator"].split(":", 1)
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "chaos": {"enabled": True},
        "pollIntervalSeconds": 1,
        **on_real_node(),
    }
    vf = tmp_path_factory.mktemp("helm") / "values.json"
    vf.write_text(json.dumps(values))
    operator.stop()
    t0 = time.monotonic()
    helm(cluster, "upgrade", RELEASE, str(chart), "-n", SYSTEM_NS, *how, "-f", str(vf))
    _scale_chart_operator(cluster, 1)
    pod = wait_for("the in-cluster operator pod Ready", lambda: operator_pod(cluster), 180)
    say(f"in-cluster operator {pod} ready in {time.monotonic() - t0:.1f}s")
    try:
        yield pod
    finally:
        _scale_chart_operator(cluster, 0)
        wait_for("the in-cluster operator gone", lambda: not operator_pods(cluster), 120)
        operator.start()


def _scale_chart_operator(c: harness._ClusterBase, replicas: int) -> None:
    selector = f"app.kubernetes.io/instance={RELEASE}"
    kubectl(c, "scale", "deploy", "-n", SYSTEM_NS, "-l", selector, f"--replicas={replicas}")


def operator_pods(c: harness._ClusterBase) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = get_json(
        c, "get", "pods", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/instance={RELEASE}"
    )["items"]
    return pods


def operator_pod(c: harness._ClusterBase) -> str | None:
    for p in operator_pods(c):
        ready = any(
            x["type"] == "Ready" and x["status"] == "True"
            for x in p.get("status", {}).get("conditions") or []
        )
        if ready and not p["metadata"].get("deletionTimestamp"):
            return str(p["metadata"]["name"])
    return None
