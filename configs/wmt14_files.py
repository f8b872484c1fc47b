"""`configs/default.py`'s English -> German model trained from parquet shards in the Hugging
Face hub's layout (`<repo>/<config>/<split>-*.parquet`, the `wmt/wmt14` repository's), read by
split name: `train-*` to train, `validation-*` for perplexity and BLEU.

    python -m transformer.data.hub_layout --dataset=offline_de_en --out=data/wmt14 --config=de-en
    python train.py --config=configs/wmt14_files.py --workdir=runs/wmt14_files

The first line writes the offline corpus in that layout (a `translation` column of {de, en}
structs), standing in for the hub's files here, where there is no network. A downloaded copy of
`wmt/wmt14`'s `de-en` directory is used the same way (`--config.data.dataset=<its path>`).
Pairs come from columns named by the language codes, or from the nested `translation.<code>`
(`data.source_field` / `data.target_field` name others).
"""

from configs import default


def get_config():
    cfg = default.get_config()
    cfg.data.dataset = "data/wmt14/de-en"  # its validation-*.parquet: data.eval_dataset's ""
    return cfg
