#!/bin/sh
# The commands behind docs/results/2026-12-05-sft-lora.md, run from the repository root on a
# 2-core CPU, one at a time. The pretraining was stopped with SIGTERM once its update-200
# checkpoint and validation line were written; it saved update 226 as it exited, the
# checkpoint every later command reads.
set -e
python train.py --config=configs/lm_default.py --workdir=runs/sft_task/pretrain \
    --config.num_train_steps=600 --config.eval_every_steps=200 --config.checkpoint_every_steps=200
# the instruction set, the lm-eval tasks, the preference pairs; the chat template into
# runs/sft_task/pretrain/vocab/tokenizer_config.json
python benchmarks/sft_task.py build --pretrained=runs/sft_task/pretrain --out=runs/sft_task/data
# full fine-tuning at 1e-3 and 3e-3, LoRA (rank 8, alpha 16, query,key,value,out) at 3e-3 and
# 1e-2, 120 updates each; validation scores, the choices, test once; results.json and the plot
# (each train.py command is in results.json under runs.<name>.command)
python benchmarks/sft_task.py sweep --pretrained=runs/sft_task/pretrain --data=runs/sft_task/data \
    --runs=runs/sft_task --record=docs/results/records/2026-12-05-sft-lora
# DPO from the pretrained run (its frozen reference); held-out margins in dpo.json
python benchmarks/sft_task.py dpo --pretrained=runs/sft_task/pretrain --data=runs/sft_task/data \
    --runs=runs/sft_task --record=docs/results/records/2026-12-05-sft-lora --lr=1e-4
# after the choices, validation only: LoRA on every kernel at 1e-2 (the sweep's flags with
# --config.finetune.lora_targets=query,key,value,out,ff_in,ff_gate,ff_out, under /usr/bin/time),
# then its validation score and memory figures with sft_task.py's _score and _memory
# (lora_all_lr0.01.json, lora_all_lr0.01.metrics.jsonl)
