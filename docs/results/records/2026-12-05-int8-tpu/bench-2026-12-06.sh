#!/bin/bash
# lm_125m (remat full, as docs/sizing.md compiles it) and lm_1b (remat full, 4 rows a device
# and microbatch: as configured, dots_no_batch at 8 rows, it does not fit; refused/) compiled for
# v5e-8 by the TPU compiler (libtpu, no TPU), bfloat16 matmuls against int8 ones
# (model.quantization=int8: Qwix, attention projections and feed-forward). Each report (the
# memory table, the step-time estimate, the int8 line) goes to <config>-<quantization>.txt.
# Usage: bench-2026-12-06.sh CONFIG:QUANTIZATION ... (run one after another). As bench.sh, each
# report to <config>-<quantization>-2026-12-06.txt: the estimator with the int8 saving fixed
# (only where it charged them at the bfloat16 peak). bench.sh's four were run as
# `bench.sh lm_125m:none lm_125m:int8` beside `bench.sh lm_1b:none lm_1b:int8`.
set -u
cd /work/main
R=docs/results/records/2026-12-05-int8-tpu
for point in "$@"; do
  config=${point%:*}
  q=${point#*:}
  extra=()
  [ $config = lm_125m ] && extra=(--config.model.remat_policy=full)
  [ $config = lm_1b ] && extra=(--config.model.remat_policy=full --config.data.max_rows_per_device=4)
  start=$(date +%s)
  .venv/bin/python train.py --config=configs/$config.py --compile_only --topology=v5e-8 \
    "${extra[@]}" --config.model.quantization=$q > $R/$config-$q-2026-12-06.txt 2> $R/$config-$q-2026-12-06.err
  echo "$config $q rc=$? $(( $(date +%s) - start )) s"
done
