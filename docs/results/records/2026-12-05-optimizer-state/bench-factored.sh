#!/bin/bash
# Adafactor again after its attention kernels were factored (moments.merge_heads): the same
# shortened lm_default (config.py beside this file, 400 updates, seed 0) and the same settings
# as bench.sh's adafactor run (no weight decay, warmup 40, cosine to 10%), at T5's relative
# step 1e-2 and, to choose a step on validation, 3e-3, 3e-2, 1e-1 and 3e-1 (the best of the
# first three, 3e-2, was at the edge, and then 1e-1: those two ran after the first three, as
# `bench-factored.sh 1e-1` and `bench-factored.sh 3e-1`). `train.py --summary` gives the
# state's bytes per parameter for this config, configs/lm_default.py and t5_default.py.
# One CPU device, nice -n 5, one run at a time; progress is each run's log
# (tail -f /tmp/h/os2/<name>.log). Each metrics.jsonl and the last log lines go to
# factored/<name>/; bench-factored.out is this script's output, factored/summary.json
# summarize.py's.
# Usage: bench-factored.sh [rate ...] (default: the summaries and all five rates).
set -u
cd /work/main
R=docs/results/records/2026-12-05-optimizer-state
F=$R/factored
W=/tmp/h/os2
mkdir -p $W $F
ADAFACTOR=(--config.optimizer.name=adafactor --config.optimizer.weight_decay=0.0)
summary() {  # config overrides...
  local config=$1; shift
  echo "== train.py --config=$config --summary $*"
  JAX_PLATFORMS=cpu .venv/bin/python train.py --config=$config --summary "$@" 2>&1 \
    | grep -i "optimizer state\|total_params"
}
run() {  # name overrides...
  local name=$1; shift
  local w=$W/$name; rm -rf $w
  local start=$(date +%s)
  echo "== $name: started $(date -u +%H:%M:%S), log $w.log"
  JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python train.py --config=$R/config.py --workdir=$w \
    "${ADAFACTOR[@]}" "$@" > $w.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s: $(grep -o 'step 400 validation.*' $w.log)"
  mkdir -p $F/$name && cp $w/metrics.jsonl $F/$name/ && tail -n 30 $w.log > $F/$name/train.log
}
rates=("$@")
if [ $# -eq 0 ]; then
  rates=(1e-2 3e-2 3e-3 1e-1 3e-1)
  summary $R/config.py "${ADAFACTOR[@]}" --config.optimizer.learning_rate=0.01
  summary configs/lm_default.py "${ADAFACTOR[@]}" --config.optimizer.learning_rate=0.01
  summary configs/t5_default.py "${ADAFACTOR[@]}" --config.optimizer.learning_rate=0.01
fi
for lr in "${rates[@]}"; do
  run adafactor-lr$lr --config.optimizer.learning_rate=$lr
done
.venv/bin/python $R/summarize.py $F > $F/summary.json
