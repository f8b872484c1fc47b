"""What the configs share: the mesh section, the data keys of files, and the paper's recipe.

Not a config itself (it has no `get_config`). The config files import it as a module:

    from configs import common

Every config builds its `mesh` section with `mesh()`, so each mesh axis can be set from the
command line on any config (`--config.mesh.expert=2`). A config whose data can come from files
takes the keys of files from `language_model_files()`, `translation_files()` or
`classification_files()`, so that `--config.data.text_field=body` works on every language model.

`paper_config` is the paper's WMT14 recipe, shared by the `wmt14_*` configs. Its values follow
"Attention Is All You Need" (arXiv 1706.03762 v7) and `docs/paper-recipe.md`: post-norm,
sinusoidal positions, one embedding shared by source, target and the pre-softmax projection,
Adam(0.9, 0.98, 1e-9) with the paper's d_model^-0.5 · min(step^-0.5, step · 4000^-1.5)
schedule, label smoothing 0.1, ~25k target tokens per update, beam 4 with length penalty 0.6.
"""

from ml_collections import config_dict

SIZES = {  # Table 3: N, d_model, d_ff, h; d_k = d_v = d_model / h = 64
    "base": dict(num_layers=6, d_model=512, d_ff=2048, num_heads=8, num_train_steps=100_000,
                 average_last=5),
    "big": dict(num_layers=6, d_model=1024, d_ff=4096, num_heads=16, num_train_steps=300_000,
                average_last=20),
}
LANGUAGE_PAIRS = {  # target language -> TFDS dataset and shared vocabulary size
    "de": dict(dataset="wmt14_translate/de-en", vocab_size=37_000),  # BPE, ~37k
    "fr": dict(dataset="wmt14_translate/fr-en", vocab_size=32_000),  # word-pieces, 32k
}


