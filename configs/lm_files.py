"""A causal language model pretrained on your own files: a glob of jsonl.zst shards (any format
of `transformer/data/files.py`: jsonl, .gz, .zst, parquet, text, ArrayRecord), on a CPU, or at
the size of `lm_125m.py` / `lm_1b.py` / `lm_8b.py` with `:125m`, `:1b`, `:8b`.

    python train.py --config=configs/lm_files.py --workdir=runs/lm_files \
        --config.data.dataset='jsonl:/data/corpus/train-*.jsonl.zst' \
        --config.data.eval_dataset='jsonl:/data/corpus/validation-*.jsonl.zst'
    python train.py --config=configs/lm_files.py:125m --workdir=gs://<bucket>/lm_125m \
        --config.data.dataset='gs://<bucket>/c4/en/c4-train.*.json.gz' \
        --config.data.eval_dataset='gs://<bucket>/c4/en/c4-validation.0000*.json.gz'

Data: each line of a shard is a JSON object whose `data.text_field` (dotted for nested fields,
e.g. `meta.text`) is one document; remote globs read shard by shard (gs:// needs gcsfs). A
directory in the Hugging Face hub's parquet layout (`<dir>/train-*.parquet`,
`<dir>/validation-*.parquet`) needs no `data.eval_dataset`. The order is a seeded permutation
computed on the fly (shards shuffled, rows shuffled within windows of `data.shuffle_window`
shards), so batch i is a function of (seed, i) and a run resumes exactly. SentencePiece trains
on `data.vocab_sample_documents` documents drawn across all shards, or `data.vocab_path` names
a SentencePiece model to use as is. `data.sources` mixes several globs by token share, e.g.
[{"dataset": "jsonl:/d/web/*.zst", "weight": 0.7}, {"dataset": "parquet:/d/code/*", "weight":
0.3}] (docs/data.md). Model and cadence without a size: `lm_default.py`'s (d_model 256, 4
layers).
"""

import pathlib
import runpy

HERE = pathlib.Path(__file__).parent


def get_config(size: str = ""):
    if size:
        if size not in ("125m", "1b", "8b"):
            raise ValueError(f"--config=configs/lm_files.py:{size}: the size is 125m, 1b or 8b")
        cfg = runpy.run_path(str(HERE / f"lm_{size}.py"))["get_config"]()
    else:
        cpu_config = runpy.run_path(str(HERE / "lm_default.py"))["cpu_config"]
        cfg = cpu_config("causal", num_train_steps=1500, learning_rate=3e-3, warmup_steps=100)
        cfg.generate.max_new_tokens = 40
    cfg.data.dataset = "jsonl:corpus/train-*.jsonl.zst"
    cfg.data.eval_dataset = "jsonl:corpus/validation-*.jsonl.zst"
    cfg.data.eval_split = "validation"
    cfg.data.text_field = "text"
    cfg.data.shuffle_window = 8  # shards read together (and held decoded) per host
    cfg.data.skip_bad_lines = False  # True: skip and count malformed jsonl lines
    cfg.data.vocab_path = ""  # "": train SentencePiece on a sample across all shards
    return cfg
