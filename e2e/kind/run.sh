#!/usr/bin/env bash
# The e2e suite on kind, for people with Docker (CI here has none: it uses the local control plane,
# see docs/e2e.md). Creates a kind cluster, builds and loads the images, adds fake GKE TPU node
# pools (KWOK, run from this machine), and runs `pytest e2e` against the cluster with the chart's
# operator running IN the cluster (image diloco-operator:dev).
#
# Usage: e2e/kind/run.sh [--keep] [pytest args...]
#   --keep   leave the cluster (and kwok) running; delete later with: e2e/kind/run.sh --down
#   --down   stop kwok and delete the kind cluster
# Env: KIND_CLUSTER (default diloco-e2e), KIND_IMAGE (node image, default kind's), PYTHON (.venv)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER:-diloco-e2e}"
STATE="${XDG_CACHE_HOME:-$HOME/.cache}/diloco-e2e/kind-$CLUSTER"
KC="$STATE/kubeconfig"
PY="${PYTHON:-$REPO/.venv/bin/python}"
log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

keep=0
if [[ "${1:-}" == "--down" ]]; then
  [[ -f "$KC" ]] && "$PY" "$REPO/e2e/kind/fake_nodes.py" down --kubeconfig "$KC" --state-dir "$STATE" || true
  kind delete cluster --name "$CLUSTER"
  exit 0
fi
if [[ "${1:-}" == "--keep" ]]; then keep=1; shift; fi

for tool in docker kind; do
  command -v "$tool" >/dev/null || { log "ERROR: $tool is not installed"; exit 1; }
done
[[ -x "$PY" ]] || { log "ERROR: no venv at $PY (make venv)"; exit 1; }
# kubectl, helm and kwok of the pinned versions (built once, cached; see e2e/cluster/build.sh).
bash "$REPO/e2e/cluster/build.sh"
mkdir -p "$STATE"

if ! kind get clusters | grep -qx "$CLUSTER"; then
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" ${KIND_IMAGE:+--image "$KIND_IMAGE"} --kubeconfig "$KC" --wait 120s
else
  kind get kubeconfig --name "$CLUSTER" > "$KC"
fi

log "building images"
docker build -q -f "$REPO/docker/operator.Dockerfile" -t diloco-operator:dev "$REPO"
docker build -q -f "$REPO/docker/trainer-cpu.Dockerfile" -t diloco-trainer-cpu:dev "$REPO"
kind load docker-image --name "$CLUSTER" diloco-operator:dev diloco-trainer-cpu:dev

# The real node only takes the operator: fake-node workloads (TPU learners, syncers of the
# examples, whose images are placeholders) must land on the KWOK nodes.
REAL_NODE="$CLUSTER-control-plane"
KUBECTL="$(bash "$REPO/e2e/cluster/build.sh" --print-bin-dirs | head -1)/kubectl"
"$KUBECTL" --kubeconfig "$KC" taint node "$REAL_NODE" diloco-e2e/real=true:NoSchedule --overwrite

log "fake GKE TPU node pools (kwok)"
"$PY" "$REPO/e2e/kind/fake_nodes.py" up --kubeconfig "$KC" --state-dir "$STATE"

cleanup() {
  if [[ $keep == 0 ]]; then
    "$PY" "$REPO/e2e/kind/fake_nodes.py" down --kubeconfig "$KC" --state-dir "$STATE" || true
    kind delete cluster --name "$CLUSTER" || true
  else
    log "kept: KUBECONFIG=$KC; delete with e2e/kind/run.sh --down"
  fi
}
trap cleanup EXIT

log "running the e2e suite against $CLUSTER (operator in the cluster)"
export DILOCO_E2E_KUBECONFIG="$KC"
export DILOCO_E2E_OPERATOR=incluster
export DILOCO_E2E_HELM_ARGS="--set image.repository=diloco-operator --set image.tag=dev \
--set image.pullPolicy=Never --set-string nodeSelector.kubernetes\.io/hostname=$REAL_NODE \
--set tolerations[0].key=diloco-e2e/real --set tolerations[0].operator=Exists \
--set tolerations[0].effect=NoSchedule"
cd "$REPO"
"$PY" -m pytest e2e "$@"
