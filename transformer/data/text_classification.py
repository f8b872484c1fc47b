"""Text classification batches (the `Source` contract of `transformer.data`) from a TFDS dataset
with a text and a label feature: the offline `offline_help_topics` (LibreOffice help paragraphs
labelled by module), or any prepared one (`imdb_reviews`, `ag_news_subset`, ...; read with
download=False semantics: nothing is fetched). Config: `data.objective="classification"`,
`data.text_feature` and `data.label_feature` (default "text" and "label"; the label a
`ClassLabel`), a `model.architecture="classifier"` with `model.num_classes` classes.

Batches are {"inputs": [A, rows, S] int32, "label": [A, rows] int32}, S = `data.max_length`:
one example a row, its SentencePiece pieces then EOS (as the masked LM's pretraining pieces
end), cut to S (the last piece kept is EOS), zero-padded. Evaluation rows past the split's end
are all padding with label -1 (left out of the loss and accuracy).

Vocabulary: the run's `<workdir>/vocab/` (with `init_from`, the pretrained run's, which the
loop copies there first), else `data.vocab_path` used as is (a copy kept there; it needs a
padding token at id 0), else trained (seeded) on the training texts and saved there. From files,
the shards' rows are counted once and recorded there (`files.FileDocuments`, `rows-*.json`).

Order: global batch `index` is epoch e = index // batches_per_epoch of a permutation of the
training examples seeded by (seed, e), cut into consecutive runs of `batch_size` (an epoch's
remainder is dropped): a pure function of (seed, index). Each process takes only its `rows` of
each microbatch. The splits are tokenized once, in memory (the help topics: 34k short texts).

The loop evaluates "validation" (a dataset without one: "test", logged); `test_split` is "test"
(as the image source's, for `evaluation.evaluate_test_split`). Shapes: A microbatches,
S = data.max_length.
"""

from __future__ import annotations

import logging

import numpy as np

from transformer.checkpoint import layout
from transformer.data import batching, file_specs, files, settings
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.datasets import CHUNK, DataUnavailable, prepare_dataset

log = logging.getLogger("transformer")
OFFLINE = "offline_help_topics"  # built here from Debian packages; others must be prepared


def open_builder(name: str, data_dir: str | None, manual_dir: str | None):
    """The prepared TFDS builder (array_record); `offline_help_topics` is built on first use,
    any other dataset not prepared is one line saying how to provide it."""
    import tensorflow_datasets as tfds

    if name == OFFLINE:
        from transformer.data.offline import help_topics  # noqa: F401  (registers it)
    else:
        try:
            prepared = tfds.builder(name, data_dir=data_dir).is_prepared()
        except Exception as e:  # unknown name
            raise DataUnavailable(f"data.dataset={name!r}: {str(e).splitlines()[0]}") from None
        if not prepared:
            raise DataUnavailable(
                f"{name} is not prepared under data.data_dir={data_dir} and is never downloaded "
                f"here: prepare it where there is internet (`tfds build {name} "
                f"--file_format=array_record`) and set data.data_dir, or use "
                f"data.dataset={OFFLINE!r}")
    return prepare_dataset(name, data_dir, manual_dir)


def read_split(builder, split: str, text_feature: str,
                label_feature: str) -> tuple[list[str], np.ndarray]:
    """(texts, labels [n] int64) of a whole split, in record order."""
    source = builder.as_data_source(split=split)
    texts = []
    labels = []
    for first in range(0, len(source), CHUNK):
        for record in source.__getitems__(list(range(first, min(first + CHUNK, len(source))))):
            text = record[text_feature]
            texts.append(text.decode("utf-8") if isinstance(text, bytes) else str(text))
            labels.append(int(record[label_feature]))
    return texts, np.asarray(labels, np.int64)


def encode_rows(tokenizer: tokenizer_lib.Tokenizer, texts: list[str],
                max_length: int) -> tuple[np.ndarray, int]:
    """([n, max_length] int32 rows: each text's pieces, the vocabulary's EOS, zero padding; cut
    to max_length with EOS last), the number of texts cut."""
    rows = np.zeros((len(texts), max_length), np.int32)
    cut = 0
    eos = tokenizer.eos_id
    for i, ids in enumerate(tokenizer.encode(texts)):
        ids = list(ids) + [eos]
        if len(ids) > max_length:
            ids, cut = ids[:max_length - 1] + [eos], cut + 1
        rows[i, :len(ids)] = ids
    return rows, cut


