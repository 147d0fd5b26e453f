#!/usr/bin/env bash
# Build crdcheck: validates crds/*.yaml exactly as kube-apiserver does on create (structural
# schema, CEL compilation and cost) and DilocoRun manifests against it (schema, list-maps, CEL,
# unknown fields). Shares the e2e Go build cache, so after e2e/cluster/build.sh it is quick.
#   crds/validate/build.sh && ~/.cache/diloco-e2e/bin/crdcheck crds/diloco.dev_dilocoruns.yaml examples/*.yaml
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
CACHE="${DILOCO_E2E_CACHE:-$HOME/.cache/diloco-e2e}"
mkdir -p "$CACHE/bin"
GOCACHE="${DILOCO_E2E_GOCACHE:-$CACHE/go-build}" GOFLAGS=-mod=mod GOTOOLCHAIN="${GOTOOLCHAIN:-local}" \
  nice -n 19 go build -trimpath -o "$CACHE/bin/crdcheck" .
echo "$CACHE/bin/crdcheck"
