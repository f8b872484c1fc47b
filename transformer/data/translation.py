"""The `Source` for TFDS translation datasets: WMT14 (`wmt14_translate/de-en`, `.../fr-en`),
`wmt_t2t_translate/de-en`, and the offline corpus `offline_de_en`.

What happens on first use (each step is skipped when its result exists):
1. The TFDS dataset is prepared in `array_record` format (`prepare_dataset`): `offline_de_en`
   builds itself from Debian packages; WMT is built from the raw files in `data.manual_dir`
   (official file names, see docs/data.md) or read from a prepared `data.data_dir`. A dataset
   prepared in TFRecord is converted to array_record once, in place.
2. The vocabulary, one for both languages: SentencePiece trained on a seeded sample of the
   training split (`tokenizer`), or the one `data.vocab_path` names, used as is. Kept in
   `<workdir>/vocab/`. From files, the shards' rows are counted once and recorded there too
   (`files.FileDocuments`, `rows-<digest>.json`).
3. The training split is tokenized once (`TokenizedSplit`), read through `tfds.data_source`
   (random access), and kept as flat id arrays in `<workdir>/vocab/tokens/` (memory-mapped;
   read whole into memory from a gs:// workdir).

Batches are packed rows (`batching`): global batch `index` maps to its examples and their
placement by a pure function of (seed, index), so the checkpointed iterator state is the index.
A process packs only its own rows. `data.batch_size` rows per update (all accumulation steps) of
`data.max_length` tokens per side, holding at most `data.tokens_per_batch` non-pad source and,
separately, target tokens. Training pairs longer than `data.max_length` (EOS included) are
skipped. Evaluation pairs are kept, truncated to it for perplexity (one log line says how many),
while BLEU translates the raw sentences (`raw_pairs`), whole up to the model's `max_len`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading

import jax
import numpy as np
from etils import epath

from transformer.checkpoint import layout
from transformer.data import batching, file_specs, files, records, settings
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.datasets import (
    CHUNK,
    DataUnavailable,
    open_split,
    prepare_dataset,
    read_pairs,
)
from transformer.util import atomic, progress

log = logging.getLogger("transformer")


# --------------------------------------------------------------------------- tokenized splits


@dataclasses.dataclass
class TokenizedSplit:
    """A split as flat id arrays, EOS included: example i's source is
    source_ids[source_starts[i]:source_starts[i + 1]]."""

    source_ids: np.ndarray
    source_starts: np.ndarray
    target_ids: np.ndarray
    target_starts: np.ndarray

    FILES = ("source_ids", "source_starts", "target_ids", "target_starts")

    def __len__(self) -> int:
        return len(self.source_starts) - 1

    @functools.cached_property
    def source_lengths(self) -> np.ndarray:
        return np.diff(self.source_starts)

    @functools.cached_property
    def target_lengths(self) -> np.ndarray:
        return np.diff(self.target_starts)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.source_ids[self.source_starts[i]:self.source_starts[i + 1]],
                self.target_ids[self.target_starts[i]:self.target_starts[i + 1]])

    @classmethod
    def build(cls, pairs_chunks, tokenizer, dtype) -> TokenizedSplit:
        """Tokenizes chunks of (source, target) texts, appending EOS. Chunk by chunk into
        numpy, so a 4.5M-pair split never lives as Python lists."""
        flats = {"source": [], "target": []}
        lengths = {"source": [], "target": []}
        for pairs in pairs_chunks:
            for side, texts in zip(("source", "target"), zip(*pairs, strict=True), strict=True):
                seqs = tokenizer.encode(texts, num_threads=os.cpu_count() or 1)
                n = np.fromiter((len(q) + 1 for q in seqs), np.int64, len(seqs))
                flat = np.full(int(n.sum()), tokenizer.eos_id, dtype)
                ends = np.cumsum(n) - 1  # each sequence's EOS slot
                for seq, end in zip(seqs, ends.tolist(), strict=True):
                    flat[end - len(seq):end] = seq
                flats[side].append(flat)
                lengths[side].append(n)
        arrays = {}
        for side in flats:
            n = np.concatenate(lengths[side]) if lengths[side] else np.zeros(0, np.int64)
            starts = np.zeros(len(n) + 1, np.int64)
            np.cumsum(n, out=starts[1:])
            arrays[f"{side}_ids"] = (np.concatenate(flats[side]) if flats[side]
                                     else np.zeros(0, dtype))
            arrays[f"{side}_starts"] = starts
        return cls(**arrays)

    def save(self, directory: str, meta: dict) -> None:
        """The arrays as `<name>.npy` in `directory` (local or gs://), then `meta.json` (what
        they were built from, which `load` checks), each file replaced whole."""
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
        for name in self.FILES:
            with atomic.replacing(os.path.join(directory, f"{name}.npy")) as f:
                np.save(f, getattr(self, name))
        atomic.write_atomically(os.path.join(directory, "meta.json"), json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str, meta: dict) -> TokenizedSplit | None:
        """The arrays `save` wrote for `meta` (memory-mapped from a local disk, read whole from
        gs://); None when there are none, or they were built from something else."""
        try:
            if json.loads(epath.Path(directory, "meta.json").read_text()) != meta:
                return None
            return cls(**{name: _read_array(os.path.join(directory, f"{name}.npy"))
                          for name in cls.FILES})
        except (OSError, ValueError):
            return None


def _read_array(path: str) -> np.ndarray:
    if layout.is_remote(path):
        with epath.Path(path).open("rb") as f:
            return np.load(f)
    return np.asarray(np.load(path, mmap_mode="r"))


# --------------------------------------------------------------------------- the source


class TranslationSource:
    """Packed translation batches from a TFDS dataset (the `Source` contract)."""

    def __init__(self, dataset: str, *, source_lang: str, target_lang: str, vocab_size: int,
                 max_length: int, batch_size: int, grad_accum_steps: int = 1,
                 tokens_per_batch: int = 0, eval_batch_size: int | None = None, seed: int = 0,
                 data_dir: str | None = None, manual_dir: str | None = None,
                 workdir: str | None = None, vocab_sample_pairs: int = 500_000,
                 tokenizer: tokenizer_lib.Tokenizer | None = None,
                 source_field: str | None = None, target_field: str | None = None,
                 eval_dataset: str | None = None, skip_bad_lines: bool = False,
                 vocab_path: str | None = None):
        _check_sizes(batch_size, grad_accum_steps, max_length, tokens_per_batch,
                     eval_batch_size)
        # read first: a bad data.vocab_path is one line before any other work
        given = tokenizer_lib.read_given(vocab_path) if vocab_path and not tokenizer else None
        self.dataset, self.seed = dataset, int(seed)
        self.source_lang, self.target_lang = source_lang, target_lang
        self.max_length, self.tokens_per_batch = int(max_length), int(tokens_per_batch)
        self.grad_accum_steps = int(grad_accum_steps)
        self.rows_per_batch = int(batch_size) // self.grad_accum_steps
        self.eval_rows_per_batch = int(eval_batch_size or self.rows_per_batch)
        self.source_length = self.target_length = self.max_length
        self.validation_split = "validation"  # the split the training loop evaluates
        self.workdir = workdir
        self._sources: dict[str, object] = {}
        self.builder = None
        if file_specs.parse_spec(dataset):
            eval_dataset = file_specs.eval_spec(dataset, eval_dataset, self.validation_split)
            fields = (source_field, target_field)
            record = layout.path(workdir, layout.VOCAB) if workdir else None
            for split, spec, setting in (("train", dataset, "data.dataset"),
                                         (self.validation_split, eval_dataset,
                                          "data.eval_dataset")):
                self._sources[split] = _file_split(spec, setting, (source_lang, target_lang),
                                                   fields, record_dir=record, seed=self.seed,
                                                   skip_bad_lines=skip_bad_lines)
            self._name = self._sources["train"].documents.name
        else:
            self.builder = prepare_dataset(dataset, data_dir, manual_dir)
            self._name = self.builder.info.full_name
            languages = tuple(self.builder.info.features.languages)
            for key, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
                if lang not in languages:
                    raise ValueError(f"data.{key}={lang!r} is not a language of {dataset} "
                                     f"({', '.join(languages)})")
        for split in ("train", self.validation_split):
            if (split == "train" or self.builder is None or
                    split in self.builder.info.splits) and \
                    not len(self._source(split)):
                raise DataUnavailable(f"{dataset}: the {split!r} split is empty; prepare the "
                                      f"dataset again (or point data.data_dir elsewhere)")
        if given:
            self.tokenizer = tokenizer_lib.keep_given(
                given, vocab_path, workdir and layout.path(workdir, layout.VOCAB),
                int(vocab_size),
                expected_sha256=workdir and layout.recorded_vocabulary(workdir))
        else:
            self.tokenizer = tokenizer or self._tokenizer(int(vocab_size),
                                                          int(vocab_sample_pairs))
        settings.check_vocab_size(self.tokenizer, vocab_size)
        self.train = self._tokenized("train")
        fits = ((self.train.source_lengths <= self.max_length)
                & (self.train.target_lengths <= self.max_length)
                & (self.train.source_lengths > 1) & (self.train.target_lengths > 1))
        self.num_train_examples, self.num_train_skipped = int(fits.sum()), int((~fits).sum())
        if self.num_train_skipped:
            log.info("%s: %d of %d training pairs are longer than data.max_length=%d and are "
                     "skipped", dataset, self.num_train_skipped, len(self.train),
                     self.max_length)
        self.plans = batching.EpochPlans(
            self.train.source_lengths, self.train.target_lengths, np.flatnonzero(fits),
            seed=self.seed, rows=self.rows_per_batch * self.grad_accum_steps,
            length=self.max_length, budget=self.tokens_per_batch)
        self._eval: dict[str, tuple[TokenizedSplit, np.ndarray]] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- pieces

    def _source(self, split: str):
        if split not in self._sources:
            if self.builder is None:
                raise ValueError(f"split {split!r}: a source of files has train and "
                                 f"{self.validation_split!r} (data.eval_dataset) only")
            self._sources[split] = open_split(self.builder, split)
        return self._sources[split]

    def _chunks(self, split: str, indices=None):
        source = self._source(split)
        indices = range(len(source)) if indices is None else indices
        for i in range(0, len(indices), CHUNK):
            yield read_pairs(source, indices[i:i + CHUNK], self.source_lang, self.target_lang)

    def _tokenizer(self, vocab_size: int, sample_pairs: int) -> tokenizer_lib.Tokenizer:
        n = len(self._source("train"))
        sample = np.sort(np.random.default_rng([self.seed, 7]).permutation(n)[:sample_pairs])

        def sentences():
            for pairs in self._chunks("train", sample):
                for pair in pairs:
                    yield from pair

        info = {"dataset": self.dataset_name, "sample_pairs": int(len(sample)),
                "languages": [self.source_lang, self.target_lang]}
        if self.workdir is None:
            return tokenizer_lib.train(sentences(), vocab_size, seed=self.seed)
        return tokenizer_lib.load_or_train(
            layout.path(self.workdir, layout.VOCAB), vocab_size, seed=self.seed,
            sentences=sentences, expected_sha256=layout.recorded_vocabulary(self.workdir),
            info=info)

    def _tokenized(self, split: str) -> TokenizedSplit:
        dtype = np.uint16 if self.tokenizer.vocab_size <= np.iinfo(np.uint16).max else np.int32
        meta = {"dataset": self.dataset_name, "split": split,
                "examples": len(self._source(split)),
                "languages": [self.source_lang, self.target_lang],
                "vocabulary": self.tokenizer.sha256}
        directory = (layout.path(self.workdir, layout.VOCAB, "tokens",
                                 f"{self.dataset_name.replace('/', '-')}-{split}")
                     if self.workdir and split == "train" else None)
        if directory and (cached := TokenizedSplit.load(directory, meta)) is not None:
            return cached
        with progress.bar(meta["examples"], f"tokenizing {split}", unit="pair",
                          show=jax.process_index() == 0) as bar:
            tokenized = TokenizedSplit.build(_counted(self._chunks(split), bar), self.tokenizer,
                                             dtype)
        if directory:
            tokenized.save(directory, meta)
        return tokenized

    @property
    def dataset_name(self) -> str:
        return self._name

    def fingerprint(self) -> str:
        metadata = self.builder.info.metadata if self.builder else None
        packages = metadata.get("packages") if metadata else None
        extra = ""
        if packages:
            digest = hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()
            extra = f" packages={digest[:16]}"
        return (f"{self.dataset_name} {self.source_lang}->{self.target_lang} "
                f"train={len(self.train)} max_length={self.max_length} "
                f"kept={self.num_train_examples}{extra}")

    def vocabulary_fingerprint(self) -> str:
        return self.tokenizer.fingerprint()

    # ----------------------------------------------------------------- batches

    def batch_examples(self, index: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Example indices of global batch `index` and their (global row, source offset,
        target offset). Global row = microbatch * rows_per_batch + row."""
        with self._lock:
            examples = self.plans.examples(index)
        placement = batching.first_fit(self.train.source_lengths[examples],
                                       self.train.target_lengths[examples],
                                       self.rows_per_batch * self.grad_accum_steps,
                                       self.max_length)
        return examples, placement

    def train_batch(self, index: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
        examples, placement = self.batch_examples(index)
        start, stop = rows
        rows_per_batch = self.rows_per_batch
        pieces = [self.train.pair(i) if start <= row % rows_per_batch < stop else None
                  for i, (row, _, _) in zip(examples.tolist(), placement, strict=True)]
        micro = [batching.pack(pieces, placement, (a * rows_per_batch + start,
                                                   a * rows_per_batch + stop),
                               self.source_length, self.target_length)
                 for a in range(self.grad_accum_steps)]
        return {k: np.stack([m[k] for m in micro]) for k in batching.KEYS}

    def eval_split(self, split: str) -> tuple[TokenizedSplit, np.ndarray]:
        """The split tokenized (truncated to max_length, EOS kept last) and its batch cuts."""
        if split not in self._eval:
            data = self._tokenized(split)
            data = _truncate(data, self.max_length, self.tokenizer.eos_id)
            starts = batching.plan_epoch(data.source_lengths, data.target_lengths,
                                         np.arange(len(data)), self.eval_rows_per_batch,
                                         self.max_length)
            self._eval[split] = (data, starts)
        return self._eval[split]

    def eval_batches(self, split: str, rows: tuple[int, int]):
        data, starts = self.eval_split(split)
        for b in range(len(starts) - 1):
            examples = range(int(starts[b]), int(starts[b + 1]))
            placement = batching.first_fit(data.source_lengths[starts[b]:starts[b + 1]],
                                           data.target_lengths[starts[b]:starts[b + 1]],
                                           self.eval_rows_per_batch, self.max_length)
            pieces = [data.pair(i) if rows[0] <= row < rows[1] else None
                      for i, (row, _, _) in zip(examples, placement, strict=True)]
            batch = batching.pack(pieces, placement, rows, self.source_length,
                                  self.target_length)
            yield {k: v[None] for k, v in batch.items()}

    def num_pairs(self, split: str) -> int:
        """How many pairs `raw_pairs(split)` gives, without reading them."""
        return len(self._source(split))

    def raw_pairs(self, split: str, limit: int | None = None) -> list[tuple[str, str]]:
        """(source text, target text) of a split in order, e.g. for BLEU: the texts as stored,
        never cut to data.max_length (the translator limits sources to the model's max_len)."""
        source = self._source(split)
        return read_pairs(source, range(min(len(source), limit or len(source))),
                          self.source_lang, self.target_lang)


def _file_split(spec: str, setting: str, languages: tuple[str, str],
                fields: tuple[str | None, str | None], *, record_dir: str | None = None,
                **options) -> files.Split:
    """A split of pairs from files. The fields are `data.source_field` and
    `data.target_field` when set. Else the layout is found: the language codes as columns, or
    Hugging Face's nested `translation.<code>`. With `record_dir`, the layout found is recorded
    there with the rows, and a later construction tries it first: it reads no shard to find it
    again."""
    if any(fields):
        explicit = tuple(f or lang for f, lang in zip(fields, languages, strict=True))
        documents = files.FileDocuments(spec, fields=explicit, setting=setting,
                                        record_dir=record_dir, **options)
        return documents.split(languages)
    columns = tuple(languages)
    nested = tuple(f"translation.{lang}" for lang in languages)
    candidates = [columns, nested]
    record = records.Record(record_dir, "layout", [spec, columns]) if record_dir else None
    kept = record.read() if record else None
    if kept and tuple(kept["fields"]) == nested:
        candidates.reverse()
    errors = {}
    for candidate in candidates:
        try:
            documents = files.FileDocuments(spec, fields=candidate, setting=setting,
                                            record_dir=record_dir, **options)
        except file_specs.BadData as e:
            if not ("no column" in str(e) or "no field" in str(e)):
                raise
            errors[candidate] = e
            continue
        if record and (kept or {}).get("fields") != list(candidate):
            record.write({"fields": list(candidate)})
        return documents.split(languages)
    raise errors[columns] from None


def _counted(chunks, bar):
    """`chunks` of pairs, each counted on `bar` once it has been used."""
    for pairs in chunks:
        yield pairs
        bar.update(len(pairs))


def _truncate(data: TokenizedSplit, length: int, eos_id: int) -> TokenizedSplit:
    src_len = data.source_lengths
    tgt_len = data.target_lengths
    if max(src_len.max(initial=0), tgt_len.max(initial=0)) <= length:
        return data
    count = int(((src_len > length) | (tgt_len > length)).sum())
    log.info("%d evaluation pairs are longer than data.max_length=%d: truncated", count, length)
    arrays = {}
    for side in ("source", "target"):
        seqs = [data.pair(i)[0 if side == "source" else 1] for i in range(len(data))]
        seqs = [np.append(s[:length - 1], eos_id) if len(s) > length else s
                for s in seqs]
        starts = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum([len(s) for s in seqs], out=starts[1:])
        arrays[f"{side}_ids"] = np.concatenate(seqs) if seqs else np.zeros(0, np.int32)
        arrays[f"{side}_starts"] = starts
    return TokenizedSplit(**arrays)


def _check_sizes(batch_size, grad_accum_steps, max_length, tokens_per_batch, eval_batch_size):
    settings.check_rows(max_length, batch_size, grad_accum_steps)
    if tokens_per_batch and int(tokens_per_batch) < int(max_length):
        raise ValueError(f"data.tokens_per_batch={tokens_per_batch} must be >= "
                         f"data.max_length={max_length} (0: no budget beyond the rows)")
    if eval_batch_size is not None and int(eval_batch_size) < 1:
        raise ValueError(f"data.eval_batch_size={eval_batch_size} must be >= 1")


def from_config(cfg, workdir: str | None = None) -> TranslationSource:
    """`TranslationSource` from the config's `data` keys (see configs/common.py)."""
    settings.check_model_fits(cfg)
    data = cfg.data
    source = TranslationSource(
        data.dataset, source_lang=data.source_lang, target_lang=data.target_lang,
        vocab_size=int(data.vocab_size), max_length=int(data.max_length),
        batch_size=int(data.batch_size), grad_accum_steps=int(cfg.grad_accum_steps),
        tokens_per_batch=int(data.get("tokens_per_batch") or 0),
        eval_batch_size=data.get("eval_batch_size"), seed=int(cfg.seed),
        data_dir=data.get("data_dir"), manual_dir=data.get("manual_dir"), workdir=workdir,
        vocab_sample_pairs=int(data.get("vocab_sample_pairs") or 500_000),
        source_field=data.get("source_field"), target_field=data.get("target_field"),
        eval_dataset=data.get("eval_dataset"), skip_bad_lines=bool(data.get("skip_bad_lines")),
        vocab_path=data.get("vocab_path") or None)
    tokenizer_lib.check_special_ids(source.tokenizer, cfg.model)
    return source
