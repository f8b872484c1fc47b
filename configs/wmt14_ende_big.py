"""Transformer big, WMT14 English -> German (Table 2: 28.4 BLEU, P_drop 0.3).

    python train.py --config=configs/wmt14_ende_big.py --workdir=runs/wmt14_ende_big
    python -m transformer.evaluate --workdir=runs/wmt14_ende_big --split=test --average=20

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 300k steps (1.0 s/step,
3.5 days) of ~25k target tokens each. fairseq matched it in under 5 hours on 8 V100 with fp16
(`--config.model.dtype=bfloat16` here). `grad_accum_steps=0` keeps ~25k tokens per update on
fewer devices (microbatches of at most `data.max_rows_per_device` rows per device). A params-only
series every 10 minutes keeps the last 20 for `--average=20`.

Expected on newstest2014 (full), last 20 averaged, beam 4, alpha 0.6: 28.4 tokenized
compound-split BLEU (`bleu_tok_compound`, the paper's figure) and about 27.5 detokenized
sacreBLEU (`bleu`; fairseq's big model: 28.6 sacreBLEU for 29.3 compound-split). Dev perplexity
4.33. 214.2M parameters with a shared vocabulary of 37,000.
"""

from configs.common import paper_config


def get_config():
    return paper_config(size="big", target_lang="de", dropout_rate=0.3)
