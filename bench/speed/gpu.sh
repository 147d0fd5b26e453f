#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md, for a machine with an NVIDIA GPU.
# Needs CUDA JAX in the venv:  .venv/bin/uv pip install --python .venv/bin/python 'jax[cuda12]'
# Usage: bench/speed/gpu.sh [--quick]       (about 5 minutes; rewrites docs/bench/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv || { echo "no nvidia-smi: no GPU here" >&2; exit 2; }
if ! JAX_PLATFORMS=cuda "$PY" -c 'import jax; assert jax.devices()[0].platform == "gpu"' 2>/dev/null; then
  echo "JAX cannot see the GPU; install CUDA JAX first (see the header of this script)" >&2
  exit 2
fi
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
exec "$PY" -m bench.run --only gpu "$@"
