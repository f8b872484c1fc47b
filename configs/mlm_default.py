"""A BERT-style masked language model on a 2-core CPU: the offline corpus's text.

    python train.py --config=configs/mlm_default.py --workdir=runs/mlm_default

The data and block of `configs/lm_default.py`, encoder-only: 15% of the tokens are selected,
80% of those replaced by [MASK], 10% by a random piece, 10% kept, and the loss (and the eval
perplexity) counts the selected positions alone (`transformer/data/language_model.py`).
"""

import pathlib
import runpy

lm_config = runpy.run_path(str(pathlib.Path(__file__).with_name("lm_common.py")))["lm_config"]


def get_config():
    cfg = lm_config(objective="masked", dataset="offline_de_en", vocab_size=8000, max_length=128,
                    batch_size=16, num_layers=4, d_model=256, d_ff=704, num_heads=4,
                    num_kv_heads=2, num_train_steps=3000, learning_rate=2e-3, warmup_steps=200,
                    mesh=dict(data=-1, fsdp=1, tensor=1), dtype="float32", scan_layers=False)
    cfg.log_every_steps = 25
    cfg.eval_every_steps = 500
    cfg.checkpoint_every_steps = 500
    cfg.checkpoint_every_minutes = 10
    cfg.z_loss = 0.0
    return cfg
