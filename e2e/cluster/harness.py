#!/usr/bin/env python3
"""A real Kubernetes control plane on 127.0.0.1, without Docker, for the e2e tests.

Processes (binaries built and cached by build.sh, versions pinned in versions.env):
  etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and kwok, which plays the
  kubelets of fake nodes labelled like GKE TPU node pools (and a couple of CPU nodes).

This module composes them; each component is a module of its own (README.md has the table):
procs.py (spawning, waiting for and stopping the processes), binaries.py, etcd.py, apiserver.py
(with the certificates and kubeconfigs), controllers.py, kwok.py (the fake nodes), real_node.py
(the real node), images.py and kueue.py. They import each other as top-level modules, as they do
when run as scripts; importing the package e2e.cluster puts this directory on sys.path for that.

Python stdlib only (plus the openssl CLI for the certificates); it talks to the API server with
urllib and shells out to the cached kubectl.

Use from Python (e.g. as a pytest fixture):

    from e2e.cluster.harness import cluster          # or: import harness
    with cluster() as c:                             # local one, or an existing one (see below)
        c.kubectl("get", "nodes")
        print(c.kubeconfig)

    c = LocalCluster(state_dir); c.start(); ...; c.stop()

CLI (cli.py, what up.sh / down.sh call; `harness.py <command>` runs it too):
    cli.py up [--state-dir D]      start (idempotent: a healthy running cluster is kept)
    cli.py down [--state-dir D]    stop, and verify that no process of it is left
    cli.py status|env|kubeconfig [--state-dir D]

Which cluster cluster() gives (env DILOCO_E2E_CLUSTER = auto | local | existing, default auto):
    auto:     DILOCO_E2E_KUBECONFIG if set, else KUBECONFIG if set, else a local cluster
    local:    always the local cluster (started here, stopped at the end)
    existing: DILOCO_E2E_KUBECONFIG, KUBECONFIG or ~/.kube/config; never starts anything
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import apiserver
import controllers
import etcd
import kueue
import kwok
import real_node
import real_node_config
from apiserver import PKI, REAL_NODE, write_kubeconfig
from binaries import (
    Binaries,
    binaries,
    cache_root,
    default_state_dir,
    expected_binaries,
    read_versions,
)
from images import build_images, image_tar

# `X as X`: re-exported for the tests, smoke.py and e2e/kind
from kwok import KWOK_NODE_ANNOTATION as KWOK_NODE_ANNOTATION
from kwok import NODE_NOT_READY_LABEL as NODE_NOT_READY_LABEL
from kwok import POD_FAIL_LABEL as POD_FAIL_LABEL
from kwok import NodePool, default_node_pools, node_manifests
from kwok import kwok_config as kwok_config
from procs import ClusterError, Processes, free_port, log, proc_alive, reset_state_dir

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
# Started on request (start_kueue), stopped with the cluster.
ON_REQUEST = ("kueue",)
COMPONENTS = CONTROL_PLANE + (real_node.NODE_COMPONENTS if REAL_NODE else ())
# What a site's node imports besides the sandbox image: the home node runs the operator too.
SITE_IMAGES = {"home": ("trainer", "operator"), "away": ("trainer",)}
PORTS = ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler")
DEFAULT_SERVICE_ACCOUNT = "/api/v1/namespaces/default/serviceaccounts/default"


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

    def info(self) -> dict[str, Any]:
        """What the cluster's maker recorded about it (cluster.json): its real node and the
        images loaded there, among others; empty when nothing was recorded."""
        return {}

    # -- Kueue (kueue.py) as a process of this machine, for the tests that need it
    def kueue_host(self) -> str | None:
        """The address of this machine at which the cluster's API server reaches Kueue's
        webhooks; None where Kueue cannot serve this cluster as a process here."""
        return None

    def _kueue_procs(self) -> Processes:  # pragma: no cover - overridden where Kueue runs
        raise ClusterError("this cluster cannot run Kueue as a process of this machine")

    def start_kueue(self, timeout: float = 120) -> float:
        """Install Kueue's CRDs and webhooks and run its manager (built by `build.sh kueue`)
        as a process of this machine; idempotent while it runs. Seconds until its webhooks
        answered (0 when it already ran)."""
        host = self.kueue_host()
        if host is None:
            raise ClusterError("this cluster cannot run Kueue as a process of this machine")
        procs = self._kueue_procs()
        if kueue.running(self, procs):
            return 0.0
        home = kueue.kueue_dir(cache_root(), read_versions()["KUEUE_VERSION"])
        return kueue.start(self, procs, home, self.kubeconfig, timeout, host)

    def stop_kueue(self, timeout: float = 15) -> None:
        """Remove Kueue's webhook configurations (nothing would serve them), then stop it."""
        kueue.stop(self, self._kueue_procs(), timeout)

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

    def info(self) -> dict[str, Any]:
        """cluster.json beside the kubeconfig, as e2e/kind/cluster.sh writes it for its clusters."""
        path = self.kubeconfig.parent / "cluster.json"
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}

    def kueue_host(self) -> str | None:
        """A kind cluster's API server, in a container, reaches this machine at kind's gateway."""
        gateway = self.info().get("gateway")
        return str(gateway) if gateway else None

    def _kueue_procs(self) -> Processes:
        state = self.kubeconfig.parent
        for sub in ("logs", "pids"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        return Processes(state, ON_REQUEST, cache_root())


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
        site: real_node_config.Site = real_node_config.HOME,
    ):
        """site: where this cluster's real node lives on the machine (real_node_config.HOME, or
        AWAY for a second cluster beside it); no real node without root."""
        self.state_dir = (
            Path(state_dir).expanduser().resolve() if state_dir else default_state_dir().resolve()
        )
        self.node_pools = node_pools if node_pools is not None else default_node_pools()
        self.build = build
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.versions = read_versions()
        self._bins: Binaries | None = None
        self.site = site if REAL_NODE else None
        self.components = CONTROL_PLANE + (real_node.node_components(site) if self.site else ())
        self.procs = Processes(self.state_dir, self.components + ON_REQUEST, cache_root())
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

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    # -- HTTP to the API server (admin client certificate)
    def api(
        self,
        path: str,
        method: str = "GET",
        body: dict | None = None,
        content_type: str = "application/json",
        timeout: float = 10,
    ) -> tuple[int, bytes]:
        return apiserver.request(self.server, self.pki, path, method, body, content_type, timeout)

    # -- lifecycle
    def is_running(self) -> bool:
        """True when every component recorded in state_dir is alive and the API server is ready."""
        info = self._read_info()
        if not info:
            return False
        for name in self.components:
            pid = self.procs.recorded_pid(name)
            if pid is None or not proc_alive(pid):
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
        self._prepare()
        procs, pki = self.procs, self.pki
        etcd_url = etcd.start(procs, bins.etcd, self.ports, deadline)
        self._took("etcd_ready_s", t_start)
        apiserver.start(
            procs, bins.kube_apiserver, pki, self.ports["apiserver"], etcd_url, deadline, self.site
        )
        self._took("apiserver_ready_s", t_start)
        apiserver.write_kubeconfigs(pki, self.server, self.kubeconfig)
        controllers.start(procs, bins.kube_controller_manager, bins.kube_scheduler, pki, self.ports)
        # the fake nodes are created while the controllers come up
        nodes = node_manifests(self.node_pools, self.versions["K8S_VERSION"])
        kwok.start(procs, bins.kwok, bins.kwok_stages, pki, self._apply, nodes)
        controllers.wait_healthy(procs, self.ports, deadline)
        kwok.wait_nodes_ready(procs, self.server, pki, nodes, deadline)
        self._took("nodes_ready_s", t_start)
        if self.node is not None:
            self._start_real_node(deadline + 600)  # image imports are not start-up time
            self._took("real_node_ready_s", t_start)
        procs.wait(
            "kube-controller-manager",
            self._default_service_account,
            deadline,
            what="default ServiceAccount",
        )
        self._took("total_start_s", t_start)
        self._write_info()
        log(
            f"cluster up in {self.timings['total_start_s']}s: {self.server}, "
            f"{len(nodes)} nodes; KUBECONFIG={self.kubeconfig}"
        )
        return self

    def _prepare(self) -> None:
        """Leftovers of an earlier run in this state dir stopped, the dir wiped, ports picked,
        certificates made; with the real node, its machine prepared (packages, the bridge and the
        guard: the apiserver advertises the bridge's address)."""
        t0 = time.monotonic()
        self.stop(quiet=True)
        reset_state_dir(self.state_dir)
        self.ports = {k: free_port() for k in PORTS}
        self.pki.generate(self.site)
        self._took("certs_s", t0)
        if self.site:
            self.node = self._new_node()
            self.node.lock()
            self.node.prepare()

    def stop(self, quiet: bool = False, timeout: float = 15) -> None:
        """Stop every process of this cluster (by recorded pid, then by a /proc scan for any
        process of our binaries whose command line names this state dir) and verify none is left.
        Raises ClusterError if one survives SIGKILL."""
        if self.site:
            self._stop_real_node(timeout)
        # etcd last: an API server whose etcd is gone hangs in its graceful shutdown
        self.procs.stop_all(CONTROL_PLANE + ON_REQUEST, last="etcd", quiet=quiet, timeout=timeout)

    # -- Kueue (kueue.py), for the tests that need it
    def kueue_host(self) -> str | None:
        return "127.0.0.1"

    def _kueue_procs(self) -> Processes:
        return self.procs

    def start_kueue(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        ready = super().start_kueue(timeout)
        if ready:
            self._took("kueue_ready_s", t0)
            log(
                f"kueue up in {self.timings['kueue_ready_s']}s (webhooks answered after {ready:.1f}s)"
            )
        return ready

    # -- the real node (real_node.py)
    def _new_node(self) -> real_node.RealNode:
        assert self.site is not None
        return real_node.RealNode(
            self.state_dir,
            cache_root(),
            self.bins.node,
            self.procs.spawn,
            self._apply,
            log,
            self.site,
        )

    def _start_real_node(self, deadline: float) -> None:
        node = self.node
        assert node is not None
        t0 = time.monotonic()
        node.start_runtime()
        self.images = build_images()
        tars = {real_node_config.PAUSE_IMAGE: node.pause_tar()}
        wanted = SITE_IMAGES[node.site.key]
        tars.update({img: image_tar(img) for role, img in self.images.items() if role in wanted})
        node.import_images(tars)
        self._took("images_s", t0)
        node.start_kubelet(self.pki, self.server, free_port, write_kubeconfig)
        if node.site.services:
            node.make_volumes()
        self.procs.wait(
            "kubelet",
            lambda: apiserver.nodes_ready(self.server, self.pki, [node.name]),
            deadline,
            what="real node Ready",
        )
        self.procs.wait(
            "kubelet", self._default_service_account, deadline, what="default ServiceAccount"
        )

    def _stop_real_node(self, timeout: float) -> None:
        node = self.node or self._new_node()
        api_up = self.procs.recorded_pid("kube-apiserver") is not None and bool(
            self.ports or self._read_info()
        )
        if not self.ports:
            self.ports = self._read_info().get("ports", {})
        node.stop(
            self.kubectl if api_up else None,
            lambda names: self.procs.terminate_named(names, timeout),
        )
        self.node = None

    # -- internals
    def _took(self, timing: str, since: float) -> None:
        self.timings[timing] = round(time.monotonic() - since, 2)

    def _apply(self, objs: list[dict[str, Any]]) -> None:
        if not objs:  # a cluster without fake nodes
            return
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}),
        )

    def _default_service_account(self) -> bool:
        return self.api(DEFAULT_SERVICE_ACCOUNT)[0] == 200

    def _scan_leftovers(self) -> dict[int, str]:
        return self.procs.scan_leftovers()

    def _write_info(self) -> None:
        info = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "pids": {n: p.pid for n, p in self.procs.popen.items()},
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

    def info(self) -> dict[str, Any]:
        return self._read_info()

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
        log(f"using the existing cluster of {path}")
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
            log(
                f"keeping the cluster (DILOCO_E2E_KEEP): stop it with "
                f"e2e/cluster/down.sh --state-dir {c.state_dir}"
            )
        else:
            c.stop()


if __name__ == "__main__":  # `harness.py up|down|status|env|kubeconfig`: the commands of cli.py
    import cli

    sys.exit(cli.main())
