#!/usr/bin/env bash
# Build the project's images for the real node: the trainer (CPU JAX) and the operator, from
# docker/*.Dockerfile, on a base image made here with debootstrap (Docker Hub is not reachable
# from CI, so nothing in this path pulls `python:3.11-slim`; users keep that default).
#
#   base      debootstrap --variant=minbase bookworm + python3, python3-venv, ca-certificates,
#             `docker import`ed as diloco-base:bookworm (about a minute, once per cache)
#   wheels    every Python dependency as a wheel, downloaded by the host's pip into the cache
#             (the builds run with --network=none and PIP_NO_INDEX=1)
#   images    diloco-trainer-cpu:<hash> and diloco-operator:<hash>, where <hash> covers the files
#             that go into them, so a warm call builds nothing
#
# Prints "trainer=IMAGE" and "operator=IMAGE" on stdout. Usage: e2e/node/images.sh [--save DIR]
#   --save DIR  also write DIR/<name>.tar (docker save) when missing, for the node's containerd.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=engine.sh
source "$REPO/e2e/node/engine.sh"
CACHE="$ENGINE_CACHE"
PY="${PYTHON:-$REPO/.venv/bin/python}"
BASE_IMAGE="diloco-base:bookworm"
log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

save_dir=""
if [[ "${1:-}" == "--save" ]]; then save_dir="$2"; mkdir -p "$save_dir"; fi

build_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return 0; fi
  local root="$CACHE/rootfs-bookworm" t0
  t0=$(date +%s)
  rm -rf "$root"
  log "debootstrap bookworm into $root ($(debian_mirror))"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$(debian_mirror)" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; return 1; }
  rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
  tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
  log "base image $BASE_IMAGE made in $(( $(date +%s) - t0 ))s"
}

# content_hash: what goes into the images (sources, packaging, Dockerfiles).
content_hash() {
  (cd "$REPO" && find pyproject.toml README.md docker operator trainer -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum) \
    | sha256sum | cut -c1-12
}

# dependency_hash: what decides the wheelhouse (dependencies, their pinned versions in
# docker/locks/cpu.txt and the build backend), not the tool
# settings that share pyproject.toml with them: a ruff or mypy change must not re-download it.
dependency_hash() {
  "$PY" - "$REPO/pyproject.toml" "$REPO/docker/locks/cpu.txt" <<'PYTHON' | sha256sum | cut -c1-12
import json, sys, tomllib
doc = tomllib.load(open(sys.argv[1], "rb"))
project = doc["project"]
wanted = [project.get("dependencies"), project.get("optional-dependencies"), doc["build-system"]]
print(json.dumps(wanted, sort_keys=True))
print(open(sys.argv[2]).read())
PYTHON
}

# wheels DIR: the project's dependencies (the images' extras) and its build backend, as wheels.
wheels() {
  local dir="$1"
  [[ -f "$dir/.complete" ]] && return 0
  log "wheelhouse: pip wheel the dependencies into $dir"
  rm -rf "$dir"; mkdir -p "$dir"
  # PIP_FIND_LINKS of this machine may point at a local wheel folder: fine, it is only a source.
  "$PY" -m pip wheel -q -w "$dir" -c "$REPO/docker/locks/cpu.txt" "$REPO[trainer,operator,gcs]" hatchling >&2
  rm -f "$dir"/elastic_diloco-*.whl
  touch "$dir/.complete"
}

# build NAME DOCKERFILE TAG WHEELS: docker build with a context that holds the sources and wheels.
build_image() {
  local name="$1" dockerfile="$2" tag="$3" wheel_dir="$4" ctx
  if docker image inspect "$tag" >/dev/null 2>&1; then log "$tag: cached"; return 0; fi
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' RETURN
  cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/operator" "$REPO/trainer" "$REPO/docker" "$ctx/"
  find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
  mkdir -p "$ctx/.wheels"
  ln "$wheel_dir"/*.whl "$ctx/.wheels/" 2>/dev/null || cp "$wheel_dir"/*.whl "$ctx/.wheels/"
  log "$name: docker build $tag"
  local t0; t0=$(date +%s)
  docker build -q --network=none -f "$ctx/$dockerfile" -t "$tag" \
    --build-arg BASE="$BASE_IMAGE" --build-arg PIP_NO_INDEX=1 "$ctx" >&2
  log "$name: built in $(( $(date +%s) - t0 ))s"
}

engine_up
build_base
hash=$(content_hash)
wheel_dir="$CACHE/wheels-$(dependency_hash)"
wheels "$wheel_dir"
# Older wheelhouses are of dependencies no longer asked for: a few hundred MB each.
find "$CACHE" -maxdepth 1 -name 'wheels-*' ! -path "$wheel_dir" -exec rm -rf {} +
trainer="diloco-trainer-cpu:h-$hash"
operator="diloco-operator:h-$hash"
build_image trainer docker/trainer-cpu.Dockerfile "$trainer" "$wheel_dir"
build_image operator docker/operator.Dockerfile "$operator" "$wheel_dir"
if [[ -n "$save_dir" ]]; then
  for img in "$trainer" "$operator"; do
    out="$save_dir/${img//[:\/]/_}.tar"
    [[ -f "$out" ]] || { docker save "$img" -o "$out.tmp" && mv "$out.tmp" "$out"; }
  done
fi
# Keep the cache to the current images: older tags and archives go (the untagged stage images
# stay: they are the build cache of the dependency layers).
for repo in diloco-trainer-cpu diloco-operator; do
  docker images --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -v -x -e "$trainer" -e "$operator" \
    | xargs -r docker rmi >/dev/null 2>&1 || true
done
if [[ -n "$save_dir" ]]; then
  find "$save_dir" -name 'diloco-*_h-*.tar' ! -name "*_h-$hash.tar" -delete
fi
# The release's names for the same images (make images): what the chart and the examples name.
if [[ -n "${RELEASE_TAG_PREFIX:-}" && -n "${RELEASE_VERSION:-}" ]]; then
  docker tag "$trainer" "$RELEASE_TAG_PREFIX/diloco-trainer-cpu:$RELEASE_VERSION"
  docker tag "$operator" "$RELEASE_TAG_PREFIX/diloco-operator:$RELEASE_VERSION"
fi
echo "trainer=$trainer"
echo "operator=$operator"
