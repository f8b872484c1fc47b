"""Transformer base, WMT14 English -> German: the paper's first result (Table 2).

    python train.py --config=configs/wmt14_ende_base.py --workdir=runs/wmt14_ende_base
    python -m transformer.evaluate --workdir=runs/wmt14_ende_base --split=test --average=5

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 100k steps of ~25k
source + ~25k target tokens (0.4 s/step, 12 hours). The tokens per update stay the same on any
device count: `grad_accum_steps=0` splits each update into microbatches of at most
`data.max_rows_per_device` rows per device (1 microbatch on 8 devices, 4 on one).
A params-only series every 10 minutes keeps the last 5 for `--average=5`.

Expected on newstest2014 (full, 3,003 sentences), last 5 averaged, beam 4, alpha 0.6:
27.3 tokenized compound-split BLEU (`bleu_tok_compound`, the paper's figure; careful
replications land at 26.7-27.1) and about 26-26.5 detokenized sacreBLEU (`bleu`: 0.7-1.5 lower,
see docs/paper-recipe.md). Dev (newstest2013) perplexity 4.92 per word-piece.
63.1M parameters with a shared vocabulary of 37,000.
"""

from configs.common import paper_config


def get_config():
    return paper_config(size="base", target_lang="de", dropout_rate=0.1)
