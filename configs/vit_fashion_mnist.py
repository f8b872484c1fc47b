"""A small Vision Transformer on Fashion-MNIST, the CPU default for images.

    python train.py --config=configs/vit_fashion_mnist.py --workdir=runs/vit_fashion_mnist

Data: the TFDS dataset `offline_fashion_mnist`, built on first use from Debian's
dataset-fashion-mnist package (apt-get download, 30.9 MB; about a minute): 54,935 training,
5,065 validation and 10,000 test images, 28x28 grey, ten classes. Augmentation: random crops of
the image zero-padded by 2 pixels, horizontal flips (clothes keep their class mirrored).

Model: patches of 7x7 (16 patches and a class token), 6 pre-LN layers of width 64, MLP 128,
4 heads, GELU, learned positions, float32: about 0.2M parameters. AdamW 3e-3 (b2 0.999,
weight decay 0.05), 300 warmup steps then cosine to 0 at update 6,000 (batch 256: 28 epochs);
the validation split every 1,000 updates, the test split once at the end (README, Vision
Transformer).

Hardware and time: sized for the 2-core CPU VM. Measured on 2026-12-01: 89.80% test accuracy
(validation 90.40%), short of the goal of 90% within 20 minutes, in 27.6 min wall while tests
ran beside it. The machine's speed varied that day: this model trained at 1,650 images/s at
10:33 (6,000 updates of 256 in about 16 minutes) and at 1,150 images/s alone at 11:30 (about
23 minutes). `--config.model.pooling=gap` (the patches' mean, no class token) gave 89.93%
(validation 90.40%); the earlier 3,000 updates of batch 128 gave 86.13%.
"""

import pathlib
import runpy

from ml_collections import config_dict

_vit = runpy.run_path(str(pathlib.Path(__file__).with_name("vit.py")))


def get_config():
    cfg = _vit["base_config"]()
    cfg.model = _vit["vit_model"]((6, 64, 128, 4), 7, image_size=28, num_channels=1,
                                  num_classes=10, dropout_rate=0.0, dtype="float32")
    cfg.model.scan_layers = False
    cfg.data = config_dict.ConfigDict(dict(
        dataset="offline_fashion_mnist", batch_size=256, eval_batch_size=500,
        crop_padding=2, random_flip=True,
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str)))  # an unpacked dataset-fashion-mnist tree
    cfg.grad_accum_steps = 1
    cfg.num_train_steps = 6000
    cfg.log_every_steps = 50
    cfg.eval_every_steps = 1000
    cfg.checkpoint_every_steps = 1000
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adamw", schedule="cosine", learning_rate=3e-3, warmup_steps=300,
        end_fraction=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05, clip_norm=1.0))
    return cfg
