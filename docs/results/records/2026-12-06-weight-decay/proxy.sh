#!/usr/bin/env bash
# Proxies of configs/default.py at the wall time of its 1,500-update proxy, each pinned to
# one core, side by side. usage: proxy.sh NAME CORE UPDATES [overrides...]
set -uo pipefail
cd /work/main
name=$1; core=$2; steps=$3; shift 3
rm -rf /tmp/s10/proxy/$name
taskset -c $core .venv/bin/python train.py --config=configs/default.py \
    --config.num_train_steps=$steps --config.eval_every_steps=500 \
    --config.bleu_every_steps=$steps --config.checkpoint_every_steps=$steps \
    --workdir=/tmp/s10/proxy/$name "$@" > /tmp/s10/proxy/$name.log 2>&1
echo "$name rc=$? $(date +%T)" >> /tmp/s10/proxy/done.txt
