"""configs/lm_default.py shortened for the loss-spike runs (docs/results/2026-12-05-loss-spikes.md):
d_model 128, 2 layers, rows of 64 tokens, 400 updates, with the spike-skipping keys declared
(the shipped configs do not declare them, so `--config.optimizer.skip_spikes=True` needs them
here): off unless the command line turns them on."""

from configs.lm_default import cpu_config


def get_config():
    cfg = cpu_config("causal", num_train_steps=400, learning_rate=3e-3, warmup_steps=40)
    cfg.model.d_model = 128
    cfg.model.d_ff = 352
    cfg.model.num_decoder_layers = 2
    cfg.data.max_length = 64
    cfg.model.max_len = 64
    cfg.data.eval_documents = 500
    cfg.log_every_steps = 10  # per-layer norms on every 10th step: the spikes land on them
    cfg.eval_every_steps = 100
    cfg.checkpoint_every_steps = 1000  # one save, at the end
    cfg.checkpoint_every_minutes = 0
    cfg.optimizer.skip_spikes = False
    cfg.optimizer.spike_window = 50
    cfg.optimizer.spike_threshold = 6.0
    cfg.optimizer.max_skipped_in_a_row = 10
    return cfg
