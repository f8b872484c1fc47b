"""Transformer big, WMT14 English -> German (Table 2: 28.4 BLEU, P_drop 0.3).

    python train.py --config=configs/wmt14_ende_big.py --workdir=runs/wmt14_ende_big

Hardware: the paper trained on one machine with 8 NVIDIA P100 GPUs for 300k steps (1.0 s/step,
3.5 days) of ~25k target tokens each. fairseq matched it in under 5 hours on 8 V100 with fp16
(`--config.model.dtype=bfloat16` here); keep ~25k tokens per update with
`--config.grad_accum_steps` on fewer devices.

Expected: 28.4 BLEU on newstest2014 (tokenized, compound-split; the last 20 checkpoints averaged,
beam 4, alpha 0.6); dev perplexity 4.33. 214.2M parameters with a shared vocabulary of 37,000.
"""

import pathlib
import runpy

paper_config = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["paper_config"]


def get_config():
    return paper_config(size="big", target_lang="de", dropout_rate=0.3)
