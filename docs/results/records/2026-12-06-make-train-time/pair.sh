#!/bin/bash
# make train from clean clones, one after the other, alone: the old default, then today's.
set -u
run() {
  name=$1; config=$2
  rm -rf /tmp/t/$name /tmp/t/$name.tfds; mkdir -p /tmp/t
  git clone -q /work/main /tmp/t/$name
  cd /tmp/t/$name
  sed -i "s#--config=configs/default.py #--config=$config #" Makefile
  grep -n "^	.*train.py" Makefile
  echo "$name start $(date -u +%FT%T) $(date +%s)"
  env -i HOME=$HOME PATH=/root/.pyenv/shims:/usr/local/bin:/usr/bin:/bin PYENV_VERSION=3.12.1 \
    TFDS_DATA_DIR=/tmp/t/$name.tfds make train > /tmp/s11/$name.log 2>&1
  echo "$name end $(date -u +%FT%T) $(date +%s) rc=$?"
}
run old configs/default_2026_12_02.py
run new configs/default.py
