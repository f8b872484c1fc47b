#!/bin/bash
# lm_default shortened (config.py beside this file, 400 updates) in float32 and with int8
# training matmuls (model.quantization=int8: the attention projections and the feed-forward,
# through Qwix; int8_full: their gradients' matmuls in int8 too), equal steps, each seed's
# data order the same. One CPU device, nice -n 5, one run at a time; progress is each run's log
# (tail -f /tmp/h/int8/<name>.log). Each config.json, metrics.jsonl and the last lines of its
# log are copied here; bench.out is this script's output, summary.json summarize.py's.
# Usage: bench.sh [name ...] (default: int8 f32 int8-seed1 f32-seed1 int8-seed2 f32-seed2
# int8_full int8_full-seed1 int8_full-seed2). A name's -seedN sets config.seed, which draws
# the initial parameters and the data order (0 without).
set -u
cd /work/main
R=docs/results/records/2026-12-05-int8-training
W=/tmp/h/int8
mkdir -p $W
run() {  # name overrides...
  local name=$1; shift
  local w=$W/$name; rm -rf $w
  local start=$(date +%s)
  echo "== $name: started $(date -u +%H:%M:%S), log $w.log"
  JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python train.py --config=$R/config.py --workdir=$w \
    "$@" > $w.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s: $(grep -o 'step 400 validation.*' $w.log)"
  mkdir -p $R/$name && cp $w/config.json $w/metrics.jsonl $R/$name/ &&
    tail -n 30 $w.log > $R/$name/train.log
}
names=("$@")
[ $# -eq 0 ] && names=(int8 f32 int8-seed1 f32-seed1 int8-seed2 f32-seed2 int8_full
  int8_full-seed1 int8_full-seed2)
for name in "${names[@]}"; do
  seed=0; [[ $name == *-seed* ]] && seed=${name##*-seed}
  case $name in
    int8_full*) run $name --config.model.quantization=int8_full --config.seed=$seed ;;
    int8*) run $name --config.model.quantization=int8 --config.seed=$seed ;;
    f32*) run $name --config.model.quantization=none --config.seed=$seed ;;
  esac
done
.venv/bin/python docs/results/records/2026-12-05-optimizer-state/summarize.py $R > $R/summary.json
