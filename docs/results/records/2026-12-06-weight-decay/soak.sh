#!/usr/bin/env bash
# The 100-fault soak on configs/default.py with the overrides given, shrunk as the
# 2026-12-06 6k page's soak. usage: soak.sh OUT.json [--config KEY=VALUE ...]
set -uo pipefail
cd /work/main
out=$1; shift
.venv/bin/python benchmarks/soak.py --faults=100 --config_file=configs/default.py \
    --config data.data_dir=$HOME/tensorflow_datasets --config data.vocab_size=200 \
    --config data.max_length=32 --config model.max_len=32 --config data.batch_size=8 \
    --config data.eval_batch_size=8 --config data.tokens_per_batch=256 \
    --config model.d_model=32 --config model.d_ff=64 --config model.num_heads=2 \
    --config model.num_encoder_layers=1 --config model.num_decoder_layers=1 \
    --config optimizer.warmup_steps=1 --config bleu_every_steps=0 \
    --config checkpoint_every_minutes=0 --config decode.max_extra_length=4 \
    "$@" --out=$out > $out.log 2>&1
echo "soak rc=$? $(date +%T)" >> $out.log
