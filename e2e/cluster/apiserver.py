"""kube-apiserver, and what it and its clients authenticate with: a throwaway CA with serving and
client certificates, the service-account signing key (openssl CLI), and a kubeconfig per client.
Also the HTTP client the harness uses on it (the admin certificate, urllib)."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import real_node
import real_node_config
from procs import ClusterError, Processes, run

# Every address the fake cluster hands out is on loopback, so that code under test that tries to
# reach a pod or service IP only ever talks to this machine (connection refused, or a real local
# process a test bound there on purpose); nothing is ever sent to a private or public range (the
# pod range is kwok's, kwok.POD_CIDR).
# With the real node (real_node.py, on by default as root) Services need addresses that pods can
# reach: the node's range, whose packets a guard chain keeps on this machine.
REAL_NODE = real_node.enabled()
SERVICE_CIDR = real_node_config.SERVICE_CIDR if REAL_NODE else "127.64.0.0/20"
KUBERNETES_SERVICE_IP = real_node_config.KUBERNETES_SERVICE_IP if REAL_NODE else "127.64.0.1"
# The clients with a certificate of their own, and a kubeconfig written once the server is up.
CLIENTS = ("admin", "kube-controller-manager", "kube-scheduler", "kwok")

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


class PKI:
    """A throwaway CA plus serving/client certificates and the service-account key (openssl CLI)."""

    def __init__(self, d: Path):
        self.d = d

    def _openssl(self, *args: str) -> None:
        if not shutil.which("openssl"):
            raise ClusterError("the openssl command is needed to make the cluster's certificates")
        run(["openssl", *args], cwd=self.d)

    def generate(self, node: real_node_config.Site | None = None) -> None:
        """node: the site of the cluster's real node (its gateway is the apiserver's address for
        pods, and its programs get client certificates), or None without one."""
        self.d.mkdir(parents=True, exist_ok=True)
        self._openssl(
            *["req", "-x509", "-new", *_EC_KEY, "-keyout", "ca.key", "-out", "ca.crt"],
            *["-days", "3650", "-subj", "/CN=diloco-e2e-ca"],
            *_addext(
                "basicConstraints=critical,CA:TRUE",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            ),
        )
        sans = ",".join(
            [
                "IP:127.0.0.1",
                f"IP:{KUBERNETES_SERVICE_IP}",
                *([f"IP:{node.gateway}"] if node else []),
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
        if node:
            self._real_node_leaves(node)
        self._openssl(
            "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key"
        )
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        for k in self.d.glob("*.key"):
            k.chmod(0o600)

    def _real_node_leaves(self, site: real_node_config.Site) -> None:
        # the real node's programs, each with the identity a cluster gives it
        self.leaf("kubelet", f"/O=system:nodes/CN=system:node:{site.node_name}", "clientAuth")
        self.leaf("kube-proxy", "/CN=system:kube-proxy", "clientAuth")
        self.leaf("coredns", "/O=system:masters/CN=coredns", "clientAuth")
        # the apiserver's identity towards kubelets (kubectl logs/exec)
        self.leaf(
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "clientAuth",
        )

    def leaf(self, name: str, subj: str, usage: str, sans: str | None = None) -> None:
        ext = _addext(
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={usage}",
            *([f"subjectAltName={sans}"] if sans else []),
        )
        self._openssl(
            *["req", "-x509", "-new", *_EC_KEY, "-CA", "ca.crt", "-CAkey", "ca.key"],
            *["-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "365", "-subj", subj],
            *ext,
        )

    def path(self, name: str) -> Path:
        return self.d / name


def _addext(*extensions: str) -> list[str]:
    return [arg for ext in extensions for arg in ("-addext", ext)]


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


def argv(
    binary: Path,
    pki: PKI,
    port: int,
    etcd_url: str,
    cert_dir: Path,
    node: real_node_config.Site | None,
) -> list[str]:
    """With the real node, pods reach the apiserver at the bridge's gateway address."""
    if node:
        network = [
            f"--advertise-address={node.gateway}",
            "--bind-address=0.0.0.0",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={pki.path('apiserver-kubelet-client.crt')}",
            f"--kubelet-client-key={pki.path('apiserver-kubelet-client.key')}",
        ]
    else:
        network = [
            "--advertise-address=127.0.0.1",
            "--bind-address=127.0.0.1",
            "--endpoint-reconciler-type=none",
        ]
    return [
        str(binary),
        *network,
        f"--secure-port={port}",
        f"--etcd-servers={etcd_url}",
        f"--cert-dir={cert_dir}",
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
    ]


def start(
    procs: Processes,
    binary: Path,
    pki: PKI,
    port: int,
    etcd_url: str,
    deadline: float,
    node: real_node_config.Site | None = None,
) -> str:
    """Start kube-apiserver and wait until /readyz answers 200; returns its URL."""
    server = f"https://127.0.0.1:{port}"
    procs.spawn(
        "kube-apiserver", argv(binary, pki, port, etcd_url, procs.state_dir / "apiserver", node)
    )
    procs.wait(
        "kube-apiserver", lambda: request(server, pki, "/readyz", timeout=5)[0] == 200, deadline
    )
    return server


def write_kubeconfigs(pki: PKI, server: str, admin: Path) -> None:
    """The cluster-admin kubeconfig at `admin`, the other clients' as <client>.kubeconfig in
    the PKI dir."""
    for user in CLIENTS:
        write_kubeconfig(
            admin if user == "admin" else pki.path(f"{user}.kubeconfig"),
            server,
            pki.path("ca.crt"),
            pki.path(f"{user}.crt"),
            pki.path(f"{user}.key"),
            user,
        )


def request(
    server: str,
    pki: PKI,
    path: str,
    method: str = "GET",
    body: dict | None = None,
    content_type: str = "application/json",
    timeout: float = 10,
) -> tuple[int, bytes]:
    """One HTTP request as the cluster admin (client certificate): (status, body)."""
    ctx = ssl.create_default_context(cafile=str(pki.path("ca.crt")))
    ctx.load_cert_chain(str(pki.path("admin.crt")), str(pki.path("admin.key")))
    req = urllib.request.Request(
        server + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def nodes_ready(server: str, pki: PKI, names: list[str]) -> bool:
    """Every node named is Ready."""
    code, body = request(server, pki, "/api/v1/nodes")
    if code != 200:
        return False
    ready = set()
    for n in json.loads(body)["items"]:
        for c in n.get("status", {}).get("conditions") or []:
            if c["type"] == "Ready" and c["status"] == "True":
                ready.add(n["metadata"]["name"])
    return all(n in ready for n in names)
