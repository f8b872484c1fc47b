"""The language-model recipe as one ConfigDict, shared by the `lm_*` configs (and
`mlm_default.py` through `lm_default.py`).

Not a config itself (it has no `get_config`). The config files import it as a module:

    from configs import lm_common

The block is the paper's with the options its successors settled on (Llama-style): pre-LN with
RMSNorm, RoPE, SwiGLU feed-forward, grouped-query attention, no biases, an untied output
projection; AdamW (0.9, 0.95, 1e-8, weight decay 0.1 off norms and biases), clipping at 1.0,
warmup then cosine decay to 10%, no dropout, no label smoothing. Packed rows of
`data.max_length` tokens, no attention across documents (`transformer/data/language_model.py`).
"""

from ml_collections import config_dict

from configs import common

OBJECTIVE_ARCHITECTURE = {"causal": "decoder", "prefix": "decoder", "masked": "encoder",
                          "span_corruption": "encoder_decoder"}


def lm_config(*, objective: str, dataset: str, vocab_size: int, max_length: int, batch_size: int,
              num_layers: int, d_model: int, d_ff: int, num_heads: int, num_kv_heads: int,
              num_train_steps: int, learning_rate: float, warmup_steps: int,
              mesh: dict, dtype: str = "bfloat16", scan_layers: bool = True,
              remat_policy: str = "none", eval_split: str = "validation",
              max_rows_per_device: int = 0) -> config_dict.ConfigDict:
    """A `data.objective` ("causal", "prefix", "masked" or "span_corruption") language model
    on TFDS `dataset`. Span corruption trains an encoder-decoder of `num_layers` + `num_layers`.
    `mesh` gives the sizes of the mesh axes. The keys it leaves out keep `common.mesh()`'s
    defaults."""
    architecture = OBJECTIVE_ARCHITECTURE[objective]
    cfg = config_dict.ConfigDict()
    cfg.seed = 0
    cfg.init_from = ""  # a run (workdir, workdir:step, or params dir) to start from
    cfg.init_from_exclude = ""  # a regex of parameter paths init_from leaves fresh
    cfg.num_train_steps = num_train_steps
    cfg.log_every_steps = 50
    cfg.mesh = common.mesh(**mesh)
    cfg.checkpoint_every_steps = 1000
    cfg.checkpoint_every_minutes = 30  # for resuming after preemption
    cfg.keep_checkpoints = 3
    cfg.checkpoint_local_dir = ""  # a local tier on host disk or RAM (e.g. /dev/shm/run); "": off
    cfg.checkpoint_local_every_steps = 0  # when on: more often than checkpoint_every_steps
    cfg.keep_local_checkpoints = 2
    cfg.params_every_minutes = 0.0  # no params-only series (checkpoint averaging is for MT)
    cfg.params_keep = 0
    cfg.eval_every_steps = 1000  # perplexity on data.eval_documents of data.eval_split
    cfg.bleu_every_steps = 0  # no BLEU: a language model
    cfg.bleu_num_sentences = 0
    cfg.data = config_dict.ConfigDict(dict(
        dataset=dataset, objective=objective,
        vocab_size=vocab_size, max_length=max_length,  # tokens per packed row
        batch_size=batch_size,  # packed rows per update
        eval_batch_size=config_dict.placeholder(int),  # rows per eval batch; None: per micro
        eval_split=eval_split, eval_documents=2000,
        mask_rate=0.15,  # masked: BERT's 15% (80% [MASK], 10% random, 10% kept)
        num_sentinels=100 if objective == "span_corruption" else 0,  # T5's extra_ids
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str),
        vocab_sample_documents=200_000,  # SentencePiece trains on this many documents
        pack_groups=1,  # packing groups: a process reads only its groups' shards and documents
        workers=0,  # Grain processes producing this process's batches; 0: the loop itself
        **common.language_model_files()))
    cfg.data.max_rows_per_device = max_rows_per_device
    cfg.grad_accum_steps = 0 if max_rows_per_device else 1  # 0: sized from the device count
    cfg.model = config_dict.ConfigDict(dict(
        architecture=architecture, vocab_size=cfg.data.get_ref("vocab_size"),
        num_encoder_layers=num_layers if architecture != "decoder" else 0,
        num_decoder_layers=num_layers if architecture != "encoder" else 0,
        d_model=d_model, d_ff=d_ff, num_heads=num_heads, num_kv_heads=num_kv_heads,
        d_k=config_dict.placeholder(int), d_v=config_dict.placeholder(int),
        dropout_rate=0.0, attention_dropout_rate=0.0, relu_dropout_rate=0.0,
        positional="rope", norm="rms_norm", norm_position="pre", activation="swiglu",
        use_bias=False, share_embeddings=True,
        tie_output_embedding=architecture == "encoder",  # decoder: an untied projection
        max_len=max_length, dtype=dtype, scan_layers=scan_layers, remat_policy=remat_policy,
        attention_implementation="auto", norm_eps=1e-6, rope_theta=10000.0,
        scale_embeddings=True,  # an imported Llama (python -m transformer.convert): False
        **common.EXPERTS_OFF, **common.QUANTIZATION_OFF))
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adamw", schedule="cosine", learning_rate=learning_rate,
        warmup_steps=warmup_steps, end_fraction=0.1,
        b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0,
        moments_dtype="float32",  # Adam's moments; "bfloat16" halves them
        # name="adafactor" (T5's; learning_rate ~1e-2, relative): its decay and factoring
        decay_rate=0.8, min_dim_size_to_factor=128,
        loss_scale_initial=2**15, loss_scale_period=2000,  # model.dtype=float16 only
        **common.SPIKES_OFF, **common.WSD_AND_MUON))
    cfg.label_smoothing = 0.0
    cfg.z_loss = 1e-4  # keeps the softmax normaliser near 1 in bfloat16 (PaLM)
    cfg.loss_chunk_tokens = -1  # logits a chunk at a time, sized by backend (common.py)
    cfg.skip_nonfinite_updates = False
    cfg.elastic = False  # True: a resume on other devices refits data x fsdp, grad_accum_steps
    cfg.profile_start_step = 0
    cfg.profile_num_steps = 0
    cfg.distributed = config_dict.ConfigDict(dict(
        initialization_timeout_seconds=300, heartbeat_timeout_seconds=100))
    cfg.metrics = config_dict.ConfigDict(dict(tracker="tensorboard"))  # or wandb, trackio
    cfg.slow_step_factor = 0.0  # > 1: a step this many times the median dumps the stacks
    cfg.step_timeout_seconds = 0.0  # > 0: a step not ended then stops the run (a hang)
    cfg.decode = config_dict.ConfigDict(dict(beam_size=1, alpha=0.0, max_extra_length=0))
    cfg.generate = config_dict.ConfigDict(dict(  # python -m transformer.generate defaults
        max_new_tokens=64, temperature=0.8, top_k=0, top_p=0.95))
    return cfg
