#!/usr/bin/env bash
# A private Docker engine for building the project's images (sourced by images.sh).
#
# Debian's docker.io is installed when missing (CI is a fresh machine, as root). The engine runs
# with its own socket, data root and exec root, so it never touches a user's Docker, and with
# iptables and the default bridge off: image builds here need no network (pip installs from a
# wheelhouse prepared on the host), and an engine that manages iptables would set the FORWARD
# policy to DROP under the real node's pods.
#
# Env: DILOCO_E2E_CACHE (default ~/.cache/diloco-e2e): the engine's data root lives under it.

ENGINE_CACHE="${DILOCO_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco-e2e}"
ENGINE_RUN="/run/diloco-docker"
ENGINE_SOCK="$ENGINE_RUN/docker.sock"
export DOCKER_HOST="unix://$ENGINE_SOCK"

engine_log() { printf '[engine %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# apt_install PKG...: install Debian packages that are missing (needs root).
apt_install() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $(id -u) -eq 0 ]] || { engine_log "ERROR: need root to install ${missing[*]}"; return 1; }
  engine_log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The Debian mirror this machine's apt uses (debootstrap needs one; the default may be unreachable).
debian_mirror() {
  local m
  m=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  [[ -n "$m" ]] || m=$(awk '$1=="deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  echo "${m:-http://deb.debian.org/debian}"
}

# dockerd_up RUN_DIR DATA_ROOT LOG [DOCKERD FLAGS...]: a private dockerd on RUN_DIR/docker.sock
# (exec root and pid file there too), unless one answers there already; waits until it does.
# No iptables and no default bridge: see above.
dockerd_up() {
  local run="$1" data="$2" log="$3"; shift 3
  local host="unix://$run/docker.sock"
  if DOCKER_HOST="$host" docker version >/dev/null 2>&1; then return 0; fi
  mkdir -p "$run" "$data"
  engine_log "starting a private dockerd (data root $data${*:+, $*})"
  nohup dockerd \
    --host="$host" \
    --data-root="$data" \
    --exec-root="$run/exec" \
    --pidfile="$run/dockerd.pid" \
    --iptables=false --ip-masq=false --bridge=none \
    --storage-driver=overlay2 \
    "$@" >"$log" 2>&1 &
  local i
  for i in $(seq 1 120); do
    DOCKER_HOST="$host" docker version >/dev/null 2>&1 && { engine_log "dockerd ready"; return 0; }
    sleep 0.5
  done
  engine_log "ERROR: dockerd did not start; tail of $log:"
  tail -20 "$log" >&2
  return 1
}

# dockerd_down RUN_DIR: stop the dockerd dockerd_up started there.
dockerd_down() {
  local pid
  pid=$(cat "$1/dockerd.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
}

engine_up() {
  apt_install docker.io debootstrap
  dockerd_up "$ENGINE_RUN" "$ENGINE_CACHE/docker" "$ENGINE_CACHE/dockerd.log"
}

engine_down() { dockerd_down "$ENGINE_RUN"; }
