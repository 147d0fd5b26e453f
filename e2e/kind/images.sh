#!/usr/bin/env bash
# kind's base and node images, made here: no registry is reachable from CI, so neither kind's
# published node image nor `kind build node-image` (which pulls etcd, CoreDNS, pause, kindnetd
# and the storage provisioner) can be used. What goes in is what the project already builds from
# the Go module proxy, and Debian's packages:
#
#   base   debootstrap bookworm + systemd, Debian's containerd and runc, CNI plugins, iptables,
#          conntrack; kind's own base-image files (entrypoint, systemd units, from the kind module
#          source, build.sh kind) laid over it; a containerd config of ours (below).
#   node   the base + kubeadm, kubelet, kubectl of K8S_VERSION; /kind/version; and, imported
#          (not unpacked) into its containerd, the control plane's images made from our binaries:
#          kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy (K8S_VERSION),
#          etcd, CoreDNS and pause, named diloco.local/... (cluster.yaml points kubeadm at them).
#
# Both are tagged by a hash of what goes into them, so a warm call builds nothing. Prints the node
# image's name on stdout. Needs root (debootstrap, the engine). Usage: e2e/kind/images.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=engine.sh
source "$HERE/engine.sh"
# shellcheck source=../cluster/versions.env
source "$REPO/e2e/cluster/versions.env"
CACHE="$ENGINE_CACHE"
log() { printf '[kind-images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Debian packages of the node (kind's base image installs the same set, plus what Debian's
# containerd and runc stand in for its source builds).
PACKAGES=systemd,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod
PACKAGES+=,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,containerd,runc
PACKAGES+=,containernetworking-plugins,ebtables,socat
REPOSITORY=diloco.local    # where kubeadm finds etcd and CoreDNS (cluster.yaml), and pause

bin_dir() { bash "$REPO/e2e/cluster/build.sh" "$1" | tail -1; }

# The containerd config of the node. Version 2, which Debian's containerd 1.6 reads (kind's own
# is for containerd 2). restrict_oom_score_adj: the node's root lacks CAP_SYS_RESOURCE (the
# capabilities were cut to the host's bounding set), so runc must not lower oom_score_adj.
containerd_config() {
  cat <<EOF
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$REPOSITORY/pause:1"
  tolerate_missing_hugepages_controller = true
  restrict_oom_score_adj = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/opt/cni/bin"
  conf_dir = "/etc/cni/net.d"
EOF
}

# One node per cluster here, so the pod network is a plain bridge on the node, masqueraded on
# the way out (cluster.yaml turns kind's kindnetd off: its image cannot be pulled either).
cni_config() {
  cat <<'EOF'
{
  "cniVersion": "1.0.0",
  "name": "diloco-kind",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/16"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

base_hash() {
  { echo "$PACKAGES"; containerd_config; cni_config; sed -n '/^build_base()/,/^}/p' "$0"
    (cd "$KIND_FILES" && find . -type f ! -name .complete -print0 | sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-12
}

build_base() {
  local tag="$1"
  docker image inspect "$tag" >/dev/null 2>&1 && { log "$tag: cached"; return 0; }
  local root="$CACHE/kind-rootfs" t0; t0=$(date +%s)
  rm -rf "$root"
  log "debootstrap bookworm + the node's packages into $root"
  DOCKER_HOST="$BUILD_DOCKER_HOST" debootstrap --variant=minbase --include="$PACKAGES" \
    bookworm "$root" "$(debian_mirror)" >"$CACHE/kind-debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/kind-debootstrap.log" >&2; return 1; }
  rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
  cp -a "$KIND_FILES/." "$root/"; rm -f "$root/.complete"
  rm -f "$root/etc/systemd/system/containerd-fuse-overlayfs.service"
  chmod 755 "$root/usr/local/bin/"* "$root/kind/bin/"*
  # kind's units start the source-built binaries from /usr/local/bin; Debian's live in /usr/bin.
  ln -sf /usr/bin/containerd "$root/usr/local/bin/containerd"
  mkdir -p "$root/opt/cni/bin" "$root/etc/cni/net.d" "$root/etc/kubernetes/manifests"
  ln -sf /usr/lib/cni/* "$root/opt/cni/bin/"
  containerd_config >"$root/etc/containerd/config.toml"
  cni_config >"$root/etc/cni/net.d/10-diloco-kind.conflist"
  # systemd refuses to start a unit whose OOMScoreAdjust it cannot set (no CAP_SYS_RESOURCE).
  mkdir -p "$root/etc/systemd/system/containerd.service.d"
  printf '[Service]\nOOMScoreAdjust=0\n' >"$root/etc/systemd/system/containerd.service.d/20-no-oom-adjust.conf"
  # As kind's base image: only what a node needs starts at boot.
  find "$root/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
  rm -f "$root"/lib/systemd/system/multi-user.target.wants/* "$root"/etc/systemd/system/*.wants/*
  rm -f "$root"/lib/systemd/system/local-fs.target.wants/* "$root"/lib/systemd/system/basic.target.wants/*
  rm -f "$root"/lib/systemd/system/sockets.target.wants/*udev* "$root"/lib/systemd/system/sockets.target.wants/*initctl*
  echo "ReadKMsg=no" >>"$root/etc/systemd/journald.conf"
  ln -sf /usr/lib/systemd/systemd "$root/sbin/init"
  chroot "$root" systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
  chroot "$root" systemctl mask systemd-binfmt.service >/dev/null 2>&1
  tar -C "$root" -c . | docker import - "$tag-rootfs" >/dev/null
  rm -rf "$root"
  # (docker import takes no STOPSIGNAL: systemd as PID 1 stops cleanly on SIGRTMIN+3)
  printf '%s\n' "FROM $tag-rootfs" 'ENV container=docker' 'STOPSIGNAL SIGRTMIN+3' \
    'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' | docker build -q -t "$tag" - >/dev/null
  docker rmi "$tag-rootfs" >/dev/null
  log "$tag made in $(( $(date +%s) - t0 ))s"
}

# program_image TAG PROGRAM: an image holding one static program in /usr/local/bin (on PATH:
# kubeadm's static pods name the command alone) and as its entrypoint.
program_image() {
  local tag="$1" program="$2" work
  docker image inspect "$tag" >/dev/null 2>&1 && return 0
  work=$(mktemp -d); mkdir -p "$work/usr/local/bin"
  cp "$program" "$work/usr/local/bin/"
  tar -C "$work" -c . | docker import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    --change "ENTRYPOINT [\"/usr/local/bin/$(basename "$program")\"]" - "$tag" >/dev/null
  rm -rf "$work"
}

build_node() {
  local tag="$1" base="$2" k8s kind_bin etcd coredns pause images=() id t0
  docker image inspect "$tag" >/dev/null 2>&1 && { log "$tag: cached"; return 0; }
  t0=$(date +%s)
  k8s=$(bin_dir k8s); kind_bin=$(bin_dir kind); etcd=$(bin_dir etcd)
  coredns=$(bin_dir coredns); pause=$(bin_dir pause)
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    program_image "registry.k8s.io/$c:$K8S_VERSION" "$k8s/$c"; images+=("registry.k8s.io/$c:$K8S_VERSION")
  done
  program_image "$REPOSITORY/etcd:$ETCD_VERSION" "$etcd/etcd"
  program_image "$REPOSITORY/coredns:$COREDNS_VERSION" "$coredns/coredns"
  program_image "$REPOSITORY/pause:1" "$pause/pause"
  images+=("$REPOSITORY/etcd:$ETCD_VERSION" "$REPOSITORY/coredns:$COREDNS_VERSION" "$REPOSITORY/pause:1")
  # kube-proxy runs iptables and conntrack: the node's own root has them.
  if ! docker image inspect "registry.k8s.io/kube-proxy:$K8S_VERSION" >/dev/null 2>&1; then
    id=$(docker create "$base")
    docker cp "$k8s/kube-proxy" "$id:/usr/local/bin/kube-proxy"
    docker commit --change 'ENTRYPOINT ["/usr/local/bin/kube-proxy"]' "$id" \
      "registry.k8s.io/kube-proxy:$K8S_VERSION" >/dev/null
    docker rm "$id" >/dev/null
  fi
  images+=("registry.k8s.io/kube-proxy:$K8S_VERSION")

  log "node image $tag: binaries, /kind/version, ${#images[@]} images into its containerd"
  # The build container goes whatever happens (under set -e a failing step leaves the script
  # without returning from here: an EXIT trap, on a global).
  BUILD_ID=$(docker run -d --entrypoint=sleep --security-opt seccomp=unconfined "$base" infinity)
  trap 'docker rm -f "$BUILD_ID" >/dev/null 2>&1 || true' EXIT
  id="$BUILD_ID"
  for c in "$kind_bin/kubeadm" "$k8s/kubelet" "$k8s/kubectl"; do
    docker cp "$c" "$id:/usr/bin/$(basename "$c")"
  done
  docker exec "$id" sh -c "echo $K8S_VERSION >/kind/version"
  docker exec "$id" sh -c 'nohup containerd >/tmp/containerd.log 2>&1 &'
  for _ in $(seq 1 50); do docker exec "$id" ctr version >/dev/null 2>&1 && break; sleep 0.2; done
  # Content only (as kind's own build does): unpacked into snapshots by each node at its start.
  docker save "${images[@]}" | docker exec -i "$id" ctr -n k8s.io images import --no-unpack \
    --all-platforms --digests - >/dev/null
  # Pinned, so that the kubelet's image garbage collection never removes what cannot be pulled
  # back (containerd 1.6's import has no --label).
  for c in "${images[@]}"; do
    docker exec "$id" ctr -n k8s.io images label "docker.io/$c" io.cri-containerd.pinned=pinned >/dev/null 2>&1 \
      || docker exec "$id" ctr -n k8s.io images label "$c" io.cri-containerd.pinned=pinned >/dev/null
  done
  docker exec "$id" ctr -n k8s.io images list -q >&2
  docker exec "$id" pkill containerd
  sleep 1
  docker commit --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' "$id" "$tag" >/dev/null
  log "$tag made in $(( $(date +%s) - t0 ))s"
}

kind_engine_up
apt_install debootstrap
KIND_FILES="$(bin_dir kind)/../base-files"
base="diloco-kind-base:h-$(base_hash)"
build_base "$base"
node_hash=$( { echo "$base $K8S_VERSION $ETCD_VERSION $COREDNS_VERSION"; sed -n '/^build_node()/,/^}/p' "$0"
  cat "$(bin_dir pause)/.complete"; } | sha256sum | cut -c1-12)
node="diloco-kind-node:$K8S_VERSION-h-$node_hash"
build_node "$node" "$base"
# Keep the cache to the current images: each node image is a gigabyte.
docker images --format '{{.Repository}}:{{.Tag}}' | grep -E '^diloco-kind-(node|base):' \
  | grep -v -x -e "$node" -e "$base" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$node"
