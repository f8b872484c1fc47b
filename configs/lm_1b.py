"""A 1.1B-parameter causal language model (Llama-3.2-1B's shape with a 32k vocabulary) on C4.

    python train.py --config=configs/lm_1b.py --workdir=gs://<bucket>/lm_1b   # on every host
    python train.py --config=configs/lm_1b.py --compile_only --mesh_devices=8

Hardware: 8 x H100 (80 GiB) on one host, or a TPU v5p-16 (8 chips, 95 GiB): mesh fsdp=8 (params,
gradients and Adam state sharded over all devices, about 2.4 GiB per device), 8 rows of 2,048
tokens per device per microbatch, remat of everything but the matmuls without a batch axis.
16 layers, d_model 2048, 32 heads (8 key/value heads), SwiGLU d_ff 8192, rows of 2,048 tokens,
512 rows (1M tokens) per update, 24,000 updates (25B tokens, ~20 per parameter), bfloat16.

Expected: C4 validation perplexity in the mid teens. Not yet run by this project.
"""

from configs.lm_common import lm_config


def get_config():
    return lm_config(objective="causal", dataset="c4/en", vocab_size=32_000, max_length=2048,
                     batch_size=512, num_layers=16, d_model=2048, d_ff=8192, num_heads=32,
                     num_kv_heads=8, num_train_steps=24_000, learning_rate=3e-4,
                     warmup_steps=2000, mesh=dict(data=1, fsdp=-1, tensor=1),
                     remat_policy="dots_no_batch", max_rows_per_device=8)
