#!/usr/bin/env python3
"""Fake GKE TPU node pools on an existing cluster (kind): the same nodes and KWOK stage config the
local control plane uses (e2e/cluster/harness.py), with KWOK running here, out of cluster, against
the cluster's kubeconfig. Only nodes annotated kwok.x-k8s.io/node=fake are touched.

    fake_nodes.py up   --kubeconfig KC --state-dir DIR   # create nodes, start kwok (background)
    fake_nodes.py down --kubeconfig KC --state-dir DIR   # stop kwok, delete the fake nodes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e.cluster import harness

# Pod IPs KWOK hands out on the fake nodes: a range kind's own pods never use.
POD_CIDR = "10.250.0.0/16"


def kubectl(kc: str, *args: str, input: str | None = None) -> str:
    b = harness.binaries(build=True)
    r = subprocess.run(
        [str(b.kubectl), "--kubeconfig", kc, *args], input=input, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def up(kc: str, state: Path) -> None:
    b = harness.binaries(build=True)
    state.mkdir(parents=True, exist_ok=True)
    version = json.loads(kubectl(kc, "version", "-o", "json"))["serverVersion"]["gitVersion"]
    nodes = harness.node_manifests(harness.default_node_pools(), version)
    kubectl(
        kc,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}),
    )
    cfg = state / "kwok.yaml"
    cfg.write_text(harness.kwok_config(b.kwok_stages))
    pid_file = state / "kwok.pid"
    if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
        print(f"kwok already running (pid {pid_file.read_text().strip()})")
        return
    (state / "home").mkdir(exist_ok=True)
    with open(state / "kwok.log", "ab") as log:
        p = subprocess.Popen(
            [
                str(b.kwok),
                f"--kubeconfig={kc}",
                f"--config={cfg}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector="
                f"{harness.KWOK_NODE_ANNOTATION[0]}={harness.KWOK_NODE_ANNOTATION[1]}",
                "--node-lease-duration-seconds=40",
                f"--cidr={POD_CIDR}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "HOME": str(state / "home")},
        )
    pid_file.write_text(str(p.pid))
    names = [n["metadata"]["name"] for n in nodes]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = json.loads(kubectl(kc, "get", "nodes", "-o", "json"))["items"]
        ready = {
            n["metadata"]["name"]
            for n in got
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions") or []
            )
        }
        if set(names) <= ready:
            print(f"{len(names)} fake nodes Ready; kwok pid {p.pid}, log {state / 'kwok.log'}")
            return
        if p.poll() is not None:
            raise SystemExit(f"kwok exited {p.returncode}; see {state / 'kwok.log'}")
        time.sleep(1)
    raise SystemExit(f"fake nodes not Ready after 120 s; see {state / 'kwok.log'}")


def down(kc: str, state: Path) -> None:
    pid_file = state / "kwok.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        pid_file.unlink()
    key, value = harness.KWOK_NODE_ANNOTATION
    got = json.loads(kubectl(kc, "get", "nodes", "-o", "json"))["items"]
    fake = [
        n["metadata"]["name"]
        for n in got
        if (n["metadata"].get("annotations") or {}).get(key) == value
    ]
    if fake:
        kubectl(kc, "delete", "node", *fake, "--wait=false")
    print(f"kwok stopped; {len(fake)} fake nodes deleted")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--state-dir", required=True, type=Path)
    a = ap.parse_args()
    (up if a.command == "up" else down)(a.kubeconfig, a.state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
