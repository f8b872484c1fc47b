#!/usr/bin/env bash
# Two 1,500-update proxies of configs/default.py, each pinned to one core, side by side:
# the recipe as it is (p_ref) and without label smoothing (p_ls0); seed 1: p_ref_s1, p_ls0_s1.
set -uo pipefail
cd /work/main
common="--config=configs/default.py --config.num_train_steps=1500 --config.eval_every_steps=500
        --config.bleu_every_steps=1500 --config.checkpoint_every_steps=1500"
run() {
  name=$1; core=$2; shift 2
  rm -rf /tmp/s8/proxy/$name
  taskset -c $core .venv/bin/python train.py $common --workdir=/tmp/s8/proxy/$name "$@" \
      > /tmp/s8/proxy/$name.log 2>&1
  echo "$name rc=$?" >> /tmp/s8/proxy/done.txt
}
run p_ref_s1 0 --config.seed=1 &
run p_ls0_s1 1 --config.seed=1 --config.label_smoothing=0.0 &
wait
