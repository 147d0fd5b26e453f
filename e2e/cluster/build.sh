#!/usr/bin/env bash
# Build (once) and cache the real control-plane binaries used by the e2e harness:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
#   kubelet, kube-proxy (the real node)                              (k8s.io/kubernetes)
#   etcd                                                             (go.etcd.io/etcd/server/v3)
#   kwok                                                             (sigs.k8s.io/kwok/cmd/kwok)
#   helm                                                             (helm.sh/helm/v3/cmd/helm)
#   coredns (the real node's cluster DNS)                            (github.com/coredns/coredns)
#   pause (the real node's sandbox image program)                    (e2e/node/pause, this repo)
#   kueue (the job-queueing controller manager) + its CRDs            (sigs.k8s.io/kueue)
#   fake-gcs-server (a GCS-compatible server for the gs:// tests)      (github.com/fsouza/fake-gcs-server)
#   toxiproxy-server (the emulated WAN link of the bench's wan section) (github.com/Shopify/toxiproxy/v2)
#   crane (`crane registry serve`: an in-memory OCI registry the new-user e2e test publishes the
#          chart to, as a release does) (github.com/google/go-containerregistry)
#   the Gateway API CRDs, standard channel (no binary: the gateway-route test installs them)
#                                                                    (sigs.k8s.io/gateway-api)
#   kind, kubeadm and kind's node-image files (only when asked for: make e2e-kind)
#                                                  (sigs.k8s.io/kind, k8s.io/kubernetes)
#
# Everything comes from the Go module proxy; versions are pinned in versions.env. Binaries go to
#   $DILOCO_E2E_CACHE/<component>-<version>/bin      (default cache: ~/.cache/diloco-e2e)
# and a component whose bin/.complete stamp exists is not rebuilt, so a warm call takes seconds.
#
# Usage: e2e/cluster/build.sh [k8s|etcd|kwok|helm|coredns|pause|kueue|fakegcs|toxiproxy|crane|gatewayapi|kind ...]
#        (default: all but kind)
#        e2e/cluster/build.sh --print-bin-dirs             (print the PATH entries, build nothing)
# Env:   DILOCO_E2E_CACHE   cache root (default ${XDG_CACHE_HOME:-~/.cache}/diloco-e2e)
#        DILOCO_E2E_GOCACHE Go build cache used for these builds (default $DILOCO_E2E_CACHE/go-build)
#        DILOCO_E2E_NICE    niceness of the go builds (default 19)
#        GOTOOLCHAIN        default "local" (the installed Go); go1.27.3 is the allowed newer one
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${DILOCO_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco-e2e}"
export GOCACHE="${DILOCO_E2E_GOCACHE:-$CACHE/go-build}"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
export GOFLAGS=-mod=mod
NICE="${DILOCO_E2E_NICE:-19}"

