"""A synthetic sequence task generated in-process: copy or reverse a random token sequence.

It needs no network, TensorFlow or files, and learns in seconds, so it is the fast workload of
the tests and smoke runs (`configs/tiny.py`). Each example is a pure function of
(seed, split, global example index).

Shape legend: B batch, S source length, T target length (S + 1: the sequence, then EOS).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer.data.tokenizer import EOS_ID, PAD_ID

FIRST_TOKEN = EOS_ID + 1  # ids below are pad, unk, bos, eos (no [MASK]: no tokenizer here)
TASKS = ("copy", "reverse")
_SPLIT_STREAM = {"train": 0, "validation": 1, "test": 2}


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """Examples as {"inputs": [B, S], "targets": [B, S + 1]} int32, padded with 0."""

    task: str
    vocab_size: int
    min_length: int
    max_length: int
    seed: int

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"data.task={self.task!r} is not one of {', '.join(TASKS)}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= data.min_length={self.min_length} <= "
                             f"data.max_length={self.max_length}")
        if self.vocab_size <= FIRST_TOKEN:
            raise ValueError(f"data.vocab_size={self.vocab_size} must exceed {FIRST_TOKEN}")

    @property
    def source_length(self) -> int:
        return self.max_length

    @property
    def target_length(self) -> int:
        return self.max_length + 1

    def fingerprint(self) -> str:
        return (f"synthetic/{self.task} vocab={self.vocab_size} length={self.min_length}.."
                f"{self.max_length} seed={self.seed}")

    def vocabulary_fingerprint(self) -> str:
        return f"ids {FIRST_TOKEN}..{self.vocab_size - 1} (no tokenizer)"

    def example(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.seed, _SPLIT_STREAM[split], index))
        length = int(rng.integers(self.min_length, self.max_length + 1))
        source = rng.integers(FIRST_TOKEN, self.vocab_size, size=length, dtype=np.int32)
        target = source[::-1] if self.task == "reverse" else source
        return source, np.append(target, EOS_ID).astype(np.int32)

    def examples(self, split: str, start: int, count: int) -> dict[str, np.ndarray]:
        """Examples start .. start + count - 1 of the split, padded: a process builds only the
        rows of the global batch it feeds."""
        inputs = np.full((count, self.source_length), PAD_ID, np.int32)
        targets = np.full((count, self.target_length), PAD_ID, np.int32)
        for row in range(count):
            source, target = self.example(split, start + row)
            inputs[row, : len(source)] = source
            targets[row, : len(target)] = target
        return {"inputs": inputs, "targets": targets}


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """`SyntheticTask` examples in global batches of `batch_size` (the `Source` contract)."""

    task: SyntheticTask
    batch_size: int
    grad_accum_steps: int
    eval_examples: int  # size of the validation and test splits
    validation_split: str = "validation"  # the split the training loop evaluates

    @property
    def source_length(self) -> int:
        return self.task.source_length

    @property
    def target_length(self) -> int:
        return self.task.target_length

    @property
    def rows_per_batch(self) -> int:
        return self.batch_size // self.grad_accum_steps

    @property
    def eval_rows_per_batch(self) -> int:
        return self.batch_size

    def fingerprint(self) -> str:
        return self.task.fingerprint()

    def vocabulary_fingerprint(self) -> str:
        return self.task.vocabulary_fingerprint()

    def train_batch(self, index: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
        micro = self.rows_per_batch
        first = index * self.batch_size + rows[0]
        parts = [self.task.examples("train", first + a * micro, rows[1] - rows[0])
                 for a in range(self.grad_accum_steps)]
        return {k: np.stack([p[k] for p in parts]) for k in parts[0]}

    def eval_batches(self, split: str, rows: tuple[int, int]):
        """The split's `eval_examples` examples once. All-zero rows pad the last batch."""
        for first in range(0, self.eval_examples, self.batch_size):
            start = min(first + rows[0], self.eval_examples)
            stop = min(first + rows[1], self.eval_examples)
            examples = self.task.examples(split, start, stop - start)
            padding = rows[1] - rows[0] - (stop - start)
            yield {k: np.pad(v, ((0, padding), (0, 0)))[None] for k, v in examples.items()}
