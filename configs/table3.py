"""Table 3 of the paper: the variations on the base model, each row a change to a base config.

    python train.py --config=configs/table3.py:C_N2 --workdir=runs/table3/C_N2
    python train.py --config=configs/table3.py:C_N2,wmt14 --workdir=runs/table3_wmt14/C_N2
    python benchmarks/table3.py --workdir=runs/table3          # every row, then the table

The argument is a row name (`ROWS`), optionally followed by `,wmt14`. Rows are written relative
to the base they change, so the same row means the same experiment at either scale:

- `wmt14`: the paper's scale, `configs/wmt14_ende_base.py` (d_model 512, d_ff 2048, 8 heads,
  6 + 6 layers, 37k vocabulary, 100k updates of ~25k tokens). The row's parameter count then
  matches the paper's column (tests/test_table3.py).
- default (reduced): the offline German-English corpus of `configs/default.py`, its vocabulary,
  batches (~1,000 target tokens) and cosine schedule, with the paper's post-LN block (where
  `configs/default.py` normalises before each sublayer) at d_model 128, d_ff 512,
  8 heads (d_k 16) and 3 + 3 layers: widths / 4 and depth / 2, so N 2/4/8 become 1/2/4. Every
  row gets `REDUCED_STEPS` updates and seed 0, and a peak learning rate of
  `REDUCED_LEARNING_RATE` x (128 / d_model)^0.5, the d_model^-0.5 of the paper's schedule.
  The paper's big row trains 3x longer. Here every row gets the same updates, so "big" shows
  the bigger model at equal updates. Why this base, and every row measured at this scale:
  docs/results/2026-12-02-table3.md (its record: docs/table3/results.json).

Rows (the paper's values at its scale): A: heads 1/4/16/32 with d_k = d_v = d_model / h;
B: d_k 16 and 32 with d_v unchanged; C: N 2/4/8, d_model 256/1024 (d_k = d_v scaled),
d_ff 1024/4096; D: P_drop 0.0/0.2, label smoothing 0.0/0.2; E: learned positions. Big.
"""

from configs import default, wmt14_ende_base

REDUCED = dict(d_model=128, d_ff=512, num_heads=8, num_layers=3)
REDUCED_STEPS = 2000
REDUCED_LEARNING_RATE = 2e-3  # the base row's peak (configs/default.py's)


def _heads(h):
    return lambda m: dict(num_heads=h, d_k=m["d_model"] // h, d_v=m["d_model"] // h)


def _d_k(fraction):  # the paper's d_k 16 and 32 are base d_k / 4 and / 2; d_v stays
    return lambda m: dict(d_k=m["d_model"] // m["num_heads"] // fraction,
                          d_v=m["d_model"] // m["num_heads"])


def _layers(paper_n):  # N 2/4/8 against the paper's 6, in proportion to the base's N
    def change(m):
        n = max(1, round(m["num_encoder_layers"] * paper_n / 6))
        return dict(num_encoder_layers=n, num_decoder_layers=n)
    return change


def _scale(**factors):  # d_model and/or d_ff times a factor; d_k = d_v = d_model / h follow
    return lambda m: {key: int(m[key] * f) for key, f in factors.items()}


def _set(**values):
    return lambda m: values


# Row -> (model changes as a function of the base model section, top-level changes).
ROWS = {
    "base": (_set(), {}),
    "A_h1": (_heads(1), {}), "A_h4": (_heads(4), {}),
    "A_h16": (_heads(16), {}), "A_h32": (_heads(32), {}),
    "B_dk16": (_d_k(4), {}), "B_dk32": (_d_k(2), {}),
    "C_N2": (_layers(2), {}), "C_N4": (_layers(4), {}), "C_N8": (_layers(8), {}),
    "C_d256": (_scale(d_model=0.5), {}), "C_d1024": (_scale(d_model=2), {}),
    "C_ff1024": (_scale(d_ff=0.5), {}), "C_ff4096": (_scale(d_ff=2), {}),
    "D_drop0.0": (_set(dropout_rate=0.0), {}), "D_drop0.2": (_set(dropout_rate=0.2), {}),
    "D_ls0.0": (_set(), {"label_smoothing": 0.0}), "D_ls0.2": (_set(), {"label_smoothing": 0.2}),
    "E_learned": (_set(positional="learned"), {}),
    "big": (lambda m: dict(d_model=2 * m["d_model"], d_ff=2 * m["d_ff"],
                           num_heads=2 * m["num_heads"], dropout_rate=0.3), {}),
}


def _base(scale: str):
    if scale == "wmt14":
        return wmt14_ende_base.get_config()
    cfg = default.get_config()
    cfg.model.update(d_model=REDUCED["d_model"], d_ff=REDUCED["d_ff"],
                     num_heads=REDUCED["num_heads"], num_encoder_layers=REDUCED["num_layers"],
                     num_decoder_layers=REDUCED["num_layers"],
                     norm_position="post",  # the paper's block (default.py's norm comes first)
                     dropout_rate=0.1)  # the paper's base P_drop (default.py trains without)
    cfg.num_train_steps = REDUCED_STEPS
    cfg.checkpoint_every_steps = 400
    cfg.eval_every_steps = 400
    cfg.bleu_every_steps = REDUCED_STEPS  # beam search once, at the end
    cfg.bleu_num_sentences = 1036  # the whole validation split
    cfg.params_every_minutes, cfg.params_keep = 0.0, 0  # the rows are not averaged
    return cfg


def get_config(arg: str = "base"):
    row, _, scale = arg.partition(",")
    if row not in ROWS:
        raise ValueError(f"configs/table3.py: unknown row {row!r}; rows: {', '.join(ROWS)}")
    if scale not in ("", "wmt14"):
        raise ValueError(f"configs/table3.py: unknown scale {scale!r} after the row; "
                         "write ROW or ROW,wmt14")
    cfg = _base(scale)
    model_changes, top_changes = ROWS[row]
    changes = model_changes(cfg.model.to_dict())
    if "d_model" in changes and "d_k" not in changes:  # C: d_k = d_v = d_model / h follow
        heads = changes.get("num_heads", cfg.model.num_heads)
        changes.update(d_k=changes["d_model"] // heads, d_v=changes["d_model"] // heads)
    cfg.model.update(changes)
    cfg.update(top_changes)
    if not scale:  # the paper's schedule scales the peak with d_model^-0.5; so does ours
        cfg.optimizer.learning_rate = REDUCED_LEARNING_RATE * (
            REDUCED["d_model"] / cfg.model.d_model) ** 0.5
    return cfg