log() { printf '[build.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

k8s_dir()  { echo "$CACHE/k8s-$K8S_VERSION"; }
etcd_dir() { echo "$CACHE/etcd-$ETCD_VERSION"; }
kwok_dir() { echo "$CACHE/kwok-$KWOK_VERSION"; }
helm_dir() { echo "$CACHE/helm-$HELM_VERSION"; }
coredns_dir() { echo "$CACHE/coredns-$COREDNS_VERSION"; }
kueue_dir() { echo "$CACHE/kueue-$KUEUE_VERSION"; }
fakegcs_dir() { echo "$CACHE/fake-gcs-server-$FAKE_GCS_VERSION"; }
toxiproxy_dir() { echo "$CACHE/toxiproxy-$TOXIPROXY_VERSION"; }
crane_dir() { echo "$CACHE/crane-$CRANE_VERSION"; }
gatewayapi_dir() { echo "$CACHE/gateway-api-$GATEWAY_API_VERSION"; }
kind_dir() { echo "$CACHE/kind-$KIND_VERSION-k8s-$K8S_VERSION"; }
pause_dir() { echo "$CACHE/pause-$(sha256sum "$HERE/../node/pause/main.go" | cut -c1-12)"; }

if [[ "${1:-}" == "--print-bin-dirs" ]]; then
  for c in k8s etcd kwok helm coredns pause kueue fakegcs toxiproxy crane gatewayapi; do echo "$("${c}_dir")/bin"; done
  exit 0
fi

command -v go >/dev/null || die "go is not installed (need Go >= 1.26)"

# done COMPONENT_DIR BIN...: true when the stamp and every binary are present.
is_done() {
  local d="$1"; shift
  [[ -f "$d/bin/.complete" ]] || return 1
  local b; for b in "$@"; do [[ -x "$d/bin/$b" ]] || return 1; done
}

# stamp COMPONENT_DIR START_EPOCH: record build time and mark the component complete.
stamp() {
  local d="$1" t0="$2" t1; t1=$(date +%s)
  {
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "seconds=$((t1 - t0))"
    echo "go=$(go env GOVERSION)"
    echo "nproc=$(nproc)"
  } >"$d/bin/.complete"
  log "$(basename "$d"): built in $((t1 - t0))s -> $d/bin"
}

# new_wrapper DIR: a throwaway main module used only to pin and build a dependency's commands.
new_wrapper() {
  local w="$1"
  rm -rf "$w"; mkdir -p "$w"
  (cd "$w" && go mod init "diloco-e2e.local/wrapper" >/dev/null 2>&1 && go mod edit -go=1.26.0)
}

# replace_local_paths WRAPPER MODULE@VERSION SIBLING_VERSION:
# for every `replace X => ./relative/path` in MODULE's own go.mod (which only works inside its
# repository), replace X with X@SIBLING_VERSION in the wrapper. Replaces that point elsewhere
# (e.g. etcd's "=> ./FORBIDDEN_DEPENDENCY" guards) are ignored.
replace_local_paths() {
  local w="$1" modver="$2" sibver="$3" gomod n=0 old
  gomod=$(cd "$w" && go mod download -json "$modver" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f "$gomod" ]] || die "could not download go.mod of $modver"
  while read -r old; do
    [[ -n "$old" ]] || continue
    (cd "$w" && go mod edit -replace="$old=$old@$sibver")
    n=$((n + 1))
  done < <(go mod edit -json "$gomod" | python3 -c '
import json, sys
for r in json.load(sys.stdin).get("Replace") or []:
    new = r["New"]["Path"]
    if new.startswith((".", "/")) and "FORBIDDEN" not in new and not r["New"].get("Version"):
        print(r["Old"]["Path"])
')
  log "$modver: replaced $n locally-replaced modules with @$sibver"
  [[ $n -gt 0 ]] || die "found no local replace directives in $modver's go.mod (format changed?)"
}

# The version the k8s binaries report (component-base and client-go), as a release build's.
k8s_ldflags() {
  local ver="${K8S_VERSION#v}" major minor ld="-s -w" pkg
  major="${ver%%.*}"; minor="${ver#*.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$ld"
}

build_k8s() {
  local d; d=$(k8s_dir)
  if is_done "$d" kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; then
    log "k8s $K8S_VERSION: cached in $d/bin"; return
  fi
  local t0; t0=$(date +%s)
  local staging="v0.${K8S_VERSION#v1.}"   # v1.37.2 -> v0.37.2
  log "k8s $K8S_VERSION (staging modules $staging): preparing wrapper module"
  new_wrapper "$d/src"
  (cd "$d/src" && go mod edit -require="k8s.io/kubernetes@$K8S_VERSION")
  replace_local_paths "$d/src" "k8s.io/kubernetes@$K8S_VERSION" "$staging"
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "k8s $K8S_VERSION: go build (one invocation, 6 commands; cold: tens of minutes on 2 cores)"
  (cd "$d/src" && nice -n "$NICE" go build -trimpath -ldflags "$(k8s_ldflags)" -o "$d/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy)
  [[ "$("$d/bin/kube-apiserver" --version 2>&1)" == *"$K8S_VERSION"* ]] || die "kube-apiserver reports a wrong version"
  stamp "$d" "$t0"
}

build_etcd() {
  local d; d=$(etcd_dir)
  if is_done "$d" etcd; then log "etcd $ETCD_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  log "etcd $ETCD_VERSION: preparing wrapper module"
  new_wrapper "$d/src"
  (cd "$d/src" && go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION")
  replace_local_paths "$d/src" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$ETCD_VERSION"
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "etcd $ETCD_VERSION: go build"
  (cd "$d/src" && nice -n "$NICE" go build -trimpath -ldflags "-s -w" -o "$d/bin/etcd" \
    go.etcd.io/etcd/server/v3)
  [[ "$("$d/bin/etcd" --version 2>&1)" == *"${ETCD_VERSION#v}"* ]] || die "etcd reports a wrong version"
  stamp "$d" "$t0"
}

build_kwok() {
  local d; d=$(kwok_dir)
  if is_done "$d" kwok && [[ -f "$d/stages/.complete" ]]; then
    log "kwok $KWOK_VERSION: cached in $d/bin"; return
  fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "kwok $KWOK_VERSION: go install"
  GOFLAGS= GOBIN="$d/bin" nice -n "$NICE" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok alone has no built-in stages (kwokctl embeds them): keep the Stage manifests of this very
  # version next to the binary; harness.py assembles its kwok config from them.
  local src
  src=$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d "$src/kustomize/stage" ]] || die "kwok module source has no kustomize/stage directory"
  rm -rf "$d/stages"; mkdir -p "$d/stages"
  local f rel
  for rel in node/fast node/heartbeat-with-lease node/chaos pod/fast pod/chaos; do
    mkdir -p "$d/stages/$rel"
    for f in "$src/kustomize/stage/$rel"/*.yaml; do
      [[ "$(basename "$f")" == kustomization.yaml ]] || cp "$f" "$d/stages/$rel/"
    done
  done
  chmod -R u+w "$d/stages"; touch "$d/stages/.complete"
  stamp "$d" "$t0"
}

build_helm() {
  local d; d=$(helm_dir)
  if is_done "$d" helm; then log "helm $HELM_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "helm $HELM_VERSION: go install"
  GOFLAGS= GOBIN="$d/bin" nice -n "$NICE" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  [[ "$("$d/bin/helm" version --short 2>&1)" == *"$HELM_VERSION"* ]] || die "helm reports a wrong version"
  stamp "$d" "$t0"
}

build_coredns() {
  local d; d=$(coredns_dir)
  if is_done "$d" coredns; then log "coredns $COREDNS_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "coredns $COREDNS_VERSION: go install"
  GOFLAGS= GOBIN="$d/bin" nice -n "$NICE" go install -trimpath -ldflags "-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION"
  [[ "$("$d/bin/coredns" -version 2>&1)" == *"${COREDNS_VERSION#v}"* ]] || die "coredns reports a wrong version"
  stamp "$d" "$t0"
}

# The sandbox ("pause") image's program: it cannot be pulled here, so the node runs ours.
build_pause() {
  local d; d=$(pause_dir)
  if is_done "$d" pause; then log "pause: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  (cd "$HERE/../node/pause" && GOFLAGS= go build -trimpath -ldflags "-s -w" -o "$d/bin/pause" .)
  stamp "$d" "$t0"
}

# Kueue's manager binary and, next to it, the parts of that very version's config/ directory the
# harness needs: the CRDs (config/components/crd/bases) and the webhook configurations
# (config/components/webhook/manifests.yaml). The e2e harness runs the manager as a host process.
build_kueue() {
  local d; d=$(kueue_dir)
  if is_done "$d" kueue && [[ -f "$d/config/.complete" ]]; then
    log "kueue $KUEUE_VERSION: cached in $d/bin"; return
  fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "kueue $KUEUE_VERSION: go install"
  GOFLAGS= GOBIN="$d/bin" nice -n "$NICE" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
  local src
  src=$(GOFLAGS= go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d "$src/config/components/crd/bases" ]] || die "kueue module source has no config/components/crd/bases"
  [[ -f "$src/config/components/webhook/manifests.yaml" ]] || die "kueue module source has no webhook manifests"
  rm -rf "$d/config" "$d/crds"; mkdir -p "$d/config/crds"
  cp "$src"/config/components/crd/bases/*.yaml "$d/config/crds/"
  cp "$src/config/components/webhook/manifests.yaml" "$d/config/webhooks.yaml"
  chmod -R u+w "$d/config"; touch "$d/config/.complete"
  stamp "$d" "$t0"
}

# The unit tests of gs:// checkpoints (tests/gcs_server.py) run this one against a loopback port.
build_fakegcs() {
  local d; d=$(fakegcs_dir)
  if is_done "$d" fake-gcs-server; then log "fake-gcs-server $FAKE_GCS_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "fake-gcs-server $FAKE_GCS_VERSION: go install"
  GOBIN="$d/bin" nice -n "$NICE" go install -trimpath -ldflags "-s -w" \
    "github.com/fsouza/fake-gcs-server@$FAKE_GCS_VERSION"
  [[ -x "$d/bin/fake-gcs-server" ]] || die "fake-gcs-server was not built"
  stamp "$d" "$t0"
}

# The bench's wan section (bench/lib/toxiproxy.py) runs it on loopback as an emulated WAN link.
build_toxiproxy() {
  local d; d=$(toxiproxy_dir)
  if is_done "$d" toxiproxy-server; then log "toxiproxy $TOXIPROXY_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  log "toxiproxy $TOXIPROXY_VERSION: preparing wrapper module"
  new_wrapper "$d/src"
  (cd "$d/src" && go mod edit -require="github.com/Shopify/toxiproxy/v2@$TOXIPROXY_VERSION")
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "toxiproxy $TOXIPROXY_VERSION: go build"
  (cd "$d/src" && nice -n "$NICE" go build -trimpath \
    -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=$TOXIPROXY_VERSION" \
    -o "$d/bin/toxiproxy-server" github.com/Shopify/toxiproxy/v2/cmd/server)
  [[ "$("$d/bin/toxiproxy-server" -version 2>&1)" == *"$TOXIPROXY_VERSION"* ]] || die "toxiproxy-server reports a wrong version"
  stamp "$d" "$t0"
}

build_crane() {
  local d; d=$(crane_dir)
  if is_done "$d" crane; then log "crane $CRANE_VERSION: cached in $d/bin"; return; fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "crane $CRANE_VERSION: go install"
  GOBIN="$d/bin" nice -n "$NICE" go install -trimpath -ldflags "-s -w" \
    "github.com/google/go-containerregistry/cmd/crane@$CRANE_VERSION"
  [[ -x "$d/bin/crane" ]] || die "crane was not built"
  stamp "$d" "$t0"
}

# Nothing to build: the module's CRD manifests (standard channel), copied out of the module cache.
build_gatewayapi() {
  local d; d=$(gatewayapi_dir)
  if is_done "$d" && [[ -f "$d/crds/.complete" ]]; then
    log "gateway-api $GATEWAY_API_VERSION: cached in $d/crds"; return
  fi
  local t0; t0=$(date +%s)
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  local src
  src=$(GOFLAGS= go mod download -json "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f "$src/config/crd/standard/gateway.networking.k8s.io_tlsroutes.yaml" ]] || die "gateway-api module source has no standard TLSRoute CRD"
  rm -rf "$d/crds"; mkdir -p "$d/crds"
  cp "$src"/config/crd/standard/gateway.networking.k8s.io_*.yaml "$d/crds/"
  chmod -R u+w "$d/crds"; touch "$d/crds/.complete"
  stamp "$d" "$t0"
}

# kind itself; kubeadm from the k8s wrapper module (kind runs it inside its nodes); and the files
# of kind's own base image (entrypoint, systemd units) from the same kind version's module source,
# which e2e/kind/images.sh lays over a debootstrap root (kind's base image is not pullable here).
build_kind() {
  local d; d=$(kind_dir)
  if is_done "$d" kind kubeadm && [[ -f "$d/base-files/.complete" ]]; then
    log "kind $KIND_VERSION: cached in $d/bin"; return
  fi
  local t0; t0=$(date +%s)
  build_k8s
  mkdir -p "$d/bin"; rm -f "$d/bin/.complete"
  log "kind $KIND_VERSION: go install"
  GOFLAGS= GOBIN="$d/bin" nice -n "$NICE" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
  log "kubeadm $K8S_VERSION: go build"
  (cd "$(k8s_dir)/src" && nice -n "$NICE" go build -trimpath -ldflags "$(k8s_ldflags)" \
    -o "$d/bin/kubeadm" k8s.io/kubernetes/cmd/kubeadm)
  [[ "$("$d/bin/kubeadm" version -o short 2>&1)" == *"$K8S_VERSION"* ]] || die "kubeadm reports a wrong version"
  local src
  src=$(GOFLAGS= go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f "$src/images/base/files/usr/local/bin/entrypoint" ]] || die "kind module source has no images/base/files"
  rm -rf "$d/base-files"; cp -r "$src/images/base/files" "$d/base-files"
  chmod -R u+w "$d/base-files"; touch "$d/base-files/.complete"
  stamp "$d" "$t0"
}

components=("$@")
[[ ${#components[@]} -gt 0 ]] || components=(k8s etcd kwok helm coredns pause kueue fakegcs toxiproxy crane gatewayapi)
mkdir -p "$CACHE"
# (version checks read the whole output first: `cmd | grep -q` under pipefail fails when grep
# exits before cmd has written everything and cmd dies of SIGPIPE)
# one build at a time per cache (make e2e-deps and a test fixture may both call this)
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then log "another build.sh holds $CACHE/.build.lock; waiting"; flock 9; fi
for c in "${components[@]}"; do
  case "$c" in
    k8s|etcd|kwok|helm|coredns|pause|kueue|fakegcs|toxiproxy|crane|gatewayapi|kind) "build_$c" ;;
    *) die "unknown component '$c' (expected k8s, etcd, kwok, helm, coredns, pause, kueue, fakegcs, toxiproxy, crane, gatewayapi, kind)" ;;
  esac
done
for c in "${components[@]}"; do echo "$("${c}_dir")/bin"; done
