"""Input pipelines. Every source's order is a pure function of (seed, global batch index), so
the iterator state in a checkpoint is that index and a run resumes on any number of processes.

This package's `__init__` imports nothing heavy: the synthetic task needs no TensorFlow.
"""


def make_source(cfg):
    """The example source `cfg.data.dataset` names.

    A source has `examples(split, start, count) -> dict of [count, L] arrays`,
    `source_length`, `target_length`, `fingerprint()` and `vocabulary_fingerprint()`.
    """
    name = cfg.data.dataset
    if name == "synthetic":
        from transformer.data.synthetic import SyntheticTask

        return SyntheticTask(task=cfg.data.task, vocab_size=cfg.data.vocab_size,
                             min_length=cfg.data.min_length, max_length=cfg.data.max_length,
                             seed=cfg.seed)
    raise ValueError(f"data.dataset={name!r} is not available; the synthetic task is "
                     f"data.dataset='synthetic'")
