#!/usr/bin/env python3
"""The local cluster's commands; up.sh and down.sh run them, and so does `harness.py <command>`.

    cli.py up [--state-dir D] [--timeout S] [--restart]   start (a healthy running one is kept)
    cli.py down [--state-dir D]        stop, and verify that no process of it is left
    cli.py status [--state-dir D]      JSON: running?, ports, pids, versions, start timings
    cli.py env [--state-dir D]         export lines: KUBECONFIG, and PATH with the built binaries
    cli.py kubeconfig [--state-dir D]  the admin kubeconfig's path

Without --no-build, missing binaries are built first (build.sh).
"""

from __future__ import annotations

import argparse
import json
import sys

from harness import LocalCluster
from procs import ClusterError, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="A real Kubernetes control plane on 127.0.0.1, without Docker, for the e2e tests."
    )
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
        return _command(c, a)
    except ClusterError as e:
        log(f"ERROR: {e}")
        return 1


def _command(c: LocalCluster, a: argparse.Namespace) -> int:
    if a.command == "up":
        if not a.restart and c.is_running():
            log(f"already running: {c.server}")
        else:
            c.start(timeout=a.timeout)
        print(f"export KUBECONFIG={c.kubeconfig}")
        print(f"export DILOCO_E2E_KUBECONFIG={c.kubeconfig}")
    elif a.command == "down":
        c.stop()
    elif a.command == "status":
        running = c.is_running()
        info = {"running": running, "state_dir": str(c.state_dir), **c._read_info()}
        print(json.dumps(info, indent=2))
        return 0 if running else 1
    elif a.command == "env":
        print(f"export KUBECONFIG={c.kubeconfig}")
        print(f"export DILOCO_E2E_KUBECONFIG={c.kubeconfig}")
        dirs = dict.fromkeys(str(p.parent) for p in c.bins.all_paths())
        print(f"export PATH={':'.join(dirs)}:$PATH")
    elif a.command == "kubeconfig":
        print(c.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
