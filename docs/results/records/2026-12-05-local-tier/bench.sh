#!/bin/bash
# A/B: tiny.py, 200 steps, one CPU device; a local save every 10 steps to /dev/shm vs none.
cd /work/main
for rep in 1 2; do
  for mode in off on; do
    w=/tmp/h/lt/run-$mode-$rep; rm -rf $w /dev/shm/lt-$mode-$rep
    extra=""
    [ $mode = on ] && extra="--config.checkpoint_local_dir=/dev/shm/lt-$mode-$rep --config.checkpoint_local_every_steps=10"
    JAX_PLATFORMS=cpu .venv/bin/python train.py --config=configs/tiny.py --workdir=$w \
      --config.num_train_steps=200 --config.checkpoint_every_steps=1000 \
      --config.eval_every_steps=0 --config.log_every_steps=10 $extra > $w.log 2>&1
    echo "$mode $rep rc=$? $(grep -o 'goodput .*' $w.log | head -1)"
  done
done
