"""Which examples a training batch holds: the file and row of each for a source of files, else
the example's index in the dataset's training split. `transformer.replay` prints them ("was it
the data or the machine?").

Every source's batch is a pure function of (seed, batch index) (`transformer.data`), so the
listing asks the source the same questions `train_batch` asks: the synthetic task's example
indices, a translation plan's pairs (`TranslationSource.batch_examples`), a language model's
documents (`LanguageModelSource.batch_documents`; packed, so a row holds several and a long
document's pieces may be cut off the end of the batch) and a classifier's split positions
(`batch_positions`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One example of a batch."""

    index: int  # its id in the training split (files: the global id over the sorted shards)
    slot: int | None = None  # its row in the batch, microbatch * rows_per_batch + row; None:
    # packed by the language-model source (`train_pieces` places its pieces)
    file: str | None = None  # the shard it was read from (sources of files)
    row: int | None = None  # its record in that shard, from 0 (malformed lines skipped)
    record: str | None = None  # else where the dataset keeps it, e.g. "train[12].text"

    def __str__(self) -> str:
        where = (f"{self.file} row {self.row}" if self.file is not None
                 else self.record or f"train example {self.index}")
        return where if self.slot is None else f"batch row {self.slot}: {where}"


def batch_examples(source, index: int) -> list[Example]:
    """The examples of global training batch `index` of `source` (a `transformer.data.Source`),
    in the order the source places them. ValueError for a source that cannot say."""
    from transformer.data.synthetic import SyntheticSource

    if isinstance(source, SyntheticSource):  # train_batch reads examples index * B + row
        first = index * source.batch_size
        return [Example(first + row, slot=row) for row in range(source.batch_size)]
    if hasattr(source, "batch_documents"):  # a language model: packed documents
        train = source.documents["train"]
        return _located(train, source.batch_documents(index), None)
    if hasattr(source, "plans"):  # translation: the epoch plan's pairs and their rows
        examples, placement = source.batch_examples(index)
        train = source._source("train")
        return _located(getattr(train, "documents", None), examples,
                        [row for row, _, _ in placement])
    if hasattr(source, "batch_positions"):  # classifiers: positions in the train split
        positions = source.batch_positions(index)
        return [Example(int(p), slot=row) for row, p in enumerate(positions.tolist())]
    raise ValueError(f"{type(source).__name__} cannot list the examples of a batch")


def _located(documents, ids, slots) -> list[Example]:
    """Examples `ids` of `documents` (FileDocuments, a Mixture of them, TfdsDocuments or None)
    with their file and row where they come from files."""
    ids = np.asarray(ids, np.int64)
    slots = [None] * len(ids) if slots is None else slots
    places = _files_and_rows(documents, ids)
    keys = getattr(documents, "keys", None)  # TFDS: document d is field keys[d % F] of d // F
    out = []
    for i, slot, place in zip(ids.tolist(), slots, places, strict=True):
        if place is not None:
            out.append(Example(i, slot=slot, file=place[0], row=place[1]))
        elif keys:
            record = f"{documents.split}[{i // len(keys)}].{keys[i % len(keys)]}"
            out.append(Example(i, slot=slot, record=record))
        else:
            out.append(Example(i, slot=slot))
    return out


def _files_and_rows(documents, ids: np.ndarray) -> list[tuple[str, int] | None]:
    """(shard path, row) of each id: a FileDocuments' shards follow each other in id order, a
    Mixture's sources likewise. None where `documents` does not come from files."""
    if hasattr(documents, "sources"):  # a Mixture of FileDocuments
        which = documents.source_of(ids)
        return [_files_and_rows(documents.sources[s], np.array([i - documents.offsets[s]]))[0]
                for i, s in zip(ids.tolist(), which.tolist(), strict=True)]
    if not hasattr(documents, "paths"):
        return [None] * len(ids)
    shards = np.searchsorted(documents.offsets, ids, side="right") - 1
    return [(documents.paths[k], int(i - documents.offsets[k]))
            for i, k in zip(ids.tolist(), shards.tolist(), strict=True)]
