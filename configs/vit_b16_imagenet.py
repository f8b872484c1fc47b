"""ViT-B/16 on ImageNet with the paper's recipe (Dosovitskiy et al. 2021, Table 3's ImageNet row):

    python train.py --config=configs/vit_b16_imagenet.py --workdir=runs/vit_b16 \
        --config.data.data_dir=<TFDS data_dir with imagenet2012 prepared>
    python train.py --summary --config=configs/vit_b16_imagenet.py

86.6M parameters. Batch 4,096 at 224 px; AdamW (b2 0.999, weight decay 0.3), 10,000 warmup
steps then cosine decay from 3e-3, 300 epochs (93,835 updates), dropout 0.1, clipping at 1.
The sizes and the recipe live in `configs/vit.py` (this is its `B/16`); ImageNet is read only
where a user has prepared it (`transformer/data/images.py`).
"""

from configs import vit


def get_config():
    return vit.get_config("B/16")
