"""kube-controller-manager (every controller, service-account tokens signed with the cluster's key,
the CA signing CSRs) and kube-scheduler, each serving its health on its own loopback port."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from apiserver import PKI, SERVICE_CIDR
from procs import Processes, http_ok


def _serving_argv(binary: Path, kubeconfig: Path, port: int, cert_dir: Path) -> list[str]:
    """What both components share: one kubeconfig for the API, authentication and
    authorization, health on a loopback port, no leader election (one replica)."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def controller_manager_argv(binary: Path, pki: PKI, port: int, cert_dir: Path) -> list[str]:
    kc = pki.path("kube-controller-manager.kubeconfig")
    return [
        *_serving_argv(binary, kc, port, cert_dir),
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.path('sa.key')}",
        f"--root-ca-file={pki.path('ca.crt')}",
        f"--cluster-signing-cert-file={pki.path('ca.crt')}",
        f"--cluster-signing-key-file={pki.path('ca.key')}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--cluster-name=diloco-e2e",
        # Benches with thousands of fake nodes set more (e.g. a longer node monitor grace period:
        # KWOK's leases lag on 2 cores and the node controller would taint nodes not-ready).
        *os.environ.get("DILOCO_E2E_CONTROLLER_MANAGER_ARGS", "").split(),
    ]


def scheduler_argv(binary: Path, pki: PKI, port: int, cert_dir: Path) -> list[str]:
    return [
        *_serving_argv(binary, pki.path("kube-scheduler.kubeconfig"), port, cert_dir),
        # Benches placing thousands of pods raise its client rate limit (50 requests/s: one
        # binding and one event per pod).
        *os.environ.get("DILOCO_E2E_SCHEDULER_ARGS", "").split(),
    ]


def start(
    procs: Processes, controller_manager: Path, scheduler: Path, pki: PKI, ports: dict[str, int]
) -> None:
    """Start both; wait_healthy() waits for them (other components start meanwhile)."""
    st = procs.state_dir
    procs.spawn(
        "kube-controller-manager",
        controller_manager_argv(
            controller_manager, pki, ports["controller_manager"], st / "kube-controller-manager"
        ),
    )
    procs.spawn(
        "kube-scheduler",
        scheduler_argv(scheduler, pki, ports["scheduler"], st / "kube-scheduler"),
    )


def wait_healthy(procs: Processes, ports: dict[str, int], deadline: float) -> None:
    procs.wait("kube-controller-manager", _healthz(ports["controller_manager"]), deadline)
    procs.wait("kube-scheduler", _healthz(ports["scheduler"]), deadline)


def _healthz(port: int) -> Callable[[], bool]:
    return lambda: http_ok(f"https://127.0.0.1:{port}/healthz", b"ok", insecure=True)
