"""A Mixtral-8x7B-shaped routed language model (46.7B parameters, 12.9B active per token).

    python train.py --config=configs/mixtral_8x7b.py --compile_only --topology=v5p-128
    python train.py --config=configs/mixtral_8x7b.py --workdir=gs://<bucket>/mixtral   # every host

Hardware: a TPU v5p-128 (64 chips, 95 GiB each): mesh expert 8 x fsdp 8 (each chip holds one
of every layer's 8 experts, sharded over 8 chips with the rest of the state), full remat, 2 rows
of 4,096 tokens per device per microbatch.
Mixtral's shape (docs/moe.md): 32 layers, d_model 4096, 32 heads (8 key/value heads), 8 SwiGLU
experts of d_ff 14336 in every layer, 2 per token with their weights renormalised, a 32k
vocabulary, RoPE base 1e6, RMSNorm epsilon 1e-5. Capacity dispatch with factor 1.25 (the
all-to-all over `expert`, fixed-size buffers) rather than Mixtral's dropless routing, whose
expert-parallel form gathers every token of the expert group. 512 rows (2M tokens) per
update, bfloat16.

Expected: not yet run by this project. See docs/moe.md for its compile on v5p-128.
"""

from configs.lm_common import lm_config


def get_config():
    cfg = lm_config(objective="causal", dataset="c4/en", vocab_size=32_000, max_length=4096,
                    batch_size=512, num_layers=32, d_model=4096, d_ff=14336, num_heads=32,
                    num_kv_heads=8, num_train_steps=80_000, learning_rate=3e-4,
                    warmup_steps=2000, mesh=dict(data=1, fsdp=-1, tensor=1, expert=8),
                    remat_policy="full", max_rows_per_device=2)
    cfg.model.update(dict(num_experts=8, experts_per_token=2, moe_capacity_factor=1.25,
                          moe_router_scores="softmax", moe_renormalize=True, rope_theta=1e6,
                          norm_eps=1e-5))
    return cfg
