"""A routed language model: lm_125m's shape, 8 experts in every layer, 2 per token (docs/moe.md).

    python train.py --config=configs/lm_moe.py --compile_only --topology=v5e-8   # will it fit?
    python train.py --config=configs/lm_moe.py --workdir=gs://<bucket>/lm_moe     # every host

Hardware: a TPU v5e-8, mesh expert 8 (each chip holds one of every layer's 8 experts and an
eighth of the batch), 4 rows per device and microbatch.
Data: TFDS `c4/en`, as lm_125m. 12 layers, d_model 768, 12 heads (4 key/value heads), SwiGLU
experts of d_ff 2048 (521M parameters, 181M active per token: `--summary`), capacity dispatch
with factor 1.25 (fixed-size buffers that the expert axis exchanges), bfloat16 compute.

Expected: not yet run by this project. `--compile_only --topology=v5e-8` (406 s on a 2-core
CPU): fits, 12.76 GiB peak of 14.90 GiB per chip. Estimated 2.39 s an update, 17% MFU
(docs/moe.md, "TPU compiles"). With 16 rows per device and no remat it does not fit.
"""

from configs.lm_common import lm_config


def get_config():
    cfg = lm_config(objective="causal", dataset="c4/en", vocab_size=32_000, max_length=2048,
                    batch_size=256, num_layers=12, d_model=768, d_ff=2048, num_heads=12,
                    num_kv_heads=4, num_train_steps=10_000, learning_rate=6e-4,
                    warmup_steps=700, mesh=dict(data=1, fsdp=1, tensor=1, expert=-1),
                    max_rows_per_device=4)
    cfg.model.update(dict(num_experts=8, experts_per_token=2, moe_capacity_factor=1.25))
    return cfg
