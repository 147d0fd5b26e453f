#!/usr/bin/env bash
# Build two checkers that run the API server's own Go validation code, without a cluster.
# crdcheck: validates crds/*.yaml exactly as kube-apiserver does on create (structural
# schema, CEL compilation and cost) and DilocoRun manifests against it (schema, list-maps, CEL,
# unknown fields). objcheck (objcheck/, built from k8s.io/kubernetes like the e2e apiserver):
# validates the Jobs, Services, Deployments, Secrets, ConfigMaps, PVCs, NetworkPolicies and
# PodDisruptionBudgets the builders produce with kube-apiserver's create validation. vapcheck
# (vapcheck/, in crdcheck's module) evaluates the chart's ValidatingAdmissionPolicy with
# kube-apiserver's own policy code against a table of authorization grants. All share the e2e
# Go build cache, so after e2e/cluster/build.sh they build in a minute or two.
#   crds/validate/build.sh && ~/.cache/diloco-e2e/bin/crdcheck crds/diloco.dev_dilocoruns.yaml examples/*.yaml
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# As e2e/cluster/build.sh builds: with cgo on, every package that imports net compiles anew, and
# the k8s.io modules (the same versions) could not come from the shared Go build cache.
export CGO_ENABLED=0
CACHE="${DILOCO_E2E_CACHE:-$HOME/.cache/diloco-e2e}"
mkdir -p "$CACHE/bin"
GOCACHE="${DILOCO_E2E_GOCACHE:-$CACHE/go-build}" GOFLAGS=-mod=mod GOTOOLCHAIN="${GOTOOLCHAIN:-local}" \
  nice -n 19 go build -trimpath -o "$CACHE/bin/crdcheck" .
GOCACHE="${DILOCO_E2E_GOCACHE:-$CACHE/go-build}" GOFLAGS=-mod=mod GOTOOLCHAIN="${GOTOOLCHAIN:-local}" \
  nice -n 19 go build -trimpath -o "$CACHE/bin/vapcheck" ./vapcheck
(cd objcheck && GOCACHE="${DILOCO_E2E_GOCACHE:-$CACHE/go-build}" GOFLAGS=-mod=mod \
  GOTOOLCHAIN="${GOTOOLCHAIN:-local}" nice -n 19 go build -trimpath -o "$CACHE/bin/objcheck" .)
echo "$CACHE/bin/crdcheck $CACHE/bin/objcheck $CACHE/bin/vapcheck"
