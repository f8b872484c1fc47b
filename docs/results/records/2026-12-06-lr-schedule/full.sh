#!/usr/bin/env bash
# The whole default recipe (6,000 updates) pinned to one core, beside another: no test split.
# usage: full.sh NAME CORE [overrides...]
set -uo pipefail
cd /work/main
name=$1; core=$2; shift 2
rm -rf /tmp/s9/full/$name
echo "$name start $(date +%T)" >> /tmp/s9/full/done.txt
taskset -c $core .venv/bin/python train.py --config=configs/default.py \
    --workdir=/tmp/s9/full/$name "$@" > /tmp/s9/full/$name.log 2>&1
echo "$name rc=$? $(date +%T)" >> /tmp/s9/full/done.txt
