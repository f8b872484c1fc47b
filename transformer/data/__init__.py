"""Input pipelines. Every source's order is a pure function of (seed, global batch index), so
the iterator state in a checkpoint is that index and a run resumes on any number of processes.

This package's `__init__` imports nothing heavy: the synthetic task needs no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

Batch = dict[str, np.ndarray]

# The `data.*` keys a config may set: every source's, since a config may carry keys its source
# does not read (configs/tiny.py's empty source_lang). validate_config names any other key.
CONFIG_KEYS = frozenset({
    "dataset", "vocab_size", "max_length", "batch_size", "eval_batch_size",  # every source
    "max_rows_per_device", "data_dir", "manual_dir", "workers",
    "source_lang", "target_lang", "tokens_per_batch", "vocab_sample_pairs",  # translation
    "objective", "eval_split", "eval_documents", "mask_rate", "vocab_sample_documents",  # LM
    "num_sentinels", "pack_groups",
    "text_field", "eval_dataset", "shuffle_window", "skip_bad_lines",  # files (data/files.py)
    "source_field", "target_field", "sources", "vocab_path", "label_field",
    "task", "min_length", "eval_examples",  # synthetic
    "crop_padding", "random_flip", "test_time_flip",  # images (data/images.py)
    "text_feature", "label_feature",  # text classification (data/text_classification.py)
})


class Source(Protocol):
    """What the training loop reads. Batches are dicts of int32 arrays: "inputs" [.., S] and
    "targets" [.., T] (0 = padding), and for packed rows "inputs_segmentation",
    "targets_segmentation" (0 = padding), "inputs_positions", "targets_positions".

    A global batch has `num_microbatches` (A, gradient accumulation) microbatches of
    `rows_per_batch` rows. Mesh axes data x fsdp split the rows, and each process asks only for
    its own contiguous `rows` = (start, stop). The loop evaluates `validation_split`.
    """

    source_length: int  # S of a batch (for FLOPs accounting)
    target_length: int  # T
    rows_per_batch: int  # global rows of one microbatch
    eval_rows_per_batch: int  # global rows of one eval batch
    validation_split: str  # split the loop evaluates: "validation", or data.eval_split (LMs)

    def train_batch(self, index: int, rows: tuple[int, int]) -> Batch:
        """Rows [start, stop) of every microbatch of global batch `index`: [A, stop-start, length].
        A pure function of (seed, index)."""

    def eval_batches(self, split: str, rows: tuple[int, int]) -> Iterator[Batch]:
        """The split once, as [1, stop-start, length] batches. Padding rows fill the last one."""

    def fingerprint(self) -> str:
        """Names the dataset and its version, for config.json."""

    def vocabulary_fingerprint(self) -> str:
        """Identifies the vocabulary (e.g. the SentencePiece model's sha256)."""


def make_source(cfg, workdir: str | None = None):
    """The batch source `cfg.data.dataset` names (the contract is `Source`): labelled texts
    when `cfg.data.objective` is "classification", conversations when it is "sft", a
    language-model source when it is another objective (causal, prefix, masked,
    span_corruption), images for a vision model, else
    translation pairs.

    `workdir` holds what a translation source derives once and reuses on resume: the
    SentencePiece model and the tokenized training split (`<workdir>/vocab/`). Without it they
    are rebuilt in memory."""
    name = cfg.data.dataset
    if name == "synthetic":
        from transformer.data.synthetic import SyntheticSource, SyntheticTask

        task = SyntheticTask(task=cfg.data.task, vocab_size=cfg.data.vocab_size,
                             min_length=cfg.data.min_length, max_length=cfg.data.max_length,
                             seed=cfg.seed)
        return SyntheticSource(task, batch_size=int(cfg.data.batch_size),
                               grad_accum_steps=int(cfg.grad_accum_steps),
                               eval_examples=int(cfg.data.eval_examples))
    try:
        import tensorflow_datasets  # noqa: F401

        from transformer.data import language_model, translation
    except ImportError as e:
        raise ValueError(f"data.dataset={name!r} needs the data extra ({e.name} is missing): "
                         f"pip install -e '.[data]', or use data.dataset='synthetic'") from None
    if cfg.data.get("objective") == "classification":
        from transformer.data import text_classification

        return text_classification.from_config(cfg, workdir)
    if cfg.data.get("objective") == "sft":  # conversations (data/chat.py)
        from transformer.data import chat

        return chat.from_config(cfg, workdir)
    if cfg.data.get("objective") == "dpo":  # preference pairs (data/preference.py)
        from transformer.data import preference

        return preference.from_config(cfg, workdir)
    if cfg.data.get("objective"):
        return language_model.from_config(cfg, workdir)
    if cfg.model.get("architecture") == "vision":
        from transformer.data import images

        return images.from_config(cfg)
    return translation.from_config(cfg, workdir)
