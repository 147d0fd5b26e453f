#!/usr/bin/env bash
# A kind cluster of one node, on the node image made here (images.sh), in kind's own engine
# (engine.sh), with the project's images loaded.
#
# Usage: e2e/kind/cluster.sh up NAME     create NAME unless it runs; load the project's images;
#                                          print the kubeconfig's path (server on 127.0.0.1)
#        e2e/kind/cluster.sh down NAME   delete it
#        e2e/kind/cluster.sh node-ip NAME  the node's address on kind's docker network (what
#                                          other clusters' pods and this host reach it at)
# Env: DILOCO_E2E_CACHE (default ~/.cache/diloco-e2e): state under kind-<NAME>/.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=engine.sh
source "$HERE/engine.sh"
# shellcheck source=../cluster/versions.env
source "$REPO/e2e/cluster/versions.env"
log() { printf '[kind %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ "$PY" == /* ]] || PY="$PWD/$PY"   # (a relative PYTHON is the caller's)

action="${1:?usage: cluster.sh up|down|node-ip NAME}"
name="${2:?usage: cluster.sh up|down|node-ip NAME}"
state="$ENGINE_CACHE/kind-$name"
kc="$state/kubeconfig"
KIND="$(bash "$REPO/e2e/cluster/build.sh" kind | tail -1)/kind"
KUBECTL="$(bash "$REPO/e2e/cluster/build.sh" --print-bin-dirs | sed -n 1p)/kubectl"
node="$name-control-plane"
node_ip() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$node"; }

# kindnetd and the storage provisioner are not there to pull: one node needs no routes between
# nodes (images.sh bakes a bridge CNI config into the node), and PVs are not used. kubeadm takes
# etcd and CoreDNS from the node image's diloco.local/ builds. Kubernetes 1.37's kubelet refuses
# cgroup v1 unless told otherwise, and these hosts are cgroup v1.
config() {
  cat <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  disableDefaultCNI: true
nodes:
- role: control-plane
kubeadmConfigPatches:
- |
  kind: ClusterConfiguration
  etcd:
    local:
      imageRepository: diloco.local
      imageTag: $ETCD_VERSION
  dns:
    imageRepository: diloco.local
    imageTag: $COREDNS_VERSION
- |
  kind: KubeletConfiguration
  failCgroupV1: false
  failSwapOn: false
EOF
}

# The real node's storage, as the local one has it (real_node.py make_volumes): a fresh ext4 disk
# (a loop device, mounted in the node) and two directories, as local PVs of a no-provisioner
# default class. kind's own default (host-path) PVs ignore fsGroup, so a non-root syncer could
# not write its checkpoints there.
VOLUMES=/var/local-volumes
local_volumes() {
  docker exec "$node" sh -euc "
    mkdir -p $VOLUMES/ckpt-ext4 $VOLUMES/dir-0 $VOLUMES/dir-1
    if ! mountpoint -q $VOLUMES/ckpt-ext4; then
      truncate -s 1G $VOLUMES/ckpt-ext4.img && mkfs.ext4 -q -F $VOLUMES/ckpt-ext4.img
      mount -o loop $VOLUMES/ckpt-ext4.img $VOLUMES/ckpt-ext4
    fi"
  "$KUBECTL" --kubeconfig "$kc" delete storageclass standard --ignore-not-found >/dev/null
  (cd "$REPO/e2e/cluster" && "$PY" - "$node" "$VOLUMES" <<'PYTHON') | "$KUBECTL" --kubeconfig "$kc" apply -f - >/dev/null
import json, sys
from pathlib import Path
from real_node_config import EXT4_VOLUME, storage_objects
node, root = sys.argv[1], Path(sys.argv[2])
volumes = {EXT4_VOLUME: (root / "ckpt-ext4", "1Gi")}
volumes.update({f"local-dir-{i}": (root / f"dir-{i}", "2Gi") for i in range(2)})
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": storage_objects(node, volumes)}))
PYTHON
}

case "$action" in
  up)
    kind_engine_up
    node_image=$(bash "$HERE/images.sh")
    mkdir -p "$state"
    if ! "$KIND" get clusters 2>/dev/null | grep -qx "$name"; then
      log "creating kind cluster $name ($node_image)"
      config >"$state/kind.yaml"
      t0=$(date +%s)
      "$KIND" create cluster --name "$name" --image "$node_image" --config "$state/kind.yaml" \
        --kubeconfig "$kc" --wait 180s >&2
      log "cluster $name ready in $(( $(date +%s) - t0 ))s"
    else
      "$KIND" get kubeconfig --name "$name" >"$kc"
    fi
    # The project's images, saved by the building engine (e2e/node/images.sh --save).
    saved="$ENGINE_CACHE/images"
    declare -A images=()
    while read -r line; do
      image="${line#*=}"; tar="$saved/${image//[:\/]/_}.tar"; images[${line%%=*}]="$image"
      if ! docker exec "$node" ctr -n k8s.io images ls -q | grep -qx "docker.io/library/$image"; then
        log "kind load $image"
        "$KIND" load image-archive --name "$name" "$tar" >&2
      fi
    done < <(bash "$REPO/e2e/node/images.sh" --save "$saved")
    # The node is the suite's real node, labelled and tainted as the local one
    # (real_node_config.py), and cluster.json says so as the local cluster's does (harness.py).
    "$KUBECTL" --kubeconfig "$kc" label node "$node" diloco.dev/e2e-real-node=true --overwrite >/dev/null
    "$KUBECTL" --kubeconfig "$kc" taint node "$node" diloco.dev/real-node=true:NoSchedule --overwrite >/dev/null
    local_volumes
    gateway=$(docker network inspect kind -f '{{range .IPAM.Config}}{{.Gateway}} {{end}}' | tr ' ' '\n' | grep -m1 '\.')
    printf '{"kind": "%s", "kubeconfig": "%s", "docker_host": "%s", "real_node": "%s", "node_ip": "%s",\n "gateway": "%s", "images": {"trainer": "%s", "operator": "%s"}}\n' \
      "$name" "$kc" "$DOCKER_HOST" "$node" "$(node_ip)" "$gateway" "${images[trainer]}" "${images[operator]}" >"$state/cluster.json"
    echo "$kc"
    ;;
  down)
    # (the loop device is the host's: detach it before its node goes)
    docker exec "$node" sh -c "umount -d $VOLUMES/ckpt-ext4" 2>/dev/null || true
    "$KIND" delete cluster --name "$name" >&2
    rm -rf "$state"
    ;;
  node-ip) node_ip ;;
  *) echo "usage: cluster.sh up|down|node-ip NAME" >&2; exit 2 ;;
esac
