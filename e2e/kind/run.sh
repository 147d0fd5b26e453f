#!/usr/bin/env bash
# The e2e suite on a kind cluster (make e2e-kind). The cluster is made here, offline, by
# e2e/kind/cluster.sh: kind from the Go module proxy, its base and node images built from the
# project's own Kubernetes binaries and Debian's packages (images.sh), nodes in a Docker engine of
# their own (engine.sh). Its one node is the suite's real node (the real-pods modules run their
# containers there), the fake GKE TPU node pools come from KWOK on this host
# (e2e/kind/fake_nodes.py, same stages as the local control plane), and the suite's operator runs
# as on the local control plane (DILOCO_E2E_OPERATOR: local by default; the real-pods modules
# install the chart's operator into the cluster).
#
# Usage: e2e/kind/run.sh [--keep] [pytest args...]   (default args: the make e2e selection)
#   --keep   leave the cluster (and kwok) running; delete later with: e2e/kind/run.sh --down
#   --down   stop kwok and delete the kind cluster
# Env: KIND_CLUSTER (default diloco-e2e), PYTHON (default .venv/bin/python)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER:-diloco-e2e}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ "$PY" == /* ]] || PY="$PWD/$PY"   # (a relative PYTHON is the caller's)
log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
[[ -x "$PY" ]] || { log "ERROR: no venv at $PY (make venv)"; exit 1; }

keep=0
if [[ "${1:-}" == "--down" ]]; then
  KC="${DILOCO_E2E_CACHE:-$HOME/.cache/diloco-e2e}/kind-$CLUSTER/kubeconfig"
  [[ -f "$KC" ]] && "$PY" "$REPO/e2e/kind/fake_nodes.py" down --kubeconfig "$KC" --state-dir "$(dirname "$KC")" || true
  bash "$REPO/e2e/kind/cluster.sh" down "$CLUSTER"
  exit 0
fi
if [[ "${1:-}" == "--keep" ]]; then keep=1; shift; fi

bash "$REPO/e2e/cluster/build.sh" >/dev/null   # kubectl, helm, kwok, ... of the pinned versions
KC=$(bash "$REPO/e2e/kind/cluster.sh" up "$CLUSTER")
STATE="$(dirname "$KC")"

log "fake GKE TPU node pools (kwok)"
"$PY" "$REPO/e2e/kind/fake_nodes.py" up --kubeconfig "$KC" --state-dir "$STATE"

cleanup() {
  if [[ $keep == 0 ]]; then
    "$PY" "$REPO/e2e/kind/fake_nodes.py" down --kubeconfig "$KC" --state-dir "$STATE" || true
    bash "$REPO/e2e/kind/cluster.sh" down "$CLUSTER" || true
  else
    log "kept: KUBECONFIG=$KC; delete with e2e/kind/run.sh --down"
  fi
}
trap cleanup EXIT

log "running the e2e suite against kind cluster $CLUSTER"
export DILOCO_E2E_KUBECONFIG="$KC"
cd "$REPO"
[[ $# -gt 0 ]] || set -- -q e2e -m "not two_clusters and not bench"
"$PY" -m pytest "$@"
