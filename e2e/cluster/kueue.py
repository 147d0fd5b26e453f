"""Kueue (sigs.k8s.io/kueue, built by build.sh) as a host process of a LocalCluster.

Kueue's manager serves its webhooks itself (Job defaulting/validation, its own types' defaults,
CRD conversion between v1beta1 and v1beta2). As a host process it cannot be reached through a
Service, so the webhook configurations and the CRDs' conversion webhooks point at
https://127.0.0.1:<port> (a kind cluster's API server, in a container, reaches this machine at
kind's network gateway instead), and the certificate is one we make:

- Kueue's internal certificate management stays on (the default; switching it off makes the
  manager read metrics certificates from the fixed path /etc/kueue/metrics/certs). Its rotator
  keeps a certificate it finds valid in the Secret kueue-system/kueue-webhook-server-cert, so the
  harness puts one there first: a CA (RSA, PKCS#1, with the DNS name kueue-ca, as the rotator
  checks) and a serving certificate for kueue-webhook-service.kueue-system.svc and IP 127.0.0.1.
  The rotator then injects that CA into the webhook configurations and CRDs; the files are also
  written to the manager's certDir (in a pod the Secret would be mounted there).
- Only the webhooks of what this manager serves are registered: batch/Job and Kueue's own
  types. A webhook of a disabled integration (pods, deployments, ...) would have failurePolicy
  Fail on a path nobody serves and block every Pod of the cluster.
- The visibility API server is off (feature gate VisibilityOnDemand=false): it would bind a
  fixed port on every interface and needs an APIService registration.

stop() removes the webhook configurations before it stops the process, so later tests are not
refused by webhooks nobody serves; the CRDs stay (they cost nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml
from procs import Processes, free_port, proc_alive

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
# Kueue's rotator derives these names from the webhook service name (kueue-webhook-service).
MUTATING = "kueue-mutating-webhook-configuration"
VALIDATING = "kueue-validating-webhook-configuration"
CONVERTED = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")
SERVED_PATH_PARTS = ("-batch-v1-job", "-kueue-x-k8s-io-")
BUILD_SH = Path(__file__).resolve().parent / "build.sh"


class Cluster(Protocol):
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]: ...


def kueue_dir(cache: Path, version: str) -> Path:
    return cache / f"kueue-{version}"


def ensure_built(build_sh: Path, home: Path) -> Path:
    """The kueue binary, built by `build.sh kueue` when missing."""
    binary = home / "bin" / "kueue"
    if not (home / "bin" / ".complete").exists() or not (home / "config" / ".complete").exists():
        result = subprocess.run(["bash", str(build_sh), "kueue"], stdout=sys.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"build.sh kueue failed with exit code {result.returncode}")
    return binary


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _addext(*extensions: str) -> list[str]:
    return [arg for ext in extensions for arg in ("-addext", ext)]


def make_certs(d: Path, host: str = "127.0.0.1") -> dict[str, bytes]:
    """ca.crt/ca.key (RSA, PKCS#1) and tls.crt/tls.key for the webhook service and `host`."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(d, "genrsa", "-traditional", "-out", "ca.key", "2048")
    _openssl(
        d,
        *["req", "-x509", "-new", "-key", "ca.key", "-out", "ca.crt", "-days", "3650"],
        *["-subj", "/O=kueue/CN=kueue-ca"],
        *_addext(
            "basicConstraints=critical,CA:TRUE",
            "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment",
            "subjectAltName=DNS:kueue-ca",
        ),
    )
    _openssl(d, "genrsa", "-traditional", "-out", "tls.key", "2048")
    _openssl(
        d,
        *["req", "-x509", "-new", "-key", "tls.key", "-out", "tls.crt", "-days", "365"],
        *["-CA", "ca.crt", "-CAkey", "ca.key", "-subj", f"/CN={SERVICE}.{NAMESPACE}.svc"],
        *_addext(
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth",
            f"subjectAltName=DNS:{SERVICE}.{NAMESPACE}.svc,IP:{host}",
        ),
    )
    for key in ("ca.key", "tls.key"):
        (d / key).chmod(0o600)
    return {name: (d / name).read_bytes() for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")}


def manager_config(
    webhook_port: int, health_port: int, cert_dir: Path, host: str = "127.0.0.1"
) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": host, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
    }


def webhook_configurations(manifests: str, endpoint: str, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations reduced to what this manager serves, pointed at it
    (`endpoint`: host:port)."""
    import base64

    bundle = base64.b64encode(ca).decode()
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if any(part in path for part in SERVED_PATH_PARTS):
                hook["clientConfig"] = {
                    "url": f"https://{endpoint}{path}",
                    "caBundle": bundle,
                }
                kept.append(hook)
        name = MUTATING if doc["kind"] == "MutatingWebhookConfiguration" else VALIDATING
        out.append({**doc, "metadata": {"name": name}, "webhooks": kept})
    return out


def crds_with_conversion(crd_dir: Path, endpoint: str, ca: bytes) -> list[dict[str, Any]]:
    """The CRDs, those Kueue converts between versions with their conversion webhook set."""
    import base64

    out = []
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "url": f"https://{endpoint}/convert",
                        "caBundle": base64.b64encode(ca).decode(),
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def install(c: Cluster, home: Path, endpoint: str, certs: dict[str, bytes]) -> None:
    """CRDs, namespace, the certificate Secret and the webhook configurations."""
    as_list = lambda objs: json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})  # noqa: E731
    crds = crds_with_conversion(home / "config" / "crds", endpoint, certs["ca.crt"])
    c.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=as_list(crds))
    c.kubectl("create", "namespace", NAMESPACE, check=False)
    import base64

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "data": {k: base64.b64encode(v).decode() for k, v in certs.items()},
    }
    manifests = (home / "config" / "webhooks.yaml").read_text()
    hooks = webhook_configurations(manifests, endpoint, certs["ca.crt"])
    c.kubectl("apply", "-f", "-", input=as_list([secret, *hooks]))
    names = [f"customresourcedefinition/{crd['metadata']['name']}" for crd in crds]
    c.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)


def uninstall_webhooks(c: Cluster) -> None:
    c.kubectl(
        "delete",
        f"mutatingwebhookconfiguration/{MUTATING}",
        f"validatingwebhookconfiguration/{VALIDATING}",
        "--ignore-not-found",
        check=False,
    )


def argv(binary: Path, config: Path, kubeconfig: Path) -> list[str]:
    return [
        str(binary),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        "--feature-gates=VisibilityOnDemand=false",
        "--zap-log-level=2",
    ]


def env(kubeconfig: Path) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(kubeconfig)}


def webhooks_answer(c: Cluster) -> bool:
    """A server-side dry run of a ResourceFlavor passes Kueue's webhooks: the manager serves."""
    flavor = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "e2e-probe"},
    }
    r = c.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(flavor), check=False)
    return r.returncode == 0


