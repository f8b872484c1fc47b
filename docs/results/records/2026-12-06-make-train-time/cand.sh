#!/bin/bash
# Waits for pair.sh, then make train of the 5,500-update default from a clean clone, alone.
set -u
while ! grep -q "^new end" /tmp/s11/pair.log; do sleep 5; done
name=new5500
rm -rf /tmp/t/$name /tmp/t/$name.tfds
git clone -q /work/main /tmp/t/$name
cd /tmp/t/$name
git checkout -q 8e9db8c
git log --oneline -1
grep -n "num_train_steps =\|bleu_every_steps =" configs/default.py
start=$(date +%s); echo "$name start $(date -u +%FT%T) $start"
env -i HOME=$HOME PATH=/root/.pyenv/shims:/usr/local/bin:/usr/bin:/bin PYENV_VERSION=3.12.1 \
  TFDS_DATA_DIR=/tmp/t/$name.tfds make train > /tmp/s11/$name.log 2>&1
rc=$?
end=$(date +%s); echo "$name end $(date -u +%FT%T) $end rc=$rc seconds=$((end - start))"
