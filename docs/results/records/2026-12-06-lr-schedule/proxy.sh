#!/usr/bin/env bash
# 1,500-update proxies of configs/default.py, each pinned to one core, side by side.
# usage: proxy.sh NAME CORE [overrides...]
set -uo pipefail
cd /work/main
name=$1; core=$2; shift 2
rm -rf /tmp/s9/proxy/$name
taskset -c $core .venv/bin/python train.py --config=configs/default.py \
    --config.num_train_steps=1500 --config.eval_every_steps=500 \
    --config.bleu_every_steps=1500 --config.checkpoint_every_steps=1500 \
    --workdir=/tmp/s9/proxy/$name "$@" > /tmp/s9/proxy/$name.log 2>&1
echo "$name rc=$? $(date +%T)" >> /tmp/s9/proxy/done.txt
