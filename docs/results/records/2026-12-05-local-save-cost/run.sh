#!/bin/bash
# The tiny config, 200 steps (STEPS) on one CPU device, a local save every 10 steps
# into /dev/shm against none; each piece of a save timed (save_cost.py beside this file).
cd "$(dirname "$0")/../../../.."
R=docs/results/records/2026-12-05-local-save-cost
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1
for mode in "$@"; do
  .venv/bin/python $R/save_cost.py --steps=${STEPS:-200} --every=${mode#*-} --out=$R/$mode.json \
    ${CPROFILE:+--cprofile} > $R/$mode.log 2>&1
  echo "$mode rc=$? $(tail -1 $R/$mode.log)"
done
