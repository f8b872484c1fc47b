"""A 125M-parameter causal language model (GPT-3 Small's shape, Llama-style block) on C4.

    python train.py --config=configs/lm_125m.py --workdir=gs://<bucket>/lm_125m   # every host
    python train.py --config=configs/lm_125m.py --compile_only --mesh_devices=8  # will it fit?

Hardware: one host of 8 x H100 (80 GiB) or a TPU v5e-8: mesh data=8 (pure data parallelism;
the model and Adam state, 1.5 GiB, fit on every device). On a v5e (16 GiB a chip) add
`--config.data.max_rows_per_device=4`: 32 rows a device ask the TPU compiler for 44.84G of
temporaries; 4 (8 micro-batches, the same update) take 8.46 GiB
(docs/results/2026-12-05-input-need.md). Data: TFDS `c4/en` (prepare it with
TFDS on a machine with internet; 365M documents), SentencePiece 32k trained on 200k of them.
12 layers, d_model 768, 12 heads (4 key/value heads), SwiGLU d_ff 2048, rows of 2,048 tokens,
256 rows (524k tokens) per update, bfloat16 compute, AdamW 6e-4. The 10,000 updates see 5.2B
tokens. That is about 42 tokens for each of the 124.7M parameters (`--summary`), twice the 20
per parameter that Chinchilla found compute-optimal.

Expected: C4 validation perplexity in the low 20s (GPT-style 125M models at ~5B tokens).
Not yet run by this project. Throughput on this project's CPU: `benchmarks/workloads/lm_125m.py`.
"""

from configs.lm_common import lm_config


def get_config():
    return lm_config(objective="causal", dataset="c4/en", vocab_size=32_000, max_length=2048,
                     batch_size=256, num_layers=12, d_model=768, d_ff=2048, num_heads=12,
                     num_kv_heads=4, num_train_steps=10_000, learning_rate=6e-4,
                     warmup_steps=700, mesh=dict(data=-1, fsdp=1, tensor=1),
                     max_rows_per_device=32)
