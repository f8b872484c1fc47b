"""The Vision Transformer's paper sizes, with the paper's ImageNet recipe.

    python train.py --summary --config=configs/vit.py:L/16

The argument is `<size>/<patch>`: size Ti, S, B, L or H, patch 16 or 14 (any patch dividing
224 works). B, L and H are Table 1 of Dosovitskiy et al. 2021 ("An Image is Worth 16x16
Words"): 12/24/32 layers, width 768/1024/1280, MLP 3072/4096/5120, 12/16/16 heads; Ti and S
(192 and 384 wide, 3 and 6 heads, 12 layers) are the DeiT sizes (Touvron et al. 2021) used by
"How to train your ViT" (Steiner et al. 2022). At 224 px with 1,000 classes `--summary` counts
B/16 86.6M, L/16 304.3M, H/14 632.0M parameters (Table 1: 86M, 307M, 632M;
tests/model/test_vit.py).

Recipe (the paper's section 4.1 and Table 3, ImageNet from scratch): Adam b1 0.9, b2 0.999,
weight decay 0.3 (Table 3's ImageNet row; section 4.1 names 0.1, the JFT value), batch 4,096,
linear warmup over 10,000 steps then cosine decay from 3e-3 to 0, 300 epochs, dropout 0.1,
gradients clipped at global norm 1, 224 px, random horizontal flips. The paper also uses
Inception crops, which the image pipeline does not do (it resizes the shorter side and crops the
centre; docs/vision.md). `configs/vit_b16_imagenet.py` is this file's B/16.
"""

from ml_collections import config_dict

from configs import common

SIZES = {  # num_layers, d_model, d_ff, num_heads
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}
IMAGENET_TRAIN_IMAGES = 1_281_167


def vit_model(size: str | tuple[int, int, int, int], patch_size: int, *, image_size: int,
              num_channels: int, num_classes: int, dropout_rate: float,
              dtype: str = "bfloat16") -> config_dict.ConfigDict:
    """The `model` section of a ViT: pre-LN, GELU, learned 1-D positions, a class token.
    `size` names one of SIZES or gives (num_layers, d_model, d_ff, num_heads)."""
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"ViT size {size!r} is not one of {', '.join(SIZES)} (e.g. "
                         f"--config=configs/vit.py:B/16)")
    num_layers, d_model, d_ff, num_heads = SIZES[size] if isinstance(size, str) else size
    return config_dict.ConfigDict(dict(
        architecture="vision", image_size=image_size, patch_size=patch_size,
        num_channels=num_channels, num_classes=num_classes, pooling="cls",
        num_encoder_layers=num_layers, num_decoder_layers=0, d_model=d_model, d_ff=d_ff,
        num_heads=num_heads, num_kv_heads=config_dict.placeholder(int),
        d_k=config_dict.placeholder(int), d_v=config_dict.placeholder(int),
        dropout_rate=dropout_rate, attention_dropout_rate=0.0, relu_dropout_rate=0.0,
        positional="learned", norm="layer_norm", norm_position="pre", activation="gelu",
        use_bias=True, vocab_size=1, max_len=1, share_embeddings=False,
        tie_output_embedding=False, dtype=dtype, scan_layers=True, remat_policy="none",
        attention_implementation="auto", norm_eps=1e-6))


def base_config() -> config_dict.ConfigDict:
    """Everything but `model`, `data` and `optimizer`: cadence, checkpoints, mesh."""
    cfg = config_dict.ConfigDict()
    cfg.seed = 0
    cfg.init_from = ""  # a run (workdir, workdir:step, or params dir) to start from
    cfg.init_from_exclude = ""  # a regex of parameter paths init_from leaves fresh
    cfg.mesh = common.mesh()
    cfg.log_every_steps = 100
    cfg.checkpoint_every_steps = 2000
    cfg.checkpoint_every_minutes = 10
    cfg.keep_checkpoints = 3
    cfg.checkpoint_local_dir = ""  # a local tier on host disk or RAM (e.g. /dev/shm/run); "": off
    cfg.checkpoint_local_every_steps = 0  # when on: more often than checkpoint_every_steps
    cfg.keep_local_checkpoints = 2
    cfg.eval_every_steps = 2000
    cfg.label_smoothing = 0.0
    cfg.bleu_every_steps = 0  # no decoding: a classifier
    cfg.bleu_num_sentences = 0
    cfg.params_every_minutes = 0.0
    cfg.params_keep = 0
    cfg.z_loss = 0.0
    cfg.loss_chunk_tokens = 0  # logits [B, num_classes] are small: all at once
    cfg.skip_nonfinite_updates = False
    cfg.elastic = False  # True: a resume on other devices refits data x fsdp, grad_accum_steps
    cfg.profile_start_step = 0
    cfg.profile_num_steps = 0
    cfg.distributed = config_dict.ConfigDict(dict(
        initialization_timeout_seconds=300, heartbeat_timeout_seconds=100))
    cfg.metrics = config_dict.ConfigDict(dict(tracker="tensorboard"))  # or wandb, trackio
    cfg.slow_step_factor = 0.0  # > 1: a step this many times the median dumps the stacks
    cfg.step_timeout_seconds = 0.0  # > 0: a step not ended then stops the run (a hang)
    return cfg


def get_config(arg: str = "B/16"):
    size, _, patch = arg.partition("/")
    if not patch.isdigit():
        raise ValueError(f"--config=configs/vit.py:{arg}: give <size>/<patch>, e.g. B/16")
    cfg = base_config()
    cfg.model = vit_model(size, int(patch), image_size=224, num_channels=3, num_classes=1000,
                          dropout_rate=0.1)
    cfg.data = config_dict.ConfigDict(dict(
        dataset="imagenet2012", batch_size=4096, eval_batch_size=1024,
        max_rows_per_device=128,  # one microbatch on one device; lower it if memory binds
        crop_padding=0, random_flip=True,
        data_dir=config_dict.placeholder(str),  # TFDS data_dir holding imagenet2012
        manual_dir=config_dict.placeholder(str),  # or ILSVRC2012_img_{train,val}.tar here
        workers=0))  # Grain processes producing this process's batches; 0: the loop itself
    cfg.grad_accum_steps = 0  # sized from the device count and data.max_rows_per_device
    cfg.num_train_steps = 300 * IMAGENET_TRAIN_IMAGES // 4096  # 300 epochs: 93,835 updates
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adamw", schedule="cosine", learning_rate=3e-3, warmup_steps=10_000,
        end_fraction=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.3, clip_norm=1.0,
        **common.SPIKES_OFF, **common.WSD_AND_MUON))
    return cfg
