"""Transformer big, WMT14 English -> French (Table 2: 41.8 BLEU, P_drop 0.1, 32k word-pieces).

    python train.py --config=configs/wmt14_enfr_big.py --workdir=runs/wmt14_enfr_big
    python -m transformer.evaluate --workdir=runs/wmt14_enfr_big --split=test --average=20

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 300k steps (1.0 s/step,
3.5 days) of ~25k target tokens each, on 36M sentence pairs. `grad_accum_steps=0` keeps ~25k
tokens per update on fewer devices. A params-only series every 10 minutes keeps the last 20 for
`--average=20`.

Expected on newstest2014 (full), last 20 averaged, beam 4, alpha 0.6: 41.8 tokenized BLEU
(`bleu_tok_compound`: Moses `-l fr`; hyphen splitting changes French scores little) and about
40.5-41 detokenized sacreBLEU (`bleu`; detokenized scores run 1-1.5 below tokenized ones).
"""

from configs.common import paper_config


def get_config():
    return paper_config(size="big", target_lang="fr", dropout_rate=0.1)
