"""T5's span corruption on a 2-core CPU: an encoder-decoder pretrained on the offline corpus's text.

    python train.py --config=configs/t5_default.py --workdir=runs/t5_default

The data, block and cadence of `configs/lm_default.py` (pre-RMSNorm, RoPE, SwiGLU, grouped-query
attention, no biases, untied output, as T5.1.1 unties it), as an encoder-decoder of 3 + 3
layers at d_model 256: the documents of each update (sentences of the offline corpus, about 17
tokens each) are joined into one stream and cut into pieces of 141 tokens, as T5 does; 15% of
each piece's tokens (21) in spans of mean length 3 (7 spans) become sentinels in the inputs
(128 tokens), and the targets list each sentinel and its span (T5 section 3.1.4;
`transformer/data/span_corruption.py`). The vocabulary (8,000 pieces) reserves 100 sentinels
after [MASK]. Eval perplexity is per target token of the corrupted validation documents.

Learning rate 1e-3, not `lm_default.py`'s 3e-3: at 3e-3 the decoder settles on a language model
of the spans and never learns to read the encoder, even on a few hundred documents it could
memorise. At 1e-3 it reads its input. 12,000 updates (about an hour on a 2-core CPU): fine-tuned
on translation, this pretraining leads the same model from scratch in validation perplexity at
every point of `t5_translate.py`'s 2,000 updates, where 4,000 updates fell behind it. Measured in
docs/results/2026-12-04-span-corruption-transfer.md, sections 6-9.

A run of this config is the starting point for fine-tuning the encoder-decoder on translation
(`init_from`, docs/language-models.md).
"""

from configs.lm_common import lm_config


def get_config():
    cfg = lm_config(objective="span_corruption", dataset="offline_de_en", vocab_size=8000,
                    max_length=128, batch_size=16, num_layers=3, d_model=256, d_ff=704,
                    num_heads=4, num_kv_heads=2, num_train_steps=12000, learning_rate=1e-3,
                    warmup_steps=100, mesh=dict(data=-1, fsdp=1, tensor=1), dtype="float32",
                    scan_layers=False)
    cfg.log_every_steps = 25
    cfg.eval_every_steps = 500
    cfg.checkpoint_every_steps = 500
    cfg.checkpoint_every_minutes = 10
    cfg.z_loss = 0.0
    return cfg
