#!/usr/bin/env bash
# Start the local real control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok + fake GKE TPU nodes) on 127.0.0.1. Builds the binaries first if they are
# not cached yet (see build.sh). Idempotent: a healthy running cluster is kept (--restart to force).
# Prints `export KUBECONFIG=...` lines on stdout: eval "$(e2e/cluster/up.sh)"
# Usage: e2e/cluster/up.sh [--state-dir DIR] [--timeout SECONDS] [--restart]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$HERE/build.sh" >/dev/null
exec python3 "$HERE/cli.py" up --no-build "$@"
