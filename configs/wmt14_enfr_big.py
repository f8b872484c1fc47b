"""Transformer big, WMT14 English -> French (Table 2: 41.8 BLEU, P_drop 0.1, 32k word-pieces).

    python train.py --config=configs/wmt14_enfr_big.py --workdir=runs/wmt14_enfr_big

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 300k steps (1.0 s/step,
3.5 days) of ~25k target tokens each, on 36M sentence pairs. Keep ~25k tokens per update with
`--config.grad_accum_steps` on fewer devices.

Expected: 41.8 BLEU on newstest2014 (tokenized; the last 20 checkpoints averaged, beam 4,
alpha 0.6).
"""

import pathlib
import runpy

paper_config = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["paper_config"]


def get_config():
    return paper_config(size="big", target_lang="fr", dropout_rate=0.1)
