#!/usr/bin/env python3
"""A real Kubernetes control plane on 127.0.0.1, without Docker, for the e2e tests.

Processes (binaries built and cached by build.sh, versions pinned in versions.env):
  etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and kwok, which plays the
  kubelets of fake nodes labelled like GKE TPU node pools (and a couple of CPU nodes).

Python stdlib only (plus the openssl CLI for the certificates); it talks to the API server with
urllib and shells out to the cached kubectl.

Use from Python (e.g. as a pytest fixture):

    from e2e.cluster.harness import cluster          # or: import harness
    with cluster() as c:                             # local one, or an existing one (see below)
        c.kubectl("get", "nodes")
        print(c.kubeconfig)

    c = LocalCluster(state_dir); c.start(); ...; c.stop()

CLI (what up.sh / down.sh call):
    harness.py up [--state-dir D]      start (idempotent: a healthy running cluster is kept)
    harness.py down [--state-dir D]    stop, and verify that no process of it is left
    harness.py status|env|kubeconfig [--state-dir D]

Which cluster cluster() gives (env DILOCO_E2E_CLUSTER = auto | local | existing, default auto):
    auto:     DILOCO_E2E_KUBECONFIG if set, else KUBECONFIG if set, else a local cluster
    local:    always the local cluster (started here, stopped at the end)
    existing: DILOCO_E2E_KUBECONFIG, KUBECONFIG or ~/.kube/config; never starts anything
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # `python e2e/cluster/harness.py` as a script
    sys.path.insert(0, str(HERE.parent.parent))
from e2e.cluster import kueue as kueue_mod  # noqa: E402
from e2e.cluster import node as real_node  # noqa: E402

STATE_MARKER = ".diloco-e2e-state"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
# Started on request (start_kueue), stopped with the cluster.
ON_REQUEST = ("kueue",)

# Every address the fake cluster hands out is on loopback, so that code under test that tries to
# reach a pod or service IP only ever talks to this machine (connection refused, or a real local
# process a test bound there on purpose); nothing is ever sent to a private or public range.
# The price: EndpointSlices reject loopback addresses, so Services get no EndpointSlices here (the
# endpointslice controller runs and records FailedToUpdateEndpointSlices events). On a machine where
# that matters and traffic to other ranges is fine, set DILOCO_E2E_POD_CIDR (e.g. 10.244.0.0/16).
# With the real node (node.py, on by default as root) Services need addresses that pods can reach:
# the node's range, whose packets a guard chain keeps on this machine.
REAL_NODE = real_node.enabled()
SERVICE_CIDR = real_node.SERVICE_CIDR if REAL_NODE else "127.64.0.0/20"
KUBERNETES_SERVICE_IP = real_node.KUBERNETES_SERVICE_IP if REAL_NODE else "127.64.0.1"
COMPONENTS = CONTROL_PLANE + (real_node.NODE_COMPONENTS if REAL_NODE else ())
POD_CIDR = os.environ.get("DILOCO_E2E_POD_CIDR", "127.100.0.0/16")
NODE_IP_PREFIX = "127.50.0."

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


class ClusterError(RuntimeError):
    """The cluster could not be built, started, reached or stopped (message says why)."""


def _log(msg: str) -> None:
    print(f"[e2e-cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# versions, cache and binaries


def cache_root() -> Path:
    env = os.environ.get("DILOCO_E2E_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diloco-e2e"


def default_state_dir() -> Path:
    env = os.environ.get("DILOCO_E2E_STATE_DIR")
    return Path(env).expanduser() if env else cache_root() / "state"


def read_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


@dataclasses.dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kwok_stages: Path
    node: real_node.NodeBinaries

    def all_paths(self) -> list[Path]:
        return [
            self.etcd,
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.kwok,
            self.helm,
            *dataclasses.astuple(self.node),
        ]


def binaries(build: bool = True) -> Binaries:
    """Paths of the cached binaries; runs build.sh first when some are missing and build=True."""
    b = expected_binaries()
    missing = [p for p in b.all_paths() if not os.access(p, os.X_OK)]
    if not (b.kwok_stages / ".complete").exists():
        missing.append(b.kwok_stages)
    if missing:
        if not build:
            raise ClusterError(
                f"missing binaries {[str(m) for m in missing]}: run {HERE / 'build.sh'}"
            )
        _log(
            f"binaries missing ({', '.join(p.name for p in missing)}): running build.sh "
            "(a cold build takes long, see e2e/cluster/README.md)"
        )
        r = subprocess.run(["bash", str(HERE / "build.sh")], stdout=sys.stderr)
        if r.returncode != 0:
            raise ClusterError(f"build.sh failed with exit code {r.returncode}")
        return binaries(build=False)
    return b


def expected_binaries() -> Binaries:
    """Where build.sh puts the binaries of the pinned versions (whether built or not)."""
    v = read_versions()
    root = cache_root()
    k8s = root / f"k8s-{v['K8S_VERSION']}" / "bin"
    kwok_dir = root / f"kwok-{v['KWOK_VERSION']}"
    b = Binaries(
        etcd=root / f"etcd-{v['ETCD_VERSION']}" / "bin" / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        kwok=kwok_dir / "bin" / "kwok",
        helm=root / f"helm-{v['HELM_VERSION']}" / "bin" / "helm",
        kwok_stages=kwok_dir / "stages",
        node=real_node.NodeBinaries(
            kubelet=k8s / "kubelet",
            kube_proxy=k8s / "kube-proxy",
            coredns=root / f"coredns-{v['COREDNS_VERSION']}" / "bin" / "coredns",
            pause=Path(_build_sh_dir("pause")) / "pause",
        ),
    )
    return b


def _build_sh_dir(component: str) -> str:
    """A bin dir whose name build.sh derives from content (the pause program's hash)."""
    out = subprocess.run(
        ["bash", str(HERE / "build.sh"), "--print-bin-dirs"], capture_output=True, text=True
    ).stdout.split()
    return next(d for d in out if f"/{component}-" in d)


# ----------------------------------------------------------------------------------------------
# fake GKE node pools


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
                            {"type": "InternalIP", "address": f"{NODE_IP_PREFIX}{n}"},
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


# ----------------------------------------------------------------------------------------------
# helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise ClusterError(
            f"{' '.join(map(str, argv))} failed ({r.returncode}): {r.stderr.strip()}"
        )
    return r


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _proc_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def images_dir() -> Path:
    return cache_root() / "images"