def wait_ready(c: Cluster, alive: Callable[[], bool], log: Path, timeout: float = 120) -> float:
    """Seconds until Kueue's webhooks answer; RuntimeError with the log tail otherwise."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not alive():
            break
        if webhooks_answer(c):
            return time.monotonic() - t0
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
    raise RuntimeError(f"kueue did not become ready within {timeout:.0f}s; log tail:\n{tail}")


def running(c: Cluster, procs: Processes) -> bool:
    """This cluster's Kueue runs and its webhooks answer."""
    pid = procs.recorded_pid("kueue")
    return pid is not None and proc_alive(pid) and webhooks_answer(c)


def start(
    c: Cluster,
    procs: Processes,
    home: Path,
    kubeconfig: Path,
    timeout: float,
    host: str = "127.0.0.1",
) -> float:
    """Install Kueue (CRDs, certificate, webhooks) for a manager run as a process of `procs`,
    serving its webhooks on `host` (an address of this machine the API server reaches), start it
    and wait for its webhooks; returns the seconds that took after the start."""
    binary = ensure_built(BUILD_SH, home)
    port, health = free_port(), free_port()
    state = procs.state_dir / "kueue"
    certs = make_certs(state / "certs", host)
    config = state / "config.yaml"
    config.write_text(json.dumps(manager_config(port, health, state / "certs", host)))
    install(c, home, f"{host}:{port}", certs)
    procs.spawn("kueue", argv(binary, config, kubeconfig), env=env(kubeconfig))
    proc = procs.popen["kueue"]
    return wait_ready(c, lambda: proc.poll() is None, procs.log_path("kueue"), timeout)


def stop(c: Cluster, procs: Processes, timeout: float) -> None:
    """Remove the webhook configurations (nothing would serve them), then stop the manager."""
    uninstall_webhooks(c)
    pid = procs.recorded_pid("kueue")
    if pid is not None:
        procs.terminate([pid], {pid: "kueue"}, timeout)
    procs.forget("kueue")
