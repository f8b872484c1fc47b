#!/bin/bash
# Optimizer state at equal steps on lm_default shortened (config.py beside this file, 400
# updates): AdamW with float32 moments (the config's), AdamW with bfloat16 moments, and
# Adafactor (T5's: relative step 1e-2, no weight decay). One CPU device. `train.py --summary`
# of each gives the optimizer state's bytes per parameter (summary-lm_default.txt: the same for
# configs/lm_default.py itself). Runs go to /tmp/h/os; each metrics.jsonl and the last lines of
# its log are copied here, bench.out is this script's output, summary.json summarize.py's.
set -u
cd /work/main
R=docs/results/records/2026-12-05-optimizer-state
W=/tmp/h/os
mkdir -p $W
run() {  # name overrides...
  local name=$1; shift
  local w=$W/$name; rm -rf $w
  local start=$(date +%s)
  JAX_PLATFORMS=cpu .venv/bin/python train.py --config=$R/config.py --workdir=$w "$@" \
    > $w.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s: $(grep -o 'step 400 validation.*' $w.log)"
  mkdir -p $R/$name && cp $w/metrics.jsonl $R/$name/ && tail -n 30 $w.log > $R/$name/train.log
}
summary() {  # name overrides...
  local name=$1; shift
  echo "== $name: train.py --summary"
  JAX_PLATFORMS=cpu .venv/bin/python train.py --config=$R/config.py --summary "$@" 2>&1 \
    | grep -i "optimizer\|total_params"
}
ADAFACTOR=(--config.optimizer.name=adafactor --config.optimizer.learning_rate=0.01
           --config.optimizer.weight_decay=0.0)
summary adamw-f32
summary adamw-bf16 --config.optimizer.moments_dtype=bfloat16
summary adafactor "${ADAFACTOR[@]}"
run adamw-f32
run adamw-bf16 --config.optimizer.moments_dtype=bfloat16
run adafactor "${ADAFACTOR[@]}"
.venv/bin/python $R/summarize.py $R > $R/summary.json
