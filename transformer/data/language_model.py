"""The `Source` for language-model pretraining on TFDS text (`lm1b`, `c4/en`, and the offline
corpus `offline_de_en` read as monolingual text, each side of a pair a document) or on the
user's files (`files.py`, or a `mixture.py` of them).

The objectives, `data.objective`, are causal, prefix, masked and span_corruption.
`objectives.py` describes each with the batch keys it gives.

Training batch `index` is a pure function of (seed, index). Epoch e is a seeded permutation of
the training documents cut into runs of `docs_per_batch`. A run is tokenized with EOS appended
and each document cut into pieces of at most `data.max_length` tokens. Span corruption cuts
the stream of the run's documents instead. Each piece is its own segment: positions restart
and no token attends across pieces. The pieces are placed first-fit (`batching.first_fit`)
into the update's rows, and a piece that finds no room is dropped. `docs_per_batch` is the
update's capacity in tokens over the mean document length of a seeded sample, so a few
percent are.

With `data.pack_groups` G > 1 each of G groups packs its own documents into its own block of
rows. From files they come from a stream over the group's own shards (`FileDocuments.draw`),
so a process opens only the shards of its rows' groups. From TFDS they are the g-th run of the
update's documents. Masks and prefixes are drawn from generators seeded by (seed, index,
global row), spans by (seed, index, piece), so each process computes only its own rows.

Evaluation reads the first `data.eval_documents` documents of `data.eval_split`, cut the same
way and packed in order with nothing dropped (`batching.plan_epoch`). Its masks and prefixes
are seeded by (seed, batch, row), and so are the same at every evaluation.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np

from transformer.checkpoint import layout
from transformer.data import (
    batching,
    file_specs,
    files,
    mixture,
    records,
    settings,
    span_corruption,
)
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.datasets import CHUNK, text_splits
from transformer.data.mixture import Mixture
from transformer.data.objectives import apply_objective, cut_pieces

log = logging.getLogger("transformer")
OBJECTIVES = {"causal": "decoder", "prefix": "decoder", "masked": "encoder",
              "span_corruption": "encoder_decoder", "sft": "decoder"}  # sft: chat.py
DEFAULT_SENTINELS = {"span_corruption": 100}  # T5's extra_ids
LENGTH_SAMPLE = 2000  # documents whose mean length sizes docs_per_batch
_TRAIN = 0  # the random stream of training batches
_EVAL = 1  # that of evaluation batches


class LanguageModelSource:
    """Packed language-model batches from a TFDS text dataset (the `Source` contract)."""

    document_class = files.FileDocuments  # a file source's documents (chat.ChatDocuments)

    def __init__(self, dataset: str, *, objective: str, vocab_size: int, max_length: int,
                 batch_size: int, grad_accum_steps: int = 1, eval_batch_size: int | None = None,
                 eval_split: str = "validation", eval_documents: int = 2000,
                 mask_rate: float = 0.15, seed: int = 0, data_dir: str | None = None,
                 manual_dir: str | None = None, workdir: str | None = None,
                 vocab_sample_documents: int = 200_000, num_sentinels: int = 0,
                 tokenizer: tokenizer_lib.Tokenizer | None = None, text_field: str = "text",
                 eval_dataset: str | None = None, shuffle_window: int = 8,
                 skip_bad_lines: bool = False, sources: list[dict] | None = None,
                 vocab_path: str | None = None, pack_groups: int = 1):
        if objective not in OBJECTIVES:
            raise ValueError(f"data.objective={objective!r} is not one of "
                             f"{', '.join(OBJECTIVES)}")
        if not 0.0 < mask_rate < 1.0:
            raise ValueError(f"data.mask_rate={mask_rate} must be in (0, 1)")
        settings.check_rows(max_length, batch_size, grad_accum_steps)
        if int(eval_documents) < 1:
            raise ValueError(f"data.eval_documents={eval_documents} must be >= 1")
        self.dataset, self.objective, self.seed = dataset, objective, int(seed)
        self.max_length, self.mask_rate = int(max_length), float(mask_rate)
        self.grad_accum_steps = int(grad_accum_steps)
        self.rows_per_batch = int(batch_size) // self.grad_accum_steps
        self.eval_rows_per_batch = int(eval_batch_size or self.rows_per_batch)
        if int(pack_groups) < 1 or self.rows_per_batch % int(pack_groups):
            raise ValueError(f"data.pack_groups={pack_groups} must divide the "
                             f"{self.rows_per_batch} rows of a micro-batch (data.batch_size="
                             f"{batch_size} / grad_accum_steps={self.grad_accum_steps})")
        self.pack_groups = int(pack_groups)
        self.source_length = self.target_length = self.max_length
        self.span_length = (span_corruption.raw_length(self.max_length)
                            if objective == "span_corruption" else 0)  # tokens per piece
        if self.span_length:  # the targets of a whole piece: T5's 114 for inputs of 512
            self.target_length = span_corruption.corrupted_lengths(self.span_length)[1]
        self.num_sentinels = int(num_sentinels)
        self.validation_split, self.eval_documents = eval_split, int(eval_documents)
        self.workdir, self.vocab_path = workdir, vocab_path
        # read first: a bad data.vocab_path is one line before any shard is counted
        self._given = (tokenizer_lib.read_given(vocab_path) if vocab_path and not tokenizer
                       else None)
        # split -> FileDocuments, a Mixture of them, or TfdsDocuments
        self.documents: dict[str, object] = {}
        self.from_files = bool(sources or file_specs.parse_spec(dataset))
        if self.from_files:
            eval_dataset = file_specs.eval_spec(dataset, eval_dataset, eval_split)
            record = layout.path(workdir, layout.VOCAB) if workdir else None
            opts = dict(fields=(text_field,), seed=self.seed, shuffle_window=shuffle_window,
                        skip_bad_lines=skip_bad_lines, record_dir=record)
            grouped = {**opts, "groups": self.pack_groups}  # eval reads every shard
            train = (mixture.from_sources(sources, grouped) if sources else
                     self.document_class(dataset, **grouped))
            evaluated = self.document_class(eval_dataset, setting="data.eval_dataset", **opts)
            self.documents = {"train": train, eval_split: evaluated}
            self.keys, self.name = [text_field], train.name
        else:
            splits = {"train split": "train", "data.eval_split": eval_split}
            self.documents, self.keys, self.name = text_splits(
                dataset, splits, self.seed, data_dir, manual_dir)
        self.num_train_documents = self._num_documents("train")
        self.tokenizer = tokenizer or self._tokenizer(int(vocab_size),
                                                      int(vocab_sample_documents))
        settings.check_vocab_size(self.tokenizer, vocab_size)
        if objective == "masked" and self.tokenizer.mask_id is None:
            raise ValueError("data.objective='masked' needs a [MASK] piece and the vocabulary "
                             "(data.vocab_path) has none: leave data.vocab_path empty to train "
                             "one, or choose another objective")
        if self.span_length:
            span_corruption.check_sentinels(self.tokenizer, self.span_length, self.num_sentinels)
        self.docs_per_batch = self._docs_per_batch()
        self.batches_per_epoch = self.num_train_documents // self.docs_per_batch
        if self.docs_per_batch < self.pack_groups:
            raise ValueError(f"data.pack_groups={self.pack_groups} exceeds the "
                             f"{self.docs_per_batch} documents of an update: lower it")
        if self.batches_per_epoch < 1:
            raise ValueError(f"{dataset} has {self.num_train_documents} training documents, "
                             f"fewer than one batch needs ({self.docs_per_batch}); lower "
                             f"data.batch_size")
        log.info("%s: %d training documents, %d per batch of %d x %d tokens", dataset,
                 self.num_train_documents, self.docs_per_batch, int(batch_size),
                 self.max_length)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- pieces

    def _num_documents(self, split: str) -> int:
        return len(self.documents[split])

    def _texts(self, split: str, documents) -> list[str]:
        return self.documents[split].texts(documents)

    def _sample(self, key: int, count: int) -> np.ndarray:
        """`count` distinct training documents drawn with seed (seed, key), sorted. From files
        they come from a bounded number of shards (`FileDocuments.sample`)."""
        return self.documents["train"].sample(count, (key,))

    def _tokenizer(self, vocab_size: int, sample_documents: int) -> tokenizer_lib.Tokenizer:
        sample = self._sample(7, sample_documents)

        def sentences():
            for i in range(0, len(sample), CHUNK):
                yield from self._texts("train", sample[i:i + CHUNK])

        info = {"dataset": self.name, "sample_documents": int(len(sample)),
                "features": self.keys}
        if self._given:  # used as is; a run keeps a copy in <workdir>/vocab/
            return tokenizer_lib.keep_given(
                self._given, self.vocab_path,
                self.workdir and layout.path(self.workdir, layout.VOCAB), vocab_size,
                expected_sha256=self.workdir and layout.recorded_vocabulary(self.workdir),
                num_sentinels=self.num_sentinels)
        if self.workdir is None:
            return tokenizer_lib.train(sentences(), vocab_size, seed=self.seed,
                                       num_sentinels=self.num_sentinels)
        return tokenizer_lib.load_or_train(
            layout.path(self.workdir, layout.VOCAB), vocab_size, seed=self.seed,
            sentences=sentences, expected_sha256=layout.recorded_vocabulary(self.workdir),
            info=info, num_sentinels=self.num_sentinels)

    def _docs_per_batch(self) -> int:
        """Documents per update: its capacity in tokens over the mean tokens of a document (a
        mixture: each source's share of the capacity over its own mean)."""
        row_tokens = self.span_length or self.max_length  # span corruption: before corrupting
        capacity = self.rows_per_batch * self.grad_accum_steps * row_tokens
        means = self._mean_lengths()
        train = self.documents["train"]
        if isinstance(train, Mixture):
            return max(1, round(train.set_rates(capacity, means)))
        return max(1, round(capacity / means[0]))

    def _mean_lengths(self) -> list[float]:
        """The mean tokens of a training document (each source's, for a mixture) over a seeded
        sample of `LENGTH_SAMPLE`. A file source with a workdir records them in
        `<workdir>/vocab/lengths-<digest>.json`, so the processes after process 0, and a resumed
        run, decode no sample shard."""
        eos = 0 if self.span_length else 1  # span corruption joins documents without EOS
        train = self.documents["train"]
        record = None
        if self.from_files and self.workdir:
            record = records.Record(
                layout.path(self.workdir, layout.VOCAB), "lengths",
                [self.name, self.num_train_documents, self.vocabulary_fingerprint(),
                 LENGTH_SAMPLE, eos, self.seed])
            if kept := record.read():
                return kept["means"]
        if isinstance(train, Mixture):
            samples = [(source, source.sample(LENGTH_SAMPLE, (11, k)))
                       for k, source in enumerate(train.sources)]
        else:
            samples = [(train, train.sample(LENGTH_SAMPLE, (11,)))]
        means = [float(np.mean([len(ids) + eos for ids in self.tokenizer.encode(
            source.texts(sample))])) for source, sample in samples]
        if record is not None:
            record.write({"means": means})
        return means

    def _objective(self, packed, stream: int, index: int, rows: range):
        """The objective on packed rows, each row's draws seeded by (seed, stream, index, row)."""
        rngs = [np.random.default_rng([self.seed, stream, index, r]) for r in rows]
        return apply_objective(packed, self.objective, rngs, mask_id=self.tokenizer.mask_id,
                               vocab_size=self.tokenizer.pieces, mask_rate=self.mask_rate)

    def fingerprint(self) -> str:
        return (f"{self.name} {self.objective} features={','.join(self.keys)}"
                f" documents={self.num_train_documents} max_length={self.max_length} "
                f"docs_per_batch={self.docs_per_batch}")

    def vocabulary_fingerprint(self) -> str:
        return self.tokenizer.fingerprint()

    # ----------------------------------------------------------------- batches

    def batch_documents(self, index: int) -> np.ndarray:
        """The training documents of global batch `index`, in placement order (group by
        group)."""
        if index < 0:
            raise ValueError(f"batch index {index} < 0")
        train = self.documents["train"]
        if self.from_files and self.pack_groups > 1:
            return np.concatenate([self.group_documents(index, g)
                                   for g in range(self.pack_groups)])
        if isinstance(train, Mixture):
            return train.batch(index)
        epoch, b = divmod(index, self.batches_per_epoch)
        return train.order(epoch, np.arange(b * self.docs_per_batch,
                                            (b + 1) * self.docs_per_batch))

    def group_documents(self, index: int, group: int) -> np.ndarray:
        """The training documents packing group `group` of global batch `index` packs. Files:
        the group's own stream over its own shards (`FileDocuments.draw`, a mixture's
        `batch`), the g-th of `data.pack_groups` equal shares of an update's documents each
        update; TFDS: the g-th equal run of `batch_documents`."""
        if index < 0:
            raise ValueError(f"batch index {index} < 0")
        if self.pack_groups == 1:
            return self.batch_documents(index)
        train = self.documents["train"]
        if isinstance(train, Mixture):
            return train.batch(index, group)
        cuts = self.docs_per_batch * np.arange(self.pack_groups + 1) // self.pack_groups
        if self.from_files:
            size = int(cuts[group + 1] - cuts[group])
            return train.draw(index * size, (index + 1) * size, group)
        return self.batch_documents(index)[cuts[group]:cuts[group + 1]]

    def _cut(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tokenizer.encode(texts)
        if self.span_length:  # T5's reduce_concat_tokens: one stream, cut to whole pieces
            stream = np.concatenate([np.asarray(seq, np.int32) for seq in ids] or
                                    [np.zeros(0, np.int32)])
            return [p for p in cut_pieces([stream], self.span_length, eos=None) if len(p) >= 2]
        return cut_pieces(ids, self.max_length, eos=self.tokenizer.eos_id)

    def _lengths(self, pieces) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) tokens each piece will take in a row (known before corrupting)."""
        n = np.array([len(p) for p in pieces], np.int64)
        if not self.span_length:
            return np.zeros_like(n), n
        lengths = [span_corruption.corrupted_lengths(int(k)) for k in n]
        return np.array(lengths, np.int64).reshape(-1, 2).T

    def _place(self, pieces, rows: int, *, drop: bool):
        return batching.first_fit(*self._lengths(pieces), rows,
                                  (self.source_length, self.target_length), drop=drop)

    def _group_rows(self) -> int:
        """Rows of a packing group in each micro-batch."""
        return self.rows_per_batch // self.pack_groups

    def _groups_of(self, rows: tuple[int, int]) -> list[int]:
        """The packing groups holding rows [start, stop) of the micro-batches."""
        size = self._group_rows()
        return list(range(rows[0] // size, -(-rows[1] // size)))

    def _group_pieces(self, index: int, groups) -> tuple[list[np.ndarray], list, list]:
        """The pieces of global batch `index`'s packing groups `groups`, their first-fit
        placement in the update's rows (None: dropped) and each piece's key (its spans' seed):
        group g packs its own documents (`group_documents`) into its own rows, the g-th block
        of `data.pack_groups` in every micro-batch (so with G the number of processes, or a
        multiple, each process holds whole groups), and a process reads and tokenizes the
        documents of its groups alone (from files, opening only their shards)."""
        size = self._group_rows()
        pieces = []
        placement = []
        keys = []
        for g in groups:
            with self._lock:
                texts = self._texts("train", self.group_documents(index, g))
            group = self._cut(texts)
            for i, place in enumerate(self._place(group, size * self.grad_accum_steps,
                                                  drop=True)):
                if place is not None:  # the group's row j: micro-batch j // size
                    micro, j = divmod(place[0], size)
                    place = (micro * self.rows_per_batch + g * size + j, *place[1:])
                placement.append(place)
                keys.append((i,) if self.pack_groups == 1 else (g, i))
            pieces += group
        return pieces, placement, keys

    def train_pieces(self, index: int) -> tuple[list[np.ndarray], list]:
        """The pieces of global batch `index` and their first-fit placement (None: dropped)."""
        pieces, placement, _ = self._group_pieces(index, range(self.pack_groups))
        return pieces, placement

    def _batch(self, pieces, placement, rows: tuple[int, int], stream: int,
               index: int, keys=None) -> dict[str, np.ndarray]:
        """Rows [start, stop) of the packed batch with the objective applied (`keys`: each
        piece's key within the update, default its position)."""
        inside = [place is not None and rows[0] <= place[0] < rows[1] for place in placement]
        if self.span_length:
            sentinels = np.asarray(self.tokenizer.sentinel_ids, np.int32)
            keys = keys or [(i,) for i in range(len(pieces))]
            pairs = [span_corruption.corrupt(p, span_corruption.noise_mask(
                len(p), np.random.default_rng([self.seed, stream, index, *key])), sentinels,
                self.tokenizer.eos_id)
                if keep else None for p, keep, key in zip(pieces, inside, keys, strict=True)]
            return batching.pack(pairs, placement, rows, self.source_length, self.target_length)
        empty = np.zeros(0, np.int32)
        wanted = [(empty, p) if keep else None for p, keep in zip(pieces, inside, strict=True)]
        packed = batching.pack(wanted, placement, rows, 0, self.max_length)
        return self._objective(packed, stream, index, range(*rows))

    def train_batch(self, index: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
        pieces, placement, keys = self._group_pieces(index, self._groups_of(rows))
        micro = []
        for a in range(self.grad_accum_steps):
            global_rows = (a * self.rows_per_batch + rows[0], a * self.rows_per_batch + rows[1])
            micro.append(self._batch(pieces, placement, global_rows, _TRAIN, index, keys))
        return {k: np.stack([m[k] for m in micro]) for k in micro[0]}

    @functools.cached_property
    def _eval_plan(self) -> tuple[list[np.ndarray], np.ndarray]:
        count = min(self.eval_documents, self._num_documents(self.validation_split))
        pieces = self._cut(self._texts(self.validation_split, range(count)))
        starts = batching.plan_epoch(*self._lengths(pieces), np.arange(len(pieces)),
                                     self.eval_rows_per_batch,
                                     (self.source_length, self.target_length))
        return pieces, starts

    def eval_batches(self, split: str, rows: tuple[int, int]):
        if split != self.validation_split:
            raise ValueError(f"split={split!r}: this source evaluates data.eval_split="
                             f"{self.validation_split!r}")
        pieces, starts = self._eval_plan
        for b in range(len(starts) - 1):
            chunk = pieces[starts[b]:starts[b + 1]]
            placement = self._place(chunk, self.eval_rows_per_batch, drop=False)
            batch = self._batch(chunk, placement, rows, _EVAL, b)
            yield {k: v[None] for k, v in batch.items()}


def from_config(cfg, workdir: str | None = None, source_class=LanguageModelSource,
                **extra) -> LanguageModelSource:
    """`LanguageModelSource` (or `source_class`, given `extra` arguments) from the config's
    `data` keys (see configs/lm_default.py)."""
    data = cfg.data
    objective = data.objective
    wanted = OBJECTIVES.get(objective)
    if wanted and cfg.model.architecture != wanted:
        raise ValueError(f"data.objective={objective!r} trains a model.architecture="
                         f"{wanted!r}, not {cfg.model.architecture!r}")
    settings.check_model_fits(cfg)
    source = source_class(
        data.dataset, objective=objective, vocab_size=int(data.vocab_size),
        max_length=int(data.max_length), batch_size=int(data.batch_size),
        grad_accum_steps=int(cfg.grad_accum_steps), eval_batch_size=data.get("eval_batch_size"),
        eval_split=data.get("eval_split") or "validation",
        eval_documents=int(data.get("eval_documents") or 2000),
        mask_rate=float(data.get("mask_rate") or 0.15), seed=int(cfg.seed),
        data_dir=data.get("data_dir"), manual_dir=data.get("manual_dir"), workdir=workdir,
        vocab_sample_documents=int(data.get("vocab_sample_documents") or 200_000),
        num_sentinels=int(data.get("num_sentinels") or DEFAULT_SENTINELS.get(objective, 0)),
        text_field=data.get("text_field") or "text", eval_dataset=data.get("eval_dataset"),
        shuffle_window=int(data.get("shuffle_window") or 8),
        skip_bad_lines=bool(data.get("skip_bad_lines")),
        sources=[dict(s) for s in data.get("sources") or []],
        vocab_path=data.get("vocab_path") or None,
        pack_groups=int(data.get("pack_groups") or 1), **extra)
    tokenizer_lib.check_special_ids(source.tokenizer, cfg.model)
    return source
