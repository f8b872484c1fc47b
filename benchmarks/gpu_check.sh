#!/usr/bin/env bash
# The GPU check: attention parity, train-step throughput and MFU, decode speed, as JSON.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--out=gpu_check.json] [--steps=10] [--checks=...]
#
# For a machine with one NVIDIA GPU where jax (>= 0.11.2, CUDA), flax, optax and orbax are
# installed, with no network and no TensorFlow: installs this project without dependencies
# (and the ml-collections wheel carried in benchmarks/wheels/ if that is missing), then runs
# benchmarks/gpu_check.py, which stops after 520 s (within a 540 s device call: on an H200
# everything but the loss chunks, docs/benchmarks.md). PYTHON=... picks the interpreter.
# --dry-run uses tiny sizes, so the script also runs end to end on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" -c "import jax, flax, optax, orbax.checkpoint" || {
  echo "error: $PY lacks jax, flax, optax or orbax-checkpoint; install them first" >&2; exit 1; }
if ! "$PY" -c "import ml_collections" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps --no-index benchmarks/wheels/ml_collections-*.whl
fi
if ! "$PY" -c "import transformer" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
    || echo "pip could not install the project; running it from the source tree" >&2
fi
# The GPU check's 520 s budget; GPU_CHECK_TIMEOUT_S changes it (the CPU dry run on a busy
# machine: tests/test_benchmarks.py).
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout "${GPU_CHECK_TIMEOUT_S:-520}" \
  "$PY" benchmarks/gpu_check.py "$@"
