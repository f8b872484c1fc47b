"""A seconds-long CPU configuration: a tiny encoder-decoder learns to reverse random sequences.

    python train.py --config=configs/tiny.py --workdir=runs/tiny

Hardware: any CPU (2 cores: about a minute, half of it compiling). Data: the synthetic task
generated in-process (`transformer/data/synthetic.py`), so it needs no network, TensorFlow or
apt. Expected (measured, seed 0, one CPU device): validation loss (unsmoothed NLL per token)
2.07 at step 100, 1.29 at 200, 0.83 at 300, from ~3.4 at the start.
It is also the fast workload of the tests and smoke runs.
"""

from ml_collections import config_dict

from configs import common


def get_config():
    cfg = config_dict.ConfigDict()
    cfg.seed = 0
    cfg.init_from = ""  # a run (workdir, workdir:step, or params dir) to start from
    cfg.num_train_steps = 300
    cfg.log_every_steps = 10
    cfg.mesh = common.mesh()
    cfg.checkpoint_every_steps = 100
    cfg.checkpoint_every_minutes = 0  # 0: off
    cfg.keep_checkpoints = 3
    cfg.checkpoint_local_dir = ""  # a local tier on host disk or RAM (e.g. /dev/shm/run); "": off
    cfg.checkpoint_local_every_steps = 0  # when on: more often than checkpoint_every_steps
    cfg.keep_local_checkpoints = 2
    cfg.params_every_minutes = 0.0  # 0: no params-only series for averaging
    cfg.params_keep = 0
    cfg.eval_every_steps = 100
    cfg.bleu_every_steps = 0  # no BLEU on the synthetic task
    cfg.bleu_num_sentences = 0
    cfg.data = config_dict.ConfigDict(dict(
        dataset="synthetic", task="reverse", source_lang="", target_lang="",
        vocab_size=32, min_length=4, max_length=12,
        batch_size=32,  # examples per update, global
        tokens_per_batch=0,  # token budgets are for the translation datasets
        eval_examples=128,  # the validation split: 128 examples, batches of batch_size
        workers=0))  # Grain processes producing this process's batches; 0: the loop itself
    cfg.grad_accum_steps = 1
    cfg.model = config_dict.ConfigDict(dict(
        architecture="encoder_decoder", vocab_size=cfg.data.get_ref("vocab_size"),
        num_encoder_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4,
        num_kv_heads=config_dict.placeholder(int), d_k=config_dict.placeholder(int),
        d_v=config_dict.placeholder(int), dropout_rate=0.1, attention_dropout_rate=0.0,
        relu_dropout_rate=0.0, positional="sinusoidal", norm="layer_norm",
        norm_position="post", activation="relu", use_bias=True, share_embeddings=True,
        tie_output_embedding=True, max_len=64, dtype="float32", scan_layers=False,
        remat_policy="none", attention_implementation="auto", norm_eps=1e-6))
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adam", schedule="rsqrt", learning_rate=3e-3, warmup_steps=50,
        b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0, clip_norm=1.0,
        **common.SPIKES_OFF, **common.WSD_AND_MUON))
    cfg.label_smoothing = 0.1
    cfg.z_loss = 0.0
    cfg.loss_chunk_tokens = -1  # logits a chunk at a time, sized by backend (common.py)
    cfg.skip_nonfinite_updates = False
    cfg.elastic = False  # True: a resume on other devices refits data x fsdp, grad_accum_steps
    cfg.profile_start_step = 0
    cfg.profile_num_steps = 0  # > 0: a jax.profiler trace of that many steps in <workdir>/profile
    cfg.distributed = config_dict.ConfigDict(dict(  # multi-process runs (train.py flags)
        initialization_timeout_seconds=300,  # waiting for all processes to join
        heartbeat_timeout_seconds=100))  # a dead peer stops the others after this long
    cfg.metrics = config_dict.ConfigDict(dict(tracker="tensorboard"))  # or wandb, trackio
    cfg.slow_step_factor = 0.0  # > 1: a step this many times the median dumps the stacks
    cfg.step_timeout_seconds = 0.0  # > 0: a step not ended then stops the run (a hang)
    cfg.decode = config_dict.ConfigDict(dict(beam_size=4, alpha=0.6, max_extra_length=4,
                                             drop_decided=False))
    return cfg
