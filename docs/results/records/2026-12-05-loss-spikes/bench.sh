#!/bin/bash
# Loss spikes injected at updates 100, 150, 200, 250 and 300 (each loss, and so gradient, x1e3:
# TRANSFORMER_FAULT_INJECT=spike@...), skipping off vs on, without clipping and with the
# shipped clip_norm=1.0; and each clipping without spikes. config.py beside this file (lm_default
# shortened: 400 updates). One CPU device. Writes runs to /tmp/h/ls, copies each metrics.jsonl
# and the plots here, then summarize.py writes summary.json.
set -u
cd /work/main
R=docs/results/records/2026-12-05-loss-spikes
W=/tmp/h/ls
SPIKES=spike@100,150,200,250,300
run() {  # name clip skip spikes
  local w=$W/$1; rm -rf $w
  local env=(JAX_PLATFORMS=cpu)
  [ -n "$4" ] && env+=(TRANSFORMER_FAULT_INJECT=$4)
  env "${env[@]}" .venv/bin/python train.py --config=$R/config.py --workdir=$w \
    --config.optimizer.clip_norm=$2 --config.optimizer.skip_spikes=$3 > $w.log 2>&1
  echo "$1 rc=$? $(grep -o 'step 400 validation.*' $w.log) | $(grep -o 'goodput [0-9.]*% of the run.s [0-9.]* s' $w.log)"
  mkdir -p $R/$1 && cp $w/metrics.jsonl $R/$1/
}
for clip in 0 1; do
  run clip$clip-skip-off $clip.0 False $SPIKES
  run clip$clip-skip-on $clip.0 True $SPIKES
done
for clip in 0 1; do
  run clip$clip-no-spikes $clip.0 False ""
done
for clip in 0 1; do
  JAX_PLATFORMS=cpu .venv/bin/python -m transformer.visualize curves --workdir \
    $W/clip$clip-skip-off $W/clip$clip-skip-on $W/clip$clip-no-spikes \
    --out=$R/curves_clip$clip.png | tail -n +1
done
.venv/bin/python $R/summarize.py $R > $R/summary.json
