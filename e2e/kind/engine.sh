#!/usr/bin/env bash
# The Docker engine kind runs its nodes in (sourced by images.sh and cluster.sh).
#
# Not the engine that builds the project's images (e2e/node/engine.sh): kind's nodes are
# privileged containers, and on a host whose capability bounding set lacks some capability
# (CAP_SYS_RESOURCE on these machines) runc refuses them. This engine's default runtime is
# capfit_runc.py, which cuts each container's capabilities to the host's bounding set. It has its
# own socket, data root and exec root, and leaves iptables alone like the other one (the real
# node's pods share this host; an engine that manages iptables sets FORWARD to DROP).
#
# Env: DILOCO_E2E_CACHE (default ~/.cache/diloco-e2e): the data root lives under it.

# shellcheck source=../node/engine.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../node" && pwd)/engine.sh"
BUILD_DOCKER_HOST="$DOCKER_HOST"           # the project's image-building engine
KIND_RUN="/run/diloco-kind-docker"
KIND_CAPFIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/capfit_runc.py"
export DOCKER_HOST="unix://$KIND_RUN/docker.sock"

kind_engine_up() {
  apt_install docker.io
  dockerd_up "$KIND_RUN" "$ENGINE_CACHE/kind-docker" "$ENGINE_CACHE/kind-dockerd.log" \
    --add-runtime="capfit=$KIND_CAPFIT" --default-runtime=capfit
}

kind_engine_down() { dockerd_down "$KIND_RUN"; }
