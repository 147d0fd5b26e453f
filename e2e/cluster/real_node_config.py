"""The real node's addresses and names, and the files and objects its programs are configured
with: pure functions, text and manifests from paths (real_node.py writes and applies them)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import socket
import tarfile
from pathlib import Path
from typing import Any

SERVICE_CIDR = "10.96.0.0/20"
KUBERNETES_SERVICE_IP = "10.96.0.1"
DNS_SERVICE_IP = "10.96.0.10"

NODE_LABEL = "diloco.dev/e2e-real-node"
TAINT = {"key": "diloco.dev/real-node", "value": "true", "effect": "NoSchedule"}
PAUSE_IMAGE = "diloco-pause:1"
STORAGE_CLASS = "diloco-local"
EXT4_VOLUME = "ckpt-ext4"


@dataclasses.dataclass(frozen=True)
class Site:
    """Where one cluster's real node lives on this machine. Two sites (the nodes of two clusters)
    share it without touching each other's bridge, addresses, ports, cgroups, logs or guard.

    Only the home site routes Services (kube-proxy) and serves cluster DNS: kube-proxy's iptables
    chains are machine-wide, so two of them would rewrite each other's rules. Pods of another site
    reach what they need by address (the two-cluster tests: the home syncer through a proxy on
    their own gateway)."""

    key: str
    bridge: str
    pod_subnet: str
    gateway: str  # the host on the bridge: its kubelet (and at home: apiserver, CoreDNS) there
    name_suffix: str
    cgroup_root: str  # the kubelet's root for pod cgroups ("/" keeps the usual /kubepods)
    services: bool  # kube-proxy, CoreDNS and the local PersistentVolumes

    @property
    def node_name(self) -> str:
        """Home: the machine's hostname (the apiserver's fallback address for its kubelet)."""
        return socket.gethostname().split(".")[0].lower() + self.name_suffix

    @property
    def guard_chain(self) -> str:
        return "DILOCO-E2E-GUARD" + ("" if self.key == "home" else f"-{self.key.upper()}")

    @property
    def network_name(self) -> str:
        return "diloco-e2e" + ("" if self.key == "home" else f"-{self.key}")

    @property
    def cgroup_dir(self) -> str:
        """The top-level cgroup its pods live under, removed when the node stops."""
        return "kubepods" if self.cgroup_root == "/" else self.cgroup_root.strip("/")


HOME = Site("home", "dlc0", "10.244.0.0/24", "10.244.0.1", "", "/", services=True)
AWAY = Site("away", "dlc1", "10.245.0.0/24", "10.245.0.1", "-away", "/diloco-away", services=False)
SITES = {s.key: s for s in (HOME, AWAY)}

# the home site's, as most of the e2e suite knows them
BRIDGE = HOME.bridge
POD_SUBNET = HOME.pod_subnet
GATEWAY = HOME.gateway


def containerd_config(
    root: Path, state: Path, sock: Path, cni_conf: Path, cni_bin: str, runc_root: Path
) -> str:
    return f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below its own
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""


def cni_config(site: Site, ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": site.network_name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": site.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": site.pod_subnet, "gateway": site.gateway}]],
                    # Service IPs only, via the host: no default route, so a pod has no way
                    # to even address anything beyond this machine
                    "routes": [{"dst": SERVICE_CIDR}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            # a Docker engine on the machine may set the FORWARD policy to DROP
            {"type": "firewall"},
        ],
    }


def kubelet_config(
    site: Site, ca: Path, sock: Path, resolv: Path, ports: tuple[int, int], logs: Path
) -> dict[str, Any]:
    """ports: (serving, healthz); both are picked free, so two kubelets never collide."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{sock}",
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(resolv),
        "registerWithTaints": [TAINT],
        "address": site.gateway,
        "port": ports[0],
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports[1],
        "cgroupRoot": site.cgroup_root,
        # a kubelet removes log directories of pods it does not know: one directory per site
        "podLogsDir": str(logs),
        "readOnlyPort": 0,
        "maxPods": 40,
        # images cannot be pulled again here: never garbage-collect them, never evict for disk
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
    }


def kube_proxy_config(kubeconfig: Path, hostname: str, ports: tuple[int, int]) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "hostnameOverride": hostname,
        "healthzBindAddress": f"127.0.0.1:{ports[0]}",
        "metricsBindAddress": f"127.0.0.1:{ports[1]}",
        # leave the machine's conntrack sysctls alone (they may be read-only in a VM)
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def corefile(kubeconfig: Path) -> str:
    # No `forward`: names outside the cluster get no answer from elsewhere.
    return f""".:53 {{
    bind {GATEWAY}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


def dns_objects() -> list[dict[str, Any]]:
    """kube-dns: a Service without selector whose one endpoint is CoreDNS on the gateway."""
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system"},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "ports": [{**p, "targetPort": 53} for p in ports],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "e2e.diloco.dev",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": True}}],
            "ports": ports,
        },
    ]


def storage_objects(hostname: str, volumes: dict[str, tuple[Path, str]]) -> list[dict[str, Any]]:
    """A no-provisioner default StorageClass and one local PV per volume (name -> path, size)."""
    objs: list[dict[str, Any]] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Retain",
        }
    ]
    for name, (path, size) in volumes.items():
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": name, "labels": {NODE_LABEL: "true"}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": STORAGE_CLASS,
                    "local": {"path": str(path)},
                    "nodeAffinity": {
                        "required": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {
                                            "key": "kubernetes.io/hostname",
                                            "operator": "In",
                                            "values": [hostname],
                                        }
                                    ]
                                }
                            ]
                        }
                    },
                },
            }
        )
    return objs


def single_file_image(work: Path, program: Path, tag: str, out: Path) -> None:
    """A docker-save archive (the format `ctr images import` reads) of one static program."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        info = t.gettarinfo(str(program), arcname=program.name)
        info.mode, info.uid, info.gid = 0o755, 0, 0
        with open(program, "rb") as f:
            t.addfile(info, f)
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": [f"/{program.name}"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [tag], "Layers": ["layer/layer.tar"]}]
    ).encode()
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w") as t:
        for name, data in (
            ("layer/layer.tar", layer_bytes),
            (config_name, config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    tmp.replace(out)
