#!/usr/bin/env bash
# Beam width and length penalty on the whole validation split (1,036 pairs), alone on the
# machine, for the run in $1; each evaluate appends its line to the run's metrics.jsonl.
set -uo pipefail
cd /work/main
run=$1
for setting in "4 0.6" "4 1.0" "4 0.2" "6 0.6" "6 1.0"; do
  set -- $setting
  start=$(date +%s.%N)
  line=$(.venv/bin/python -m transformer.evaluate --workdir=$run --split=validation \
      --beam_size=$1 --alpha=$2 2>/dev/null | tail -1)
  end=$(date +%s.%N)
  echo "beam $1 alpha $2 | $(echo "$end - $start" | bc) s | $line"
done
