#!/usr/bin/env bash
# The default with int8 training matmuls, from a clean clone, a fresh TFDS data_dir, alone.
set -euo pipefail
rm -rf /tmp/s8/clone /tmp/s8/tfds
git clone -q /work/main /tmp/s8/clone
ln -s /work/main/.venv /tmp/s8/clone/.venv
mkdir -p /tmp/s8/tfds
cd /tmp/s8/clone
git log -1 --format=%H > /tmp/s8/commit.txt
date -u +%FT%TZ > /tmp/s8/start.txt
TFDS_DATA_DIR=/tmp/s8/tfds .venv/bin/python train.py --config=configs/default.py \
    --workdir=runs/int8 --score_split=test --config.model.quantization=int8 \
    > /tmp/s8/console.log 2>&1
date -u +%FT%TZ > /tmp/s8/end.txt
