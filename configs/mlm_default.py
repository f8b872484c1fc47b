"""A BERT-style masked language model on a 2-core CPU: the offline corpus's text.

    python train.py --config=configs/mlm_default.py --workdir=runs/mlm_default

The data and block of `configs/lm_default.py`, encoder-only: 15% of the tokens are selected,
80% of those replaced by [MASK], 10% by a random piece, 10% kept, and the loss (and the eval
perplexity) counts the selected positions alone (`transformer/data/language_model.py`).
"""

from configs.lm_default import cpu_config


def get_config():
    return cpu_config("masked", num_train_steps=3000, learning_rate=2e-3, warmup_steps=200)
