"""A small Vision Transformer on Fashion-MNIST, the CPU default for images.

    python train.py --config=configs/vit_fashion_mnist.py --workdir=runs/vit_fashion_mnist

Data: the TFDS dataset `offline_fashion_mnist`, built on first use from Debian's
dataset-fashion-mnist package (apt-get download, 30.9 MB; about a minute): 54,935 training,
5,065 validation and 10,000 test images, 28x28 grey, ten classes. Augmentation: random crops of
the image zero-padded by 2 pixels, horizontal flips (clothes keep their class mirrored).

Model: patches of 7x7 (16 patches and a class token), 6 pre-LN layers of width 64, MLP 128,
4 heads, GELU, learned positions, float32: about 0.2M parameters. AdamW 3e-3 (b2 0.999, weight
decay 0.05), 150 warmup steps then cosine to 0 at update 3,000 (batch 128: 7 epochs); the
validation split every 500 updates, the test split once at the end (README, Vision
Transformer).

Hardware and time: sized for the 2-core CPU VM. Measured on 2026-12-01 while the machine ran
other jobs (load 14 to 21 on 2 cores for most of the run): the dataset built in 7.9 min, then
3,000 updates took 67.6 min (train step compiled in 2.8 min, 50-350 images/s) and reached
86.1% test accuracy (validation 87.4%): short of the goal, 90% within 20 minutes (README,
Vision Transformer). On the quiet machine the same 3,000 updates take about 6 minutes.
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
        dataset="offline_fashion_mnist", batch_size=128, eval_batch_size=500,
        crop_padding=2, random_flip=True,
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str)))  # an unpacked dataset-fashion-mnist tree
    cfg.grad_accum_steps = 1
    cfg.num_train_steps = 3000
    cfg.log_every_steps = 50
    cfg.eval_every_steps = 500
    cfg.checkpoint_every_steps = 500
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adamw", schedule="cosine", learning_rate=3e-3, warmup_steps=150,
        end_fraction=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05, clip_norm=1.0))
    return cfg
