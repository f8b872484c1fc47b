"""A 7.2B-parameter causal language model: Llama-3-8B's shape with a 32k vocabulary (not 128k).

    python train.py --config=configs/lm_8b.py --workdir=gs://<bucket>/lm_8b   # on every host
    python train.py --config=configs/lm_8b.py --compile_only --mesh_devices=64

Hardware: a TPU v5p-128 (64 chips, 95 GiB each) or 8 hosts of 8 x H100: mesh fsdp=-1 (all
devices; params, gradients and Adam state sharded, 1.8 GiB per device on 64), full remat, 4 rows
of 4,096 tokens per device per microbatch. On 8 devices it compiles (the `--compile_only`
test), but its 16 bytes per parameter (float32 params, gradients, Adam moments) alone take
14.5 GB per device there.
32 layers, d_model 4096, 32 heads (8 key/value heads), SwiGLU d_ff 14336, rows of 4,096 tokens,
512 rows (2M tokens) per update, 80,000 updates (168B tokens), bfloat16.

Expected: not yet run by this project.
"""

from configs.lm_common import lm_config


def get_config():
    return lm_config(objective="causal", dataset="c4/en", vocab_size=32_000, max_length=4096,
                     batch_size=512, num_layers=32, d_model=4096, d_ff=14336, num_heads=32,
                     num_kv_heads=8, num_train_steps=80_000, learning_rate=3e-4,
                     warmup_steps=2000, mesh=dict(data=1, fsdp=-1, tensor=1),
                     remat_policy="full", max_rows_per_device=4)
