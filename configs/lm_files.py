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
e.g. `meta.text`) is one document. Remote globs read shard by shard (gs:// needs gcsfs). A
directory in the Hugging Face hub's parquet layout (`<dir>/train-*.parquet`,
`<dir>/validation-*.parquet`) needs no `data.eval_dataset`. The order is a seeded permutation
computed on the fly (shards shuffled, rows shuffled within windows of `data.shuffle_window`
shards), so batch i is a function of (seed, i) and a run resumes exactly. SentencePiece trains
on `data.vocab_sample_documents` documents drawn across all shards, or `data.vocab_path` names
a SentencePiece model to use as is. `data.sources` mixes several globs by token share
(docs/data.md). On the command line it is a tuple:

    --config.data.sources='({"dataset": "jsonl:/d/web/*.zst", "weight": 0.7},
                            {"dataset": "parquet:/d/code/*", "weight": 0.3})'

Every language model config holds these keys (configs/common.py), so any of them trains on
files as well. Without a size, the model and cadence are `lm_default.py`'s (d_model 256, 4
layers).
"""

from configs import lm_1b, lm_8b, lm_125m, lm_default

SIZES = {"125m": lm_125m, "1b": lm_1b, "8b": lm_8b}


def get_config(size: str = ""):
    if size and size not in SIZES:
        raise ValueError(f"--config=configs/lm_files.py:{size}: the size is 125m, 1b or 8b")
    cfg = SIZES[size].get_config() if size else lm_default.get_config()
    cfg.data.dataset = "jsonl:corpus/train-*.jsonl.zst"
    cfg.data.eval_dataset = "jsonl:corpus/validation-*.jsonl.zst"
    return cfg