def build_images() -> dict[str, str]:
    """The project's images (e2e/node/images.sh: content-hashed, a warm call builds nothing),
    as {"trainer": ref, "operator": ref}; their docker-save archives go to images_dir()."""
    r = subprocess.run(
        ["bash", str(HERE.parent / "node" / "images.sh"), "--save", str(images_dir())],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise ClusterError(f"e2e/node/images.sh failed ({r.returncode}):\n{r.stderr[-3000:]}")
    sys.stderr.write(r.stderr)
    return dict(line.split("=", 1) for line in r.stdout.split() if "=" in line)


def image_tar(image: str) -> Path:
    return images_dir() / (image.replace(":", "_").replace("/", "_") + ".tar")


class PKI:
    """A throwaway CA plus serving/client certificates and the service-account key (openssl CLI)."""

    def __init__(self, d: Path):
        self.d = d

    def _openssl(self, *args: str) -> None:
        if not shutil.which("openssl"):
            raise ClusterError("the openssl command is needed to make the cluster's certificates")
        _run(["openssl", *args], cwd=self.d)

    def generate(self, real_node_sans: bool = False) -> None:
        self.d.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl(
            "req",
            "-x509",
            "-new",
            *ec,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=diloco-e2e-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )
        sans = ",".join(
            [
                "IP:127.0.0.1",
                f"IP:{KUBERNETES_SERVICE_IP}",
                *([f"IP:{real_node.GATEWAY}"] if real_node_sans else []),
                "DNS:localhost",
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
            ]
        )
        self.leaf("apiserver", "/CN=kube-apiserver", "serverAuth", sans)
        self.leaf("admin", "/O=system:masters/CN=diloco-e2e-admin", "clientAuth")
        self.leaf("kube-controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
        self.leaf("kube-scheduler", "/CN=system:kube-scheduler", "clientAuth")
        # kwok plays every fake kubelet (nodes, node leases, pod status, pod deletion).
        self.leaf("kwok", "/O=system:masters/CN=kwok", "clientAuth")
        if real_node_sans:
            # the real node's programs, each with the identity a cluster gives it
            node = real_node.node_name()
            self.leaf("kubelet", f"/O=system:nodes/CN=system:node:{node}", "clientAuth")
            self.leaf("kube-proxy", "/CN=system:kube-proxy", "clientAuth")
            self.leaf("coredns", "/O=system:masters/CN=coredns", "clientAuth")
            # the apiserver's identity towards kubelets (kubectl logs/exec)
            self.leaf(
                "apiserver-kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
                "clientAuth",
            )
        self._openssl(
            "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key"
        )
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        for k in self.d.glob("*.key"):
            k.chmod(0o600)

    def leaf(self, name: str, subj: str, usage: str, sans: str | None = None) -> None:
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ext = [
            "-addext",
            "basicConstraints=critical,CA:FALSE",
            "-addext",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "-addext",
            f"extendedKeyUsage={usage}",
        ]
        if sans:
            ext += ["-addext", f"subjectAltName={sans}"]
        self._openssl(
            "req",
            "-x509",
            "-new",
            *ec,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.crt",
            "-days",
            "365",
            "-subj",
            subj,
            *ext,
        )

    def path(self, name: str) -> Path:
        return self.d / name


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> None:
    b64 = lambda p: base64.b64encode(p.read_bytes()).decode()  # noqa: E731
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "diloco-e2e",
                "cluster": {"server": server, "certificate-authority-data": b64(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)},
            }
        ],
        "contexts": [{"name": "diloco-e2e", "context": {"cluster": "diloco-e2e", "user": user}}],
        "current-context": "diloco-e2e",
        "preferences": {},
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    path.chmod(0o600)


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


