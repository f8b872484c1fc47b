"""A T5.1.1-base-sized encoder-decoder pretrained with span corruption on C4, for accelerators.

    python train.py --config=configs/t5_base.py --workdir=gs://<bucket>/t5_base   # every host
    python train.py --config=configs/t5_base.py --compile_only --mesh_devices=8  # will it fit?
    python train.py --config=configs/t5_base.py --summary

T5.1.1 base's shape (12 + 12 layers, d_model 768, 12 heads of 64, gated feed-forward 2048, no
biases, untied output, no dropout in pretraining) with this project's block: RoPE instead of T5's
relative position buckets and SwiGLU instead of GeGLU: 247.4M parameters (`--summary`), T5.1.1
base has 248M. Inputs of 512 tokens (pieces of 568 before corruption), targets of at most 114,
rows padded to 512 on both sides, 128 rows per update as T5 (65k input tokens), 100 sentinels in
a 32k vocabulary; AdamW with warmup and cosine decay (T5 used Adafactor with an inverse square
root schedule). Data: TFDS `c4/en`, prepared with TFDS where there is internet.
Not yet run by this project.
"""

from configs.lm_common import lm_config


def get_config():
    return lm_config(objective="span_corruption", dataset="c4/en", vocab_size=32_000,
                     max_length=512, batch_size=128, num_layers=12, d_model=768, d_ff=2048,
                     num_heads=12, num_kv_heads=12, num_train_steps=524_288, learning_rate=1e-3,
                     warmup_steps=10_000, mesh=dict(data=-1, fsdp=1, tensor=1),
                     max_rows_per_device=32)
