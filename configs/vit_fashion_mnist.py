"""A small Vision Transformer on Fashion-MNIST, the CPU default for images.

    python train.py --config=configs/vit_fashion_mnist.py --workdir=runs/vit_fashion_mnist

Data: the TFDS dataset `offline_fashion_mnist`, built on first use from Debian's
dataset-fashion-mnist package (apt-get download, 30.9 MB; about a minute): 54,935 training,
5,065 validation and 10,000 test images, 28x28 grey, ten classes. Augmentation: random crops of
the image zero-padded by 1 pixel, horizontal flips (clothes keep their class mirrored).
Evaluation (validation, test, `transformer.classify`) averages the class probabilities of each
image and its mirror image (`data.test_time_flip`).

Model: patches of 7x7 (16 patches and a class token), 6 pre-LN layers of width 64, MLP 128,
4 heads, GELU, learned positions, float32: about 0.2M parameters. AdamW 3e-3 (b2 0.999,
weight decay 0.05), 300 warmup steps then cosine to 0 at update 4,800 (batch 256: 22 epochs).
The validation split every 1,000 updates, the test split once at the end (docs/vision.md).

Hardware, time and expected result: a 2-core CPU VM, 8.5-18.5 minutes for the 4,800 updates
(the VM's speed drifts). Test accuracy 90.20% with the mirror averaged
(docs/results/2026-12-02-vit-fashion-mnist.md, with the recipes compared).
"""

from ml_collections import config_dict

from configs import common, vit


def get_config():
    cfg = vit.base_config()
    cfg.model = vit.vit_model((6, 64, 128, 4), 7, image_size=28, num_channels=1,
                              num_classes=10, dropout_rate=0.0, dtype="float32")
    cfg.model.scan_layers = False
    cfg.data = config_dict.ConfigDict(dict(
        dataset="offline_fashion_mnist", batch_size=256, eval_batch_size=500,
        crop_padding=1, random_flip=True,
        test_time_flip=True,  # evaluation averages each image's and its mirror's probabilities
        data_dir=config_dict.placeholder(str),  # TFDS data_dir; None: TFDS's default
        manual_dir=config_dict.placeholder(str),  # an unpacked dataset-fashion-mnist tree
        workers=0))  # Grain processes producing this process's batches; 0: the loop itself
    cfg.grad_accum_steps = 1
    cfg.num_train_steps = 4800
    cfg.log_every_steps = 50
    cfg.eval_every_steps = 1000
    cfg.checkpoint_every_steps = 1000
    cfg.optimizer = config_dict.ConfigDict(dict(
        name="adamw", schedule="cosine", learning_rate=3e-3, warmup_steps=300,
        end_fraction=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05, clip_norm=1.0,
        **common.SPIKES_OFF, **common.WSD_AND_MUON))
    return cfg
