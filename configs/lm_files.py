"""A causal language model pretrained on your own files: a glob of jsonl.zst shards (any format
of `transformer/data/files.py`: jsonl, .gz, .zst, parquet, text, ArrayRecord), on a CPU.

    python train.py --config=configs/lm_files.py --workdir=runs/lm_files \
        --config.data.dataset='jsonl:/data/corpus/train-*.jsonl.zst' \
        --config.data.eval_dataset='jsonl:/data/corpus/validation-*.jsonl.zst'

Data: each line of a shard is a JSON object whose `data.text_field` (dotted for nested fields,
e.g. `meta.text`) is one document; remote globs (`gs://bucket/c4/*.json.gz`) read shard by shard.
The order is a seeded permutation computed on the fly (shards shuffled, rows shuffled within
windows of `data.shuffle_window` shards), so batch i is a function of (seed, i) and a run
resumes exactly. SentencePiece trains on `data.vocab_sample_documents` documents drawn across
all shards. Model and cadence: `lm_default.py`'s (Llama-style, d_model 256, 4 layers).
"""

import pathlib
import runpy

cpu_config = runpy.run_path(str(pathlib.Path(__file__).with_name("lm_default.py")))["cpu_config"]


def get_config():
    cfg = cpu_config("causal", num_train_steps=1500, learning_rate=3e-3, warmup_steps=100)
    cfg.data.dataset = "jsonl:corpus/train-*.jsonl.zst"
    cfg.data.eval_dataset = "jsonl:corpus/validation-*.jsonl.zst"
    cfg.data.eval_split = "validation"
    cfg.data.text_field = "text"
    cfg.data.shuffle_window = 8  # shards read together (and held decoded) per host
    cfg.data.skip_bad_lines = False  # True: skip and count malformed jsonl lines
    cfg.generate.max_new_tokens = 40
    return cfg
