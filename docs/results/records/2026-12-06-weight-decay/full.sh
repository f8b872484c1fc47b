#!/usr/bin/env bash
# The default recipe with overrides, pinned to one core, beside another: no test split.
# usage: full.sh NAME CORE [overrides...]
set -uo pipefail
cd /work/main
name=$1; core=$2; shift 2
rm -rf /tmp/s10/full/$name
echo "$name start $(date +%T)" >> /tmp/s10/full/done.txt
taskset -c $core .venv/bin/python train.py --config=configs/default.py \
    --workdir=/tmp/s10/full/$name "$@" > /tmp/s10/full/$name.log 2>&1
echo "$name rc=$? $(date +%T)" >> /tmp/s10/full/done.txt