# Dense feed-forward layers (num_experts 0). The other keys are read where num_experts > 0
# (docs/moe.md). The paper's configs and the language models (lm_common.py) hold them all, so
# that --config.model.num_experts=8 reaches those configs.
EXPERTS_OFF = dict(num_experts=0, experts_per_token=2, moe_layer_interval=1,
                   moe_router_scores="softmax", moe_renormalize=True, moe_shared_expert=False,
                   moe_capacity_factor=0.0, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
# Float matmuls (model.quantization "none"); the paper's configs and the language models hold
# the keys, so that --config.model.quantization=int8 reaches them (docs/training.md).
QUANTIZATION_OFF = dict(quantization="none", quantized_matmuls="attention,feed_forward,experts")
# Loss-spike skipping off (docs/reliability.md); every config's optimizer holds the keys, so
# that --config.optimizer.skip_spikes=True reaches it. The values are SpikeConfig's defaults.
SPIKES_OFF = dict(skip_spikes=False, spike_window=100, spike_threshold=6.0,
                  max_skipped_in_a_row=10)
# The keys only the wsd schedule and Muon read. Every config's optimizer holds them, so that
# --config.optimizer.decay_fraction=0.1 or --config.optimizer.muon_rms=0.3 reaches it beside
# the schedule or name it goes with. The values are optim.py's defaults.
WSD_AND_MUON = dict(decay_fraction=0.2, muon_beta=0.95, muon_rms=0.2)

# The mesh axes, in the order of transformer/parallel/sharding.py. This module imports no JAX
# (train.py sets up fake devices before JAX starts), so it names the axes itself, and
# tests/test_config.py checks them against sharding.CONFIG_KEYS.
MESH_AXES = ("stage", "data", "fsdp", "context", "tensor", "expert")


def mesh(**sizes: int) -> config_dict.ConfigDict:
    """The `mesh` section of a config: each axis's size within a TPU slice, and across slices,
    and the pipeline stages' schedule.

    Unless `sizes` says otherwise, `data` takes the devices that the other axes leave (-1) and
    every other axis is 1. Across slices (the `dcn_` keys), data parallelism takes all the
    slices. A size of -1 takes whatever the other axes leave.
    """
    section = {axis: 1 for axis in MESH_AXES}
    section["data"] = -1
    for axis in MESH_AXES:
        section[f"dcn_{axis}"] = 1
    section["dcn_data"] = -1
    # pipeline stages' schedule (read where mesh.stage > 1): repeats, microbatches (0: stages)
    section.update(pipeline_repeats=1, pipeline_microbatches=0)
    unknown = sorted(set(sizes) - set(section))
    if unknown:
        raise ValueError(f"mesh(): unknown axes {unknown}; the keys are {sorted(section)}")
    section.update(sizes)
    return config_dict.ConfigDict(section)


def language_model_files() -> dict:
    """The data keys a language model reads when `data.dataset` names files (docs/data.md).

    They are set on every language model, so that any of them can train on files. With a TFDS
    dataset and no `sources`, only `vocab_path` is read.
    """
    return dict(
        eval_dataset="",  # "": the dataset's own validation files (a hub-layout directory)
        text_field="text",  # the field of a document, dotted for nested fields: meta.text
        shuffle_window=8,  # shards read together (and held decoded) per host
        skip_bad_lines=False,  # True: skip and count malformed jsonl lines
        sources=(),  # several datasets mixed by token share: ({"dataset": .., "weight": ..}, ..)
        vocab_path="",  # "": train SentencePiece on a sample of the documents
    )


def translation_files() -> dict:
    """The data keys a translation model reads when `data.dataset` names files."""
    return dict(
        eval_dataset="",  # "": the directory's validation-*.parquet
        source_field="",  # "": the source language code (or translation.<code>)
        target_field="",  # "": the target language code (or translation.<code>)
        skip_bad_lines=False,  # True: skip and count malformed jsonl lines
        vocab_path="",  # "": train SentencePiece on the training pairs
    )


def classification_files() -> dict:
    """The data keys a text classifier reads when `data.dataset` names files."""
    return dict(
        eval_dataset="",  # "": the dataset's own validation files
        text_field="",  # "": data.text_feature's name
        label_field="",  # "": data.label_feature's name
        vocab_path="",  # "": train SentencePiece on the texts
    )


def paper_config(*, size: str, target_lang: str, dropout_rate: float) -> config_dict.ConfigDict:
    """The paper's recipe for model `size` ("base" or "big"), English -> `target_lang`
    ("de" or "fr"), with residual/embedding dropout P_drop = `dropout_rate`."""
    shape = SIZES[size]
    pair = LANGUAGE_PAIRS[target_lang]
    cfg = config_dict.ConfigDict()
    cfg.seed = 0
    cfg.init_from = ""  # a run (workdir, workdir:step, or params dir) to start from
    cfg.init_from_exclude = ""  # a regex of parameter paths init_from leaves fresh
    cfg.num_train_steps = shape["num_train_steps"]
    cfg.mesh = mesh()
    cfg.checkpoint_every_steps = 1000  # full checkpoints (params, Adam moments, data position)
    cfg.checkpoint_every_minutes = 10  # for resuming after preemption
    cfg.keep_checkpoints = 3
    cfg.checkpoint_local_dir = ""  # a local tier on host disk or RAM (e.g. /dev/shm/run); "": off
    cfg.checkpoint_local_every_steps = 100  # when on: more often than checkpoint_every_steps
    cfg.keep_local_checkpoints = 2
    cfg.params_every_minutes = 10.0  # the paper averages checkpoints written every 10 minutes:
    cfg.params_keep = shape["average_last"]  # a params-only series keeps the last 5 (base) or
    # 20 (big) for `python -m transformer.evaluate --average=N` (docs/paper-recipe.md)
    cfg.eval_every_steps = 1000
    cfg.bleu_every_steps = 5000
    cfg.bleu_num_sentences = 500

    # TFDS `wmt14_translate/<x>-en` yields <x> -> en by default: the pipeline must read the
    # English side as the source (paper direction EN -> DE / EN -> FR).
    cfg.data = config_dict.ConfigDict(dict(
        dataset=pair["dataset"], source_lang="en", target_lang=target_lang,
        vocab_size=pair["vocab_size"], max_length=256,  # longer training pairs are skipped
        tokens_per_batch=25_000,  # at most this many non-pad source, and target, tokens per
        # update (t2t: 4096 × 8 GPUs), over all devices and accumulation steps
        batch_size=104,  # packed rows of max_length per update: a multiple of grad_accum_steps
        # × mesh.data × mesh.fsdp (8 × 13); 104 × 256 slots hold the 25k budget at ~93% fill
        eval_batch_size=config_dict.placeholder(int),  # rows per eval batch; None: per micro
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str),  # raw WMT archives (docs/data.md)
        vocab_sample_pairs=500_000,  # SentencePiece trains on this many training pairs
        workers=0,  # Grain processes producing this process's batches; 0: the loop itself
        **translation_files()))
    cfg.data.max_rows_per_device = 32  # one microbatch, one device; lower it if memory binds
    cfg.grad_accum_steps = 0  # 0: sized from the device count, the fewest microbatches that
    # keep each device within data.max_rows_per_device: 1 on 8 devices, 4 on one

    cfg.model = config_dict.ConfigDict(dict(
        architecture="encoder_decoder",
        vocab_size=cfg.data.get_ref("vocab_size"),  # follows --config.data.vocab_size
        num_encoder_layers=shape["num_layers"],
        num_decoder_layers=shape["num_layers"],
        d_model=shape["d_model"],
        d_ff=shape["d_ff"],
        num_heads=shape["num_heads"],
        num_kv_heads=config_dict.placeholder(int),  # None: num_heads
        d_k=config_dict.placeholder(int),  # None: d_model // num_heads = 64
        d_v=config_dict.placeholder(int),  # None: d_k
        dropout_rate=dropout_rate,
        attention_dropout_rate=0.0,  # none in the paper (t2t transformer_base_v1: 0.0)
        relu_dropout_rate=0.0,
        positional="sinusoidal",
        norm="layer_norm",
        norm_position="post",
        activation="relu",
        use_bias=True,
        share_embeddings=True,
        tie_output_embedding=True,
        max_len=256,
        dtype="float32",
        scan_layers=False,
        remat_policy="none",
        attention_implementation="auto",
        norm_eps=1e-6,
        rope_theta=10000.0,  # read by positional="rope" only
        scale_embeddings=True,  # section 3.4: embeddings times sqrt(d_model)
        gelu_approximate=True,  # read by activation="gelu" only
        bos_id=2, eos_id=3, pad_id=0,  # the vocabulary's (transformer/data/tokenizer.py)
        attention_kind="softmax",  # the paper's: softmax over every position, every layer
        linear_feature_map="elu",  # read by attention_kind="linear" only
        attention_window=config_dict.placeholder(int),  # read by "local" layers only
        attention_pattern="global",
        attention_global_tokens=0,  # local layers: the first positions attend to/from all
        context_parallel_strategy="all_gather",  # read where mesh.context > 1 only
        context_load_balance=True,
        # The later families' options, all off: the paper has none of them
        qkv_bias=False, logits_bias=False,  # Qwen2's q/k/v biases, Marian's final_logits_bias
        post_sublayer_norm=False, norm_scale_offset=0.0,  # Gemma 2's norms
        qk_norm="none",  # Qwen3's, Gemma 3's and OLMo 2's q/k norms
        rope_local_theta=config_dict.placeholder(float),  # Gemma 3's local layers' base
        attention_logit_softcap=config_dict.placeholder(float),  # Gemma 2's caps
        logits_softcap=config_dict.placeholder(float),
        attention_scale_dim=config_dict.placeholder(int),  # None: 1/sqrt(d_k), as the paper
        rope_scaling="none", rope_scaling_factor=1.0,  # read by positional="rope" only
        rope_original_max_len=config_dict.placeholder(int), rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_beta_fast=32.0, rope_beta_slow=1.0,
        rope_attention_factor=config_dict.placeholder(float),
        relative_buckets=32, relative_max_distance=128,  # read by positional="relative" (T5)
        **EXPERTS_OFF, **QUANTIZATION_OFF,
    ))

    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adam",
        schedule="paper_rsqrt",  # d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
        learning_rate=0.0,  # unused by paper_rsqrt (its peak follows from d_model)
        warmup_steps=4000,
        b1=0.9,
        b2=0.98,
        eps=1e-9,
        weight_decay=0.0,
        clip_norm=0.0,  # 0: no clipping
        moments_dtype="float32",  # Adam's moments; "bfloat16" halves them
        loss_scale_initial=2**15,  # model.dtype=float16: dynamic loss scaling (NVIDIA AMP)
        loss_scale_period=2000,  # doubles after this many finite steps, halves on overflow
        **SPIKES_OFF, **WSD_AND_MUON,
    ))
    cfg.distributed = config_dict.ConfigDict(dict(  # multi-process runs (train.py flags)
        initialization_timeout_seconds=300,  # waiting for all processes to join
        heartbeat_timeout_seconds=100))  # a dead peer stops the others after this long
    cfg.metrics = config_dict.ConfigDict(dict(tracker="tensorboard"))  # or wandb, trackio
    cfg.slow_step_factor = 0.0  # > 1: a step this many times the median dumps the stacks
    cfg.step_timeout_seconds = 0.0  # > 0: a step not ended then stops the run (a hang)
    cfg.label_smoothing = 0.1
    cfg.z_loss = 0.0
    # Target tokens per device whose logits the loss computes at once (their softmax gradient
    # too, never the logits [B, T, V] whole); 0: all at once; -1: by backend (512 on a CPU,
    # where a chunk then stays in cache; 8192 on an accelerator, where chunks bound memory).
    cfg.loss_chunk_tokens = -1
    cfg.skip_nonfinite_updates = False  # True: skip (and count) non-finite updates; else stop
    cfg.elastic = False  # True: a resume on other devices refits data x fsdp, grad_accum_steps
    cfg.log_every_steps = 100
    cfg.profile_start_step = 0
    cfg.profile_num_steps = 0  # > 0: a jax.profiler trace of that many steps in <workdir>/profile
    cfg.decode = config_dict.ConfigDict(dict(
        beam_size=4, alpha=0.6,  # GNMT length penalty ((5 + |Y|) / 6)^alpha
        max_extra_length=50,  # output length <= input length + 50
        drop_decided=False))  # True: beam search drops decided sentences (long jobs)
    return cfg
