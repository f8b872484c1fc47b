"""Transformer base, WMT14 English -> German: the paper's first result (Table 2).

    python train.py --config=configs/wmt14_ende_base.py --workdir=runs/wmt14_ende_base

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 100k steps of ~25k
source + ~25k target tokens (0.4 s/step, 12 hours). On fewer devices keep the tokens per update,
e.g. `--config.grad_accum_steps=8` on one GPU (or `--config.data.tokens_per_batch` per device
memory), rather than shrinking the batch.

Expected: 27.3 BLEU on newstest2014 (the paper's tokenized, compound-split BLEU, averaging the
last 5 checkpoints, beam 4, alpha 0.6); dev (newstest2013) perplexity 4.92 per word-piece.
Careful replications land at 26.7-27.1. 63.1M parameters with a shared vocabulary of 37,000.
"""

import pathlib
import runpy

paper_config = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["paper_config"]


def get_config():
    return paper_config(size="base", target_lang="de", dropout_rate=0.1)
