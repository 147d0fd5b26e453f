"""etcd: one member on 127.0.0.1, its data in the state dir, no fsync (the cluster is
throwaway)."""

from __future__ import annotations

import os
from pathlib import Path

from procs import Processes, http_ok


def argv(binary: Path, data_dir: Path, client_url: str, peer_url: str) -> list[str]:
    return [
        str(binary),
        "--name=e2e",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=e2e={peer_url}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
        "--quota-backend-bytes=2147483648",
        # Benches with thousands of pods raise the quota and compact often: a run of 9,216 pods
        # filled 2 GiB of revisions (pod status changes, events) and etcd refused every write.
        *os.environ.get("DILOCO_E2E_ETCD_ARGS", "").split(),
    ]


def start(procs: Processes, binary: Path, ports: dict[str, int], deadline: float) -> str:
    """Start etcd and wait until it is healthy; returns its client URL."""
    url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    procs.spawn("etcd", argv(binary, procs.state_dir / "etcd", url, peer_url))
    procs.wait("etcd", lambda: http_ok(f"{url}/health", b'"health":"true"'), deadline)
    return url