class TextClassificationSource:
    """Tokenized text rows and their labels (module docstring). The `Source` contract."""

    target_length = 1  # one label per row: FLOPs and throughput count rows

    def __init__(self, dataset: str, *, vocab_size: int, max_length: int, batch_size: int,
                 grad_accum_steps: int = 1, eval_batch_size: int | None = None, seed: int = 0,
                 text_feature: str = "text", label_feature: str = "label",
                 data_dir: str | None = None, manual_dir: str | None = None,
                 workdir: str | None = None, vocab_sample_documents: int = 200_000,
                 num_classes: int | None = None, eval_dataset: str | None = None,
                 vocab_path: str | None = None):
        settings.check_rows(max_length, batch_size, grad_accum_steps)
        self.dataset, self.seed = dataset, int(seed)
        self.source_length = self.max_length = int(max_length)
        self.batch_size, self.grad_accum_steps = int(batch_size), int(grad_accum_steps)
        self.rows_per_batch = self.batch_size // self.grad_accum_steps
        self.eval_rows_per_batch = int(eval_batch_size or self.rows_per_batch)
        # read first: a bad data.vocab_path is one line before any other work
        given = tokenizer_lib.read_given(vocab_path) if vocab_path else None
        if given and given.pad_id != tokenizer_lib.PAD_ID:
            raise tokenizer_lib.VocabularyMismatch(
                f"data.vocab_path={vocab_path!r} has no padding token at id "
                f"{tokenizer_lib.PAD_ID}, which pads a classifier's rows: give one with <pad> "
                f"or [PAD] at id {tokenizer_lib.PAD_ID}, or leave data.vocab_path empty")
        record = layout.path(workdir, layout.VOCAB) if workdir else None
        if file_specs.parse_spec(dataset):
            texts = self._read_files(dataset, eval_dataset, text_feature, label_feature,
                                     record)
        else:
            texts = self._read_tfds(dataset, data_dir, manual_dir, text_feature, label_feature)
        if num_classes is not None and num_classes != len(self.class_names):
            raise ValueError(f"model.num_classes={num_classes} but {dataset} has "
                             f"{len(self.class_names)} classes ({', '.join(self.class_names)})")
        if given:
            self.tokenizer = tokenizer_lib.keep_given(
                given, vocab_path, record, int(vocab_size),
                expected_sha256=workdir and layout.recorded_vocabulary(workdir))
        else:
            self.tokenizer = self._tokenizer(texts["train"][0], int(vocab_size),
                                             int(vocab_sample_documents), workdir)
        if self.tokenizer.vocab_size != int(vocab_size):
            raise tokenizer_lib.VocabularyMismatch(
                f"the tokenizer has {self.tokenizer.vocab_size} pieces but "
                f"data.vocab_size={vocab_size}")
        self._splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for split, (split_texts, labels) in texts.items():
            rows, cut = encode_rows(self.tokenizer, split_texts, self.max_length)
            self._splits[split] = (rows, labels.astype(np.int32))
            log.info("%s %s: %d examples, %d cut to data.max_length=%d", dataset, split,
                     len(rows), cut, self.max_length)
        self.batches_per_epoch = len(self._splits["train"][0]) // self.batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(f"{dataset} has {len(self._splits['train'][0])} training examples, "
                             f"fewer than data.batch_size={self.batch_size}")

    def _read_files(self, dataset, eval_dataset, text_field, label_field, record_dir) -> dict:
        """{split: (texts, labels)} from files: labels integers (classes 0..max) or class
        names (sorted, as in the training files). The rows per shard recorded in
        `record_dir` (None: counted each time)."""
        eval_dataset = file_specs.eval_spec(dataset, eval_dataset, "validation")
        raw = {}
        for split, spec, setting in (("train", dataset, "data.dataset"),
                                     ("validation", eval_dataset, "data.eval_dataset")):
            documents = files.FileDocuments(spec, fields=(text_field,), seed=self.seed,
                                            setting=setting, label_field=label_field,
                                            record_dir=record_dir)
            raw[split] = documents.records(np.arange(len(documents)))
            if split == "train":
                self._name = documents.name
        train_labels = [r[1] for r in raw["train"]]
        if all(isinstance(v, int) for v in train_labels):
            self.class_names = tuple(str(c) for c in range(max(train_labels) + 1))
        else:
            self.class_names = tuple(sorted({str(v) for v in train_labels}))
        index = {name: c for c, name in enumerate(self.class_names)}
        texts = {}
        for split, records in raw.items():
            labels = [index.get(str(r[1]), -1) for r in records]
            if min(labels) < 0:
                bad = next(r[1] for r, c in zip(records, labels, strict=True) if c < 0)
                raise file_specs.BadData(f"{split} files: label {bad!r} is not a class of the "
                                         f"training files ({', '.join(self.class_names)})")
            texts[split] = ([r[0] for r in records], np.asarray(labels, np.int64))
        self.validation_split = self.test_split = "validation"
        return texts

    def _read_tfds(self, dataset, data_dir, manual_dir, text_feature, label_feature) -> dict:
        """{split: (texts, labels)} of a TFDS dataset's train, validation and test splits."""
        self.builder = open_builder(dataset, data_dir, manual_dir)
        self._name = self.builder.info.full_name
        features = self.builder.info.features
        for key, value in (("data.text_feature", text_feature),
                           ("data.label_feature", label_feature)):
            if value not in features:
                raise ValueError(f"{key}={value!r} is not a feature of {dataset} "
                                 f"({', '.join(features)})")
        if not hasattr(features[label_feature], "names"):
            raise ValueError(f"data.label_feature={label_feature!r} of {dataset} is not a "
                             f"ClassLabel")
        self.class_names = tuple(features[label_feature].names)
        splits = sorted(self.builder.info.splits)
        if "train" not in splits:
            raise ValueError(f"{dataset} has no train split ({', '.join(splits)})")
        self.validation_split = "validation" if "validation" in splits else "test"
        if self.validation_split not in splits:
            raise ValueError(f"{dataset} has neither a validation nor a test split")
        if self.validation_split == "test":
            log.info("%s has no validation split: evaluating on test", dataset)
        self.test_split = "test" if "test" in splits else self.validation_split
        return {split: read_split(self.builder, split, text_feature, label_feature)
                for split in splits if split in ("train", "validation", "test")}

    def _tokenizer(self, train_texts: list[str], vocab_size: int, sample: int,
                   workdir: str | None) -> tokenizer_lib.Tokenizer:
        chosen = np.sort(np.random.default_rng([self.seed, 7]).permutation(
            len(train_texts))[:sample])

        def sentences():
            return [train_texts[i] for i in chosen]

        if workdir is None:
            return tokenizer_lib.train(sentences(), vocab_size, seed=self.seed)
        info = {"dataset": self._name, "sample_documents": int(len(chosen))}
        return tokenizer_lib.load_or_train(
            layout.path(workdir, layout.VOCAB), vocab_size, seed=self.seed,
            sentences=sentences, expected_sha256=layout.recorded_vocabulary(workdir),
            info=info)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows [n, S] int32, labels [n] int32) of a split."""
        if split not in self._splits:
            raise ValueError(f"split={split!r} is not one of {', '.join(self._splits)}")
        return self._splits[split]

    def fingerprint(self) -> str:
        sizes = " ".join(f"{name}={len(rows)}" for name, (rows, _) in self._splits.items())
        return (f"{self._name} {sizes} max_length={self.max_length} "
                f"classes={len(self.class_names)}")

    def vocabulary_fingerprint(self) -> str:
        return self.tokenizer.fingerprint()

    # ----------------------------------------------------------------- batches

    def batch_positions(self, index: int) -> np.ndarray:
        """Positions in the training split of global batch `index`'s examples, [batch_size]."""
        count = len(self._splits["train"][0])
        return batching.epoch_positions(index, count, self.batch_size, self.seed)

    def train_batch(self, index: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
        """Rows [start, stop) of each microbatch of global batch `index`:
        {"inputs": [A, stop-start, S], "label": [A, stop-start]}."""
        wanted = np.concatenate([a * self.rows_per_batch + np.arange(*rows)
                                 for a in range(self.grad_accum_steps)])
        positions = self.batch_positions(index)[wanted]
        tokens, labels = self._splits["train"]
        shape = (self.grad_accum_steps, rows[1] - rows[0])
        return {"inputs": tokens[positions].reshape(shape + (self.max_length,)),
                "label": labels[positions].reshape(shape)}

    def eval_batches(self, split: str, rows: tuple[int, int]):
        """The split once, in order: [1, stop-start, ...] batches of `eval_rows_per_batch`
        global rows. Rows past the end are padding with label -1."""
        tokens, labels = self.split(split)
        for first in range(0, len(tokens), self.eval_rows_per_batch):
            start, stop = (min(first + r, len(tokens)) for r in rows)
            padding = rows[1] - rows[0] - (stop - start)
            yield {"inputs": np.pad(tokens[start:stop], ((0, padding), (0, 0)))[None],
                   "label": np.pad(labels[start:stop], (0, padding), constant_values=-1)[None]}


def from_config(cfg, workdir: str | None = None) -> TextClassificationSource:
    """`TextClassificationSource` from the config's `data` and `model` keys
    (configs/help_topics.py). One line when they disagree."""
    data = cfg.data
    model = cfg.model
    if model.get("architecture") != "classifier":
        raise ValueError(f"data.objective='classification' trains model.architecture="
                         f"'classifier', not {model.get('architecture')!r}")
    settings.check_model_fits(cfg)
    return TextClassificationSource(
        data.dataset, vocab_size=int(data.vocab_size), max_length=int(data.max_length),
        batch_size=int(data.batch_size), grad_accum_steps=int(cfg.grad_accum_steps),
        eval_batch_size=data.get("eval_batch_size"), seed=int(cfg.seed),
        text_feature=data.get("text_field") or data.get("text_feature") or "text",
        label_feature=data.get("label_field") or data.get("label_feature") or "label",
        eval_dataset=data.get("eval_dataset"), data_dir=data.get("data_dir"),
        manual_dir=data.get("manual_dir"), workdir=workdir,
        vocab_sample_documents=int(data.get("vocab_sample_documents") or 200_000),
        num_classes=int(model.num_classes), vocab_path=data.get("vocab_path") or None)
