"""configs/lm_default.py shortened for the int8-training runs
(docs/results/2026-12-05-int8-training.md), as the optimizer-state and loss-spike runs shortened
it: d_model 128, d_ff 352, 2 layers, rows of 64 tokens, 16 rows an update, 400 updates (warmup
40, cosine to 10%), AdamW 3e-3, validation on 500 documents every 100 updates. The quantization
comes from the command line (bench.sh)."""

from configs.lm_default import cpu_config


def get_config():
    cfg = cpu_config("causal", num_train_steps=400, learning_rate=3e-3, warmup_steps=40)
    cfg.model.d_model = 128
    cfg.model.d_ff = 352
    cfg.model.num_decoder_layers = 2
    cfg.data.max_length = 64
    cfg.model.max_len = 64
    cfg.data.eval_documents = 500
    cfg.log_every_steps = 10
    cfg.eval_every_steps = 100
    cfg.checkpoint_every_steps = 1000  # one save, at the end
    cfg.checkpoint_every_minutes = 0
    return cfg