# ----------------------------------------------------------------------------------------------
# clusters


class _ClusterBase:
    kubeconfig: Path
    kubectl_path: str
    local: bool = False

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e["KUBECONFIG"] = str(self.kubeconfig)
        return e

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; returns the CompletedProcess (text)."""
        argv = [self.kubectl_path, "--kubeconfig", str(self.kubeconfig), *args]
        r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}"
            )
        return r

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def stop(self) -> None:  # pragma: no cover - overridden
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExistingCluster(_ClusterBase):
    """A cluster someone else runs (kind on a laptop, a real one): nothing is started or stopped."""

    def __init__(self, kubeconfig: str | Path):
        self.kubeconfig = Path(kubeconfig).expanduser()
        if not self.kubeconfig.exists():
            raise ClusterError(f"kubeconfig {self.kubeconfig} does not exist")
        built = expected_binaries().kubectl
        self.kubectl_path = (
            str(built) if os.access(built, os.X_OK) else (shutil.which("kubectl") or "")
        )
        if not self.kubectl_path:
            raise ClusterError("no kubectl: run e2e/cluster/build.sh or install kubectl")


class LocalCluster(_ClusterBase):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on 127.0.0.1.

    Everything lives in state_dir (wiped on start): pki/, logs/<component>.log, pids/, etcd data,
    kubeconfig (cluster-admin), cluster.json (ports, pids, versions, start timings)."""

    local = True

    def __init__(
        self,
        state_dir: str | Path | None = None,
        *,
        node_pools: list[NodePool] | None = None,
        build: bool = True,
    ):
        self.state_dir = (
            Path(state_dir).expanduser().resolve() if state_dir else default_state_dir().resolve()
        )
        self.node_pools = node_pools if node_pools is not None else default_node_pools()
        self.build = build
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.versions = read_versions()
        self._bins: Binaries | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.images: dict[str, str] = {}
        self.node: real_node.RealNode | None = None

    # -- paths
    @property
    def bins(self) -> Binaries:
        if self._bins is None:
            self._bins = binaries(build=self.build)
        return self._bins

    @property
    def kubectl_path(self) -> str:  # type: ignore[override]
        return str(self.bins.kubectl)

    @property
    def pki(self) -> PKI:
        return PKI(self.state_dir / "pki")

    def _log_path(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    # -- HTTP to the API server (admin client certificate)
    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.path("ca.crt")))
        ctx.load_cert_chain(str(self.pki.path("admin.crt")), str(self.pki.path("admin.key")))
        return ctx

    def api(
        self,
        path: str,
        method: str = "GET",
        body: dict | None = None,
        content_type: str = "application/json",
        timeout: float = 10,
    ) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.server + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(req, context=self._ssl(), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # -- lifecycle
    def is_running(self) -> bool:
        """True when every component recorded in state_dir is alive and the API server is ready."""
        info = self._read_info()
        if not info:
            return False
        for name in COMPONENTS:
            pid = self._recorded_pid(name)
            if pid is None or not _proc_alive(pid):
                return False
        self.ports = info.get("ports", {})
        try:
            code, _body = self.api("/readyz", timeout=5)
        except (OSError, ssl.SSLError, KeyError):
            return False
        return code == 200

    def start(self, timeout: float = 300) -> LocalCluster:
        """Start a fresh cluster (anything left in state_dir is stopped and wiped first). On any
        failure every process started so far is stopped again (logs stay in state_dir/logs)."""
        try:
            return self._start(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop(quiet=True)
            raise

    def _start(self, timeout: float) -> LocalCluster:
        t_start = time.monotonic()
        deadline = t_start + timeout
        bins = self.bins  # builds when needed (not counted in the start timings)
        t0 = time.monotonic()
        self.stop(quiet=True)  # leftovers of an earlier run in this state dir
        self._prepare_state_dir()
        self.ports = {
            k: free_port()
            for k in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler")
        }
        self.pki.generate(real_node_sans=REAL_NODE)
        self.timings["certs_s"] = round(time.monotonic() - t0, 2)
        if REAL_NODE:
            self.node = self._new_node()
            self.node.lock()
            self.node.prepare()  # packages, bridge, guard: the apiserver advertises the bridge
        pki = self.pki
        st = self.state_dir

        # etcd
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        self._spawn(
            "etcd",
            [
                str(bins.etcd),
                "--name=e2e",
                f"--data-dir={st / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=e2e={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
                "--quota-backend-bytes=2147483648",
            ],
        )
        self._wait(
            "etcd", lambda: self._http_ok(f"{etcd_url}/health", b'"health":"true"'), deadline
        )
        self.timings["etcd_ready_s"] = round(time.monotonic() - t_start, 2)

        # kube-apiserver: with the real node, pods reach it at the bridge's gateway address
        self._spawn(
            "kube-apiserver",
            [
                str(bins.kube_apiserver),
                *(
                    [
                        f"--advertise-address={real_node.GATEWAY}",
                        "--bind-address=0.0.0.0",
                        "--kubelet-preferred-address-types=InternalIP,Hostname",
                        f"--kubelet-client-certificate={pki.path('apiserver-kubelet-client.crt')}",
                        f"--kubelet-client-key={pki.path('apiserver-kubelet-client.key')}",
                    ]
                    if REAL_NODE
                    else [
                        "--advertise-address=127.0.0.1",
                        "--bind-address=127.0.0.1",
                        "--endpoint-reconciler-type=none",
                    ]
                ),
                f"--secure-port={self.ports['apiserver']}",
                f"--etcd-servers={etcd_url}",
                f"--cert-dir={st / 'apiserver'}",
                f"--tls-cert-file={pki.path('apiserver.crt')}",
                f"--tls-private-key-file={pki.path('apiserver.key')}",
                f"--client-ca-file={pki.path('ca.crt')}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.path('sa.pub')}",
                f"--service-account-signing-key-file={pki.path('sa.key')}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
            ],
        )
        self._wait("kube-apiserver", self._apiserver_ready, deadline)
        self.timings["apiserver_ready_s"] = round(time.monotonic() - t_start, 2)

        # kubeconfigs
        for user, path in (
            ("admin", self.kubeconfig),
            ("kube-controller-manager", pki.path("kube-controller-manager.kubeconfig")),
            ("kube-scheduler", pki.path("kube-scheduler.kubeconfig")),
            ("kwok", pki.path("kwok.kubeconfig")),
        ):
            write_kubeconfig(
                path,
                self.server,
                pki.path("ca.crt"),
                pki.path(f"{user}.crt"),
                pki.path(f"{user}.key"),
                user,
            )

        kcm_kc = pki.path("kube-controller-manager.kubeconfig")
        self._spawn(
            "kube-controller-manager",
            [
                str(bins.kube_controller_manager),
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['controller_manager']}",
                f"--cert-dir={st / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.path('sa.key')}",
                f"--root-ca-file={pki.path('ca.crt')}",
                f"--cluster-signing-cert-file={pki.path('ca.crt')}",
                f"--cluster-signing-key-file={pki.path('ca.key')}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=diloco-e2e",
                "--profiling=false",
            ],
        )
        sched_kc = pki.path("kube-scheduler.kubeconfig")
        self._spawn(
            "kube-scheduler",
            [
                str(bins.kube_scheduler),
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                f"--cert-dir={st / 'kube-scheduler'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        kwok_cfg = st / "kwok.yaml"
        kwok_cfg.write_text(kwok_config(bins.kwok_stages))
        (st / "kwok-home").mkdir(exist_ok=True)
        self._spawn(
            "kwok",
            [
                str(bins.kwok),
                f"--kubeconfig={pki.path('kwok.kubeconfig')}",
                f"--config={kwok_cfg}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector="
                f"{KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
                "--node-lease-duration-seconds=40",
                f"--cidr={POD_CIDR}",
                "--node-ip=127.0.0.1",
            ],
            env={**os.environ, "HOME": str(st / "kwok-home")},
        )

        # fake nodes (created while the controllers come up)
        nodes = node_manifests(self.node_pools, self.versions["K8S_VERSION"])
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}),
        )
        self._wait(
            "kube-controller-manager",
            lambda: self._http_ok(
                f"https://127.0.0.1:{self.ports['controller_manager']}/healthz",
                b"ok",
                insecure=True,
            ),
            deadline,
        )
        self._wait(
            "kube-scheduler",
            lambda: self._http_ok(
                f"https://127.0.0.1:{self.ports['scheduler']}/healthz", b"ok", insecure=True
            ),
            deadline,
        )
        names = [n["metadata"]["name"] for n in nodes]
        self._wait(
            "kwok",
            lambda: self._nodes_ready(names),
            deadline,
            what=f"{len(names)} fake nodes Ready",
        )
        self.timings["nodes_ready_s"] = round(time.monotonic() - t_start, 2)
        if self.node is not None:
            self._start_real_node(deadline + 600)  # image imports are not start-up time
            self.timings["real_node_ready_s"] = round(time.monotonic() - t_start, 2)
        self._wait(
            "kube-controller-manager",
            lambda: self.api("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            deadline,
            what="default ServiceAccount",
        )
        self.timings["total_start_s"] = round(time.monotonic() - t_start, 2)
        self._write_info()
        _log(
            f"cluster up in {self.timings['total_start_s']}s: {self.server}, "
            f"{len(names)} nodes; KUBECONFIG={self.kubeconfig}"
        )
        return self

    def stop(self, quiet: bool = False, timeout: float = 15) -> None:
        """Stop every process of this cluster (by recorded pid, then by a /proc scan for any
        process of our binaries whose command line names this state dir) and verify none is left.
        Raises ClusterError if one survives SIGKILL."""
        if REAL_NODE:
            self._stop_real_node(timeout)
        targets: dict[int, str] = {}
        for name in CONTROL_PLANE + ON_REQUEST:
            pid = self._recorded_pid(name)
            if pid is not None:
                targets[pid] = name
        for pid, name in self._scan_leftovers().items():
            targets.setdefault(pid, name)
        if not targets and not self._procs:
            if not quiet:
                _log(f"nothing of {self.state_dir} is running")
            return
        if not quiet:
            _log(f"stopping {', '.join(f'{n}({p})' for p, n in sorted(targets.items()))}")
        # etcd last: an API server whose etcd is gone hangs in its graceful shutdown
        first = [p for p, n in targets.items() if n != "etcd"]
        last = [p for p, n in targets.items() if n == "etcd"]
        for group in (first, last):
            self._terminate(group, targets, timeout)
        for p in self._procs.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=1)
        self._procs.clear()
        left = [f"{n}({p})" for p, n in targets.items() if self._alive(p)]
        left += [f"{n}({p})" for p, n in self._scan_leftovers().items() if p not in targets]
        if left:
            raise ClusterError(f"processes survived SIGKILL: {', '.join(left)}")
        pids = self.state_dir / "pids"
        if pids.is_dir():
            shutil.rmtree(pids)
        if not quiet:
            _log("stopped; no process of this cluster is left")

    # -- Kueue (kueue.py), for the tests that need it
    def start_kueue(self, timeout: float = 120) -> None:
        """Install Kueue's CRDs and webhooks and run its manager (built by `build.sh kueue`)
        as a host process of this cluster; idempotent while it runs."""
        pid = self._recorded_pid("kueue")
        if pid is not None and _proc_alive(pid) and kueue_mod.webhooks_answer(self):
            return
        t0 = time.monotonic()
        home = kueue_mod.kueue_dir(cache_root(), self.versions["KUEUE_VERSION"])
        binary = kueue_mod.ensure_built(HERE / "build.sh", home)
        port, health = free_port(), free_port()
        state = self.state_dir / "kueue"
        certs = kueue_mod.make_certs(state / "certs")
        config = state / "config.yaml"
        config.write_text(json.dumps(kueue_mod.manager_config(port, health, state / "certs")))
        kueue_mod.install(self, home, port, certs)
        self._spawn("kueue", kueue_mod.argv(binary, config, self.kubeconfig),
                    env=kueue_mod.env(self.kubeconfig))  # fmt: skip
        proc = self._procs["kueue"]
        ready = kueue_mod.wait_ready(self, lambda: proc.poll() is None, self._log_path("kueue"),
                                     timeout)  # fmt: skip
        self.timings["kueue_ready_s"] = round(time.monotonic() - t0, 2)
        _log(f"kueue up in {self.timings['kueue_ready_s']}s (webhooks answered after {ready:.1f}s)")

    def stop_kueue(self, timeout: float = 15) -> None:
        """Remove Kueue's webhook configurations (nothing would serve them), then stop it."""
        kueue_mod.uninstall_webhooks(self)
        pid = self._recorded_pid("kueue")
        if pid is not None:
            self._terminate([pid], {pid: "kueue"}, timeout)
        self._procs.pop("kueue", None)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "pids" / "kueue.pid").unlink()

    # -- the real node (node.py)
    def _new_node(self) -> real_node.RealNode:
        return real_node.RealNode(
            self.state_dir,
            cache_root(),
            self.bins.node,
            spawn=lambda name, argv: self._spawn(name, argv),
            apply=lambda objs: self.kubectl(
                "apply",
                "-f",
                "-",
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}),
            ),
            log=_log,
        )

    def _start_real_node(self, deadline: float) -> None:
        node = self.node
        assert node is not None
        t0 = time.monotonic()
        node.start_runtime()
        self.images = build_images()
        tars = {real_node.PAUSE_IMAGE: node.pause_tar()}
        tars.update({img: image_tar(img) for img in self.images.values()})
        node.import_images(tars)
        self.timings["images_s"] = round(time.monotonic() - t0, 2)
        node.start_kubelet(self.pki, self.server, free_port, write_kubeconfig)
        node.make_volumes()
        self._wait(
            "kubelet", lambda: self._nodes_ready([node.name]), deadline, what="real node Ready"
        )
        self._wait(
            "kubelet",
            lambda: self.api("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            deadline,
            what="default ServiceAccount",
        )

    def _stop_real_node(self, timeout: float) -> None:
        node = self.node or self._new_node()
        api_up = self._recorded_pid("kube-apiserver") is not None and bool(
            self.ports or self._read_info()
        )
        if not self.ports:
            self.ports = self._read_info().get("ports", {})

        def terminate(names: list[str]) -> None:
            pids = {p: n for n in names if (p := self._recorded_pid(n)) is not None}
            pids.update({p: n for p, n in self._scan_leftovers().items() if n in names})
            self._terminate(list(pids), pids, timeout)

        node.stop(self.kubectl if api_up else None, terminate)
        self.node = None

    # -- internals
    def _prepare_state_dir(self) -> None:
        st = self.state_dir
        if st.exists() and any(st.iterdir()) and not (st / STATE_MARKER).exists():
            raise ClusterError(
                f"{st} is not empty and not a diloco-e2e state dir; refusing to wipe"
            )
        if st.exists():
            shutil.rmtree(st)
        for sub in ("logs", "pids", "pki"):
            (st / sub).mkdir(parents=True, exist_ok=True)
        (st / STATE_MARKER).write_text("state dir of e2e/cluster/harness.py; wiped on start\n")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self._log_path(name), "ab")  # noqa: SIM115 - closed below once Popen has dup()ed it
        try:
            p = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()
        self._procs[name] = p
        (self.state_dir / "pids" / f"{name}.pid").write_text(
            json.dumps({"pid": p.pid, "exe": argv[0], "argv": argv})
        )

    def _recorded_pid(self, name: str) -> int | None:
        f = self.state_dir / "pids" / f"{name}.pid"
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        pid = int(rec["pid"])
        cmd = _proc_cmdline(pid)
        # a recycled pid belongs to someone else: only ours if it still runs our binary
        return pid if cmd and cmd[0] == rec["exe"] else None

    def _scan_leftovers(self) -> dict[int, str]:
        found: dict[int, str] = {}
        if not Path("/proc").is_dir():
            return found
        names = {Path(p).name for p in COMPONENTS + ON_REQUEST}
        needle = str(self.state_dir).rstrip("/") + "/"  # not a sibling like state-smoke/
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            cmd = _proc_cmdline(int(entry))
            if (
                cmd
                and Path(cmd[0]).name in names
                and str(cache_root()) in cmd[0]
                and any(needle in a for a in cmd[1:])
                and _proc_alive(int(entry))
            ):
                found[int(entry)] = Path(cmd[0]).name
        return found

    def _terminate(self, pids: list[int], names: dict[int, str], timeout: float) -> None:
        for pid in pids:
            self._signal(pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(self._alive(p) for p in pids):
            time.sleep(0.05)
        for pid in [p for p in pids if self._alive(p)]:
            _log(f"{names[pid]} ({pid}) ignored SIGTERM for {timeout}s: SIGKILL")
            self._signal(pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(self._alive(p) for p in pids):
            time.sleep(0.05)

    def _alive(self, pid: int) -> bool:
        for p in self._procs.values():
            if p.pid == pid:
                return p.poll() is None
        return _proc_alive(pid)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        # each component leads its own process group (start_new_session): signal the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def _wait(
        self, name: str, check: Callable[[], object], deadline: float, what: str | None = None
    ) -> None:
        what = what or f"{name} ready"
        last_err: Exception | None = None
        while True:
            p = self._procs.get(name)
            if p is not None and p.poll() is not None:
                raise ClusterError(
                    f"{name} exited with code {p.returncode} while waiting for "
                    f"{what}; last log lines ({self._log_path(name)}):\n"
                    f"{_tail(self._log_path(name))}"
                )
            try:
                if check():
                    return
            except (OSError, ssl.SSLError, ClusterError, ValueError) as e:
                last_err = e
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out waiting for {what} (last error: {last_err}); "
                    f"last log lines ({self._log_path(name)}):\n"
                    f"{_tail(self._log_path(name))}"
                )
            time.sleep(0.25)

    def _http_ok(self, url: str, expect: bytes, insecure: bool = False) -> bool:
        ctx = None
        if url.startswith("https"):
            ctx = ssl.create_default_context()
            if insecure:  # kcm / scheduler serve with self-signed certs on loopback
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
                return r.status == 200 and expect in r.read()
        except urllib.error.HTTPError:
            return False

    def _apiserver_ready(self) -> bool:
        code, _ = self.api("/readyz", timeout=5)
        return code == 200

    def _nodes_ready(self, names: list[str]) -> bool:
        code, body = self.api("/api/v1/nodes")
        if code != 200:
            return False
        ready = set()
        for n in json.loads(body)["items"]:
            for c in n.get("status", {}).get("conditions") or []:
                if c["type"] == "Ready" and c["status"] == "True":
                    ready.add(n["metadata"]["name"])
        return all(n in ready for n in names)

    def _write_info(self) -> None:
        info = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "pids": {n: p.pid for n, p in self._procs.items()},
            "versions": self.versions,
            "timings": self.timings,
            "nodes": [
                n["metadata"]["name"]
                for n in node_manifests(self.node_pools, self.versions["K8S_VERSION"])
            ],
            "real_node": self.node.name if self.node is not None else None,
            "images": self.images,
        }
        (self.state_dir / "cluster.json").write_text(json.dumps(info, indent=2))

    def _read_info(self) -> dict:
        try:
            return json.loads((self.state_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return {}


@contextlib.contextmanager
def cluster(
    state_dir: str | Path | None = None, *, timeout: float = 300, keep: bool | None = None
) -> Iterator[_ClusterBase]:
    """The cluster for e2e tests (see the module docstring for how it is chosen).

    A local cluster is started in state_dir (default: env DILOCO_E2E_STATE_DIR, else
    <cache>/state-pytest) and stopped at the end unless keep (env DILOCO_E2E_KEEP=1)."""
    mode = os.environ.get("DILOCO_E2E_CLUSTER", "auto")
    if mode not in ("auto", "local", "existing"):
        raise ClusterError(f"DILOCO_E2E_CLUSTER={mode!r}: expected auto, local or existing")
    kc = os.environ.get("DILOCO_E2E_KUBECONFIG") or (
        os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
    )
    if mode == "existing" or (mode == "auto" and kc):
        path = kc or str(Path.home() / ".kube" / "config")
        _log(f"using the existing cluster of {path}")
        yield ExistingCluster(path)
        return
    if keep is None:
        keep = os.environ.get("DILOCO_E2E_KEEP", "") not in ("", "0", "false")
    sd = state_dir or os.environ.get("DILOCO_E2E_STATE_DIR") or cache_root() / "state-pytest"
    c = LocalCluster(sd)
    try:
        c.start(timeout=timeout)
        yield c
    finally:
        if keep:
            _log(
                f"keeping the cluster (DILOCO_E2E_KEEP): stop it with "
                f"e2e/cluster/down.sh --state-dir {c.state_dir}"
            )
        else:
            c.stop()


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "down", "status", "env", "kubeconfig"])
    ap.add_argument(
        "--state-dir",
        default=None,
        help="default: $DILOCO_E2E_STATE_DIR or ~/.cache/diloco-e2e/state",
    )
    ap.add_argument("--timeout", type=float, default=300, help="start timeout in seconds")
    ap.add_argument("--no-build", action="store_true", help="fail instead of running build.sh")
    ap.add_argument("--restart", action="store_true", help="up: restart even if running")
    a = ap.parse_args(argv)
    c = LocalCluster(a.state_dir, build=not a.no_build)
    try:
        if a.command == "up":
            if not a.restart and c.is_running():
                _log(f"already running: {c.server}")
            else:
                c.start(timeout=a.timeout)
            print(f"export KUBECONFIG={c.kubeconfig}")
            print(f"export DILOCO_E2E_KUBECONFIG={c.kubeconfig}")
        elif a.command == "down":
            c.stop()
        elif a.command == "status":
            running = c.is_running()
            print(
                json.dumps(
                    {"running": running, "state_dir": str(c.state_dir), **c._read_info()}, indent=2
                )
            )
            return 0 if running else 1
        elif a.command == "env":
            print(f"export KUBECONFIG={c.kubeconfig}")
            print(f"export DILOCO_E2E_KUBECONFIG={c.kubeconfig}")
            dirs = dict.fromkeys(str(p.parent) for p in c.bins.all_paths())
            print(f"export PATH={':'.join(dirs)}:$PATH")
        elif a.command == "kubeconfig":
            print(c.kubeconfig)
    except ClusterError as e:
        _log(f"ERROR: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
