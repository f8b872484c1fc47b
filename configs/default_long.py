"""The 2026-12-02 default trained longer: where its curve goes in a few hours.

    python train.py --config=configs/default_long.py --workdir=runs/default_long
    python -m transformer.evaluate --workdir=runs/default_long --split=test

Same data, vocabulary, model and batch as `configs/default_2026_12_02.py`; 30,000 updates
(about 33 passes over the training split) with the cosine decay stretched over them, and the
dropout of the paper's base model kept at 0.1 although the corpus is now seen many times.
Stop it whenever you like: rerunning the same command resumes from the last checkpoint (every
10 minutes), and `transformer.evaluate` scores whatever was saved last.

Hardware, time and expected result (seed 0, a 2-core CPU VM): 3.3 hours of training steps,
test sacreBLEU 36.35, test perplexity 7.43 (docs/results/2026-12-02-default-long.md).
"""

from configs import default_2026_12_02


def get_config():
    cfg = default_2026_12_02.get_config()
    cfg.num_train_steps = 30_000
    cfg.bleu_every_steps = 5000
    cfg.log_every_steps = 100
    cfg.eval_every_steps = 1000
    cfg.checkpoint_every_steps = 2000
    return cfg
