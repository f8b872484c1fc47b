"""A causal language model on a 2-core CPU: the text of the offline German-English corpus.

    python train.py --config=configs/lm_default.py --workdir=runs/lm_default
    python -m transformer.generate --workdir=runs/lm_default --prompt="Click the"

Data: the TFDS dataset `offline_de_en` (built on first use as for `configs/default.py`) read
as monolingual text: each side of each pair is a document (99,342 training documents, English
and German). SentencePiece (BPE, 8,000 pieces) trains on them in seconds. Prefix LM:
`--config.data.objective=prefix`. A masked LM is `configs/mlm_default.py`.

Model: the Llama-style block of `lm_common.py` (pre-RMSNorm, RoPE, SwiGLU, 4 query heads
sharing 2 key/value heads, no biases, untied output) at d_model 256, 4 layers, float32.
Rows of 128 tokens, 16 rows per update; AdamW 3e-3 with 100 warmup steps, cosine to 10% at
update 1,500.

Hardware and time (seed 0): a 2-core CPU VM, 20-25 minutes for the 1,500 updates when the
machine is free, 1.7 GB peak host memory. Expected: validation perplexity 46 at update 1,500
(docs/results/2026-11-29-lm-default.md).
"""

from ml_collections import config_dict

from configs.lm_common import lm_config


def cpu_config(objective: str, *, num_train_steps: int, learning_rate: float,
               warmup_steps: int):
    """This file's data, model and cadence for any `data.objective` (`mlm_default.py` uses it
    for the masked LM)."""
    cfg = lm_config(objective=objective, dataset="offline_de_en", vocab_size=8000, max_length=128,
                    batch_size=16, num_layers=4, d_model=256, d_ff=704, num_heads=4,
                    num_kv_heads=2, num_train_steps=num_train_steps, learning_rate=learning_rate,
                    warmup_steps=warmup_steps, mesh=dict(data=-1, fsdp=1, tensor=1),
                    dtype="float32", scan_layers=False)
    cfg.log_every_steps = 25
    cfg.eval_every_steps = 500
    cfg.checkpoint_every_steps = 500
    cfg.checkpoint_every_minutes = 10
    cfg.z_loss = 0.0
    # Efficient self-attention (docs/results/2026-12-01-lm-attention-patterns.md): e.g.
    # --config.model.attention_window=32 --config.model.attention_pattern=local,global, or
    # --config.model.attention_kind=linear.
    cfg.model.attention_kind = "softmax"
    cfg.model.linear_feature_map = "elu"
    cfg.model.attention_window = config_dict.placeholder(int)
    cfg.model.attention_pattern = "global"
    cfg.model.attention_global_tokens = 0  # e.g. 4: the first positions attend to/from all
    return cfg


def get_config():
    cfg = cpu_config("causal", num_train_steps=1500, learning_rate=3e-3, warmup_steps=100)
    cfg.generate.max_new_tokens = 40
    return cfg
