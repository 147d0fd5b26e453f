#!/usr/bin/env bash
# Stop the local control plane started by up.sh (or by the pytest fixture) and verify that none of
# its processes is left. Exit status 1 if one survived.
# Usage: e2e/cluster/down.sh [--state-dir DIR]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec python3 "$HERE/cli.py" down --no-build "$@"
