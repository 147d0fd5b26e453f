"""kwok: the kubelets of fake nodes labelled like GKE node pools (TPU slices and CPU nodes), and
the pods "running" on them; its stage config gives the tests knobs for chaos (below)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apiserver import PKI, nodes_ready
from procs import ClusterError, Processes

# Pod IPs are on loopback too (see apiserver.py), so code under test that reaches for a pod only
# ever talks to this machine. The price: EndpointSlices reject loopback addresses, so Services get
# no EndpointSlices here (the endpointslice controller runs and records
# FailedToUpdateEndpointSlices events). On a machine where that matters and traffic to other
# ranges is fine, set DILOCO_E2E_POD_CIDR (e.g. 10.244.0.0/16).
POD_CIDR = os.environ.get("DILOCO_E2E_POD_CIDR", "127.100.0.0/16")
NODE_IP_PREFIX = "127.50."  # node n (from 1) is 127.50.<n // 256>.<n % 256>: 127.50.0.n below 256

KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
# kwok chaos knobs (see README.md):
#   label a node  node-not-ready.stage.kwok.x-k8s.io=true  -> Ready=False (remove it to recover)
#   label a pod   pod-container-running-failed.stage.kwok.x-k8s.io=true -> Failed
#   label a Job pod  pod-complete.stage.kwok.x-k8s.io=true -> Succeeded (Job pods otherwise
#   stay Running forever, as a training job would)
NODE_NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_COMPLETE_LABEL = "pod-complete.stage.kwok.x-k8s.io"

TPU_RESOURCE = "google.com/tpu"
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


@dataclasses.dataclass(frozen=True)
class NodePool:
    name: str  # cloud.google.com/gke-nodepool
    nodes: int
    machine_type: str
    cpu: str
    memory: str
    accelerator: str | None = None  # cloud.google.com/gke-tpu-accelerator
    topology: str | None = None  # cloud.google.com/gke-tpu-topology
    chips_per_host: int = 0
    zone: str = "us-east5-b"


def default_node_pools() -> list[NodePool]:
    """GKE-like pools. A multi-host TPU slice is one node pool on GKE: v6e 2x4 = 8 chips = 2 hosts
    of 4 chips, so four v6e pools of 2 nodes give four slices; v5p 2x2x1 = 4 chips = 1 host, so one
    pool of 4 nodes gives four single-host slices. Plus CPU nodes for the operator and syncer."""
    pools = [
        NodePool(
            f"tpu-v6e-2x4-{i}", 2, "ct6e-standard-4t", "180", "720Gi", "tpu-v6e-slice", "2x4", 4
        )
        for i in range(4)
    ]
    pools.append(
        NodePool(
            "tpu-v5p-2x2x1",
            4,
            "ct5p-hightpu-4t",
            "208",
            "448Gi",
            "tpu-v5p-slice",
            "2x2x1",
            4,
            zone="us-east5-a",
        )
    )
    pools.append(NodePool("default-pool", 2, "e2-standard-8", "8", "32Gi"))
    return pools


def node_manifests(pools: list[NodePool], kubelet_version: str) -> list[dict]:
    items = []
    n = 0
    for pool in pools:
        for j in range(pool.nodes):
            n += 1
            name = f"gke-e2e-{pool.name}-{j}"
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": pool.machine_type,
                "topology.kubernetes.io/region": pool.zone.rsplit("-", 1)[0],
                "topology.kubernetes.io/zone": pool.zone,
                "cloud.google.com/gke-nodepool": pool.name,
                "type": "kwok",
            }
            resources = {
                "cpu": pool.cpu,
                "memory": pool.memory,
                "pods": "110",
                "ephemeral-storage": "100Gi",
            }
            taints = []
            if pool.accelerator:
                labels["cloud.google.com/gke-tpu-accelerator"] = pool.accelerator
                labels["cloud.google.com/gke-tpu-topology"] = pool.topology or ""
                resources[TPU_RESOURCE] = str(pool.chips_per_host)
                taints.append(dict(TPU_TAINT))
            items.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": labels,
                        "annotations": {
                            KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1],
                            "node.alpha.kubernetes.io/ttl": "0",
                        },
                    },
                    "spec": {"taints": taints} if taints else {},
                    "status": {
                        "allocatable": resources,
                        "capacity": dict(resources),
                        "addresses": [
                            {
                                "type": "InternalIP",
                                "address": f"{NODE_IP_PREFIX}{n // 256}.{n % 256}",
                            },
                            {"type": "Hostname", "address": name},
                        ],
                        "nodeInfo": {
                            "architecture": "amd64",
                            "operatingSystem": "linux",
                            "kubeletVersion": kubelet_version,
                            "machineID": f"fake-{n}",
                            "systemUUID": f"fake-{n}",
                            "bootID": f"fake-{n}",
                            "kubeProxyVersion": kubelet_version,
                            "containerRuntimeVersion": "kwok://fake",
                            "osImage": "Container-Optimized OS (fake)",
                            "kernelVersion": "fake",
                        },
                    },
                }
            )
    return items


def kwok_config(stages_dir: Path) -> str:
    """kwok's Stage config assembled from the stage manifests of the built kwok version, with two
    selector changes: node-initialize leaves nodes labelled not-ready alone (so the chaos stage's
    Ready=False sticks until the label is removed), and Job pods only complete when labelled."""

    def patched(rel: str, extra: str) -> str:
        text = (stages_dir / rel).read_text()
        anchor = "    matchExpressions:\n"
        if text.count(anchor) != 1:
            raise ClusterError(f"kwok stage {rel} has an unexpected layout; cannot patch it")
        return text.replace(anchor, anchor + extra, 1)

    docs = [
        patched(
            "node/fast/node-initialize.yaml",
            f"    - key: '.metadata.labels[\"{NODE_NOT_READY_LABEL}\"]'\n"
            "      operator: 'DoesNotExist'\n",
        ),
        (stages_dir / "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml").read_text(),
        (stages_dir / "node/chaos/node-not-ready.yaml").read_text(),
        (stages_dir / "pod/fast/pod-ready.yaml").read_text(),
        patched(
            "pod/fast/pod-complete.yaml",
            f"    - key: '.metadata.labels[\"{POD_COMPLETE_LABEL}\"]'\n"
            "      operator: 'In'\n      values:\n      - 'true'\n",
        ),
        (stages_dir / "pod/fast/pod-delete.yaml").read_text(),
        (stages_dir / "pod/chaos/pod-container-running-failed.yaml").read_text(),
        (stages_dir / "pod/chaos/pod-init-container-running-failed.yaml").read_text(),
    ]
    return "\n---\n".join(d.strip() for d in docs) + "\n"


def argv(binary: Path, pki: PKI, config: Path) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={pki.path('kwok.kubeconfig')}",
        f"--config={config}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector="
        f"{KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
        "--node-lease-duration-seconds=40",
        f"--cidr={POD_CIDR}",
        "--node-ip=127.0.0.1",
    ]


def start(
    procs: Processes,
    binary: Path,
    stages: Path,
    pki: PKI,
    apply: Callable[[list[dict[str, Any]]], object],
    nodes: list[dict[str, Any]],
) -> None:
    """Start kwok and create its fake nodes (they come Ready once kwok and the controllers run:
    wait_nodes_ready)."""
    st = procs.state_dir
    config = st / "kwok.yaml"
    config.write_text(kwok_config(stages))
    (st / "kwok-home").mkdir(exist_ok=True)
    procs.spawn(
        "kwok", argv(binary, pki, config), env={**os.environ, "HOME": str(st / "kwok-home")}
    )
    apply(nodes)


def wait_nodes_ready(
    procs: Processes, server: str, pki: PKI, nodes: list[dict[str, Any]], deadline: float
) -> None:
    names = [n["metadata"]["name"] for n in nodes]
    procs.wait(
        "kwok",
        lambda: nodes_ready(server, pki, names),
        deadline,
        what=f"{len(names)} fake nodes Ready",
    )
