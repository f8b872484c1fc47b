#!/bin/bash
# AdamW at higher peak rates than the config's 3e-3, for a fair comparison with Adafactor,
# whose step was chosen on validation (bench-factored.sh): the same shortened lm_default
# (config.py beside this file, 400 updates, seed 0, b2 0.95, weight decay 0.1, float32
# moments). One CPU device, nice -n 5, one run at a time; progress is each run's log
# (tail -f /tmp/h/os2/<name>.log). Each metrics.jsonl and the last log lines go to
# factored/<name>/ beside the Adafactor runs, and factored/summary.json is rewritten.
# Usage: bench-adamw-rates.sh [rate ...] (default: 1e-2 3e-2).
set -u
cd /work/main
R=docs/results/records/2026-12-05-optimizer-state
F=$R/factored
W=/tmp/h/os2
mkdir -p $W $F
rates=("$@"); [ $# -eq 0 ] && rates=(1e-2 3e-2)
for lr in "${rates[@]}"; do
  name=adamw-lr$lr; w=$W/$name; rm -rf $w
  start=$(date +%s)
  echo "== $name: started $(date -u +%H:%M:%S), log $w.log"
  JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python train.py --config=$R/config.py --workdir=$w \
    --config.optimizer.learning_rate=$lr > $w.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s: $(grep -o 'step 400 validation.*' $w.log)"
  mkdir -p $F/$name && cp $w/metrics.jsonl $F/$name/ && tail -n 30 $w.log > $F/$name/train.log
done
.venv/bin/python $R/summarize.py $F > $F/summary.json
