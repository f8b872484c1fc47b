"""Preference pairs for DPO (`training/dpo.py`): `data.objective = "dpo"` on
`data.dataset = "preference:<glob>"`, jsonl files whose rows hold "prompt", "chosen" and
"rejected", read as any file source (`files.py`).

The three are text (the prompt may be empty), or lists of {"role", "content"} messages
rendered with the checkpoint's chat template (`chat.py`), as trl's `DPOTrainer` reads them:
text sides get the vocabulary's EOS appended; messages are rendered as the prompt with the
generation prompt and as prompt + response. Each side is tokenized as trl tokenizes it (the
prompt, and the prompt + response, the response starting where their ids first differ), with
`targets_loss_mask` 1 on the response's tokens, and cut to `data.max_length // 2` tokens
keeping its start (trl's `truncation_mode="keep_start"`); a pair whose prompt fills that is
dropped, as trl drops it.

A pair is one piece of a row, packed first-fit as the causal objective packs documents
(`language_model.py`): pair k of a row is segments 2k + 1 (chosen) and 2k + 2 (rejected),
each with positions from 0, so the two sides never see each other.

Bad input is one line before training: a row without the three fields, a side that is
neither text nor messages, prompt and sides of different kinds, an empty chosen or rejected
side, messages without a chat template.
"""

from __future__ import annotations

import json

import numpy as np
from etils import epath

from transformer.checkpoint import layout
from transformer.data import chat, files, language_model
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.file_formats import ShardReader
from transformer.data.file_specs import BadData

PREFIX = "preference:"
FIELDS = ("prompt", "chosen", "rejected")
KEYS = ("targets", "targets_segmentation", "targets_positions", "targets_loss_mask")


def file_spec(spec: str, setting: str = "data.dataset") -> str:
    """The `jsonl:<glob>` of a `preference:<glob>`, else one line."""
    if not spec or not spec.startswith(PREFIX):
        raise BadData(f"{setting}={spec!r}: data.objective='dpo' reads preference pairs; write "
                      f"it as preference:<glob> (jsonl rows with prompt, chosen, rejected)")
    return "jsonl:" + spec[len(PREFIX):]


def check_pair(record, where: str) -> None:
    """One line naming `where` (file:line) unless `record` is a pair: prompt, chosen and
    rejected all text or all message lists, chosen and rejected not empty."""
    if not isinstance(record, dict) or not all(k in record for k in FIELDS):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise BadData(f"{where}: a preference row holds {', '.join(FIELDS)} (it has {have})")
    kinds = {type(record[k]) for k in FIELDS}
    if not kinds <= {str} and not kinds <= {list}:
        kinds = ", ".join(type(record[k]).__name__ for k in FIELDS)
        raise BadData(f"{where}: prompt, chosen and rejected must all be text or all be lists "
                      f"of messages (they are {kinds})")
    for side in FIELDS[1:]:
        if not record[side] or (isinstance(record[side], str) and not record[side].strip()):
            raise BadData(f"{where}: the {side} side is empty, so the pair compares nothing; "
                          f"remove the row or write the {side} response")
        if isinstance(record[side], list):  # the prompt's turns, then the response's
            chat.check_messages(record["prompt"] + record[side], where)


class PreferenceReader(ShardReader):
    """A jsonl shard's pairs, each checked and kept as its JSON."""

    def _record(self, record, where: str) -> tuple[str]:
        check_pair(record, where)
        return (json.dumps({k: record[k] for k in FIELDS}),)


class PreferenceDocuments(files.FileDocuments):
    reader_class = PreferenceReader


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def encode_pair(pair: dict, tokenizer, chat_template: dict | None,
                length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A pair's sides as trl tokenizes them, each [2, n] (ids, response mask) cut to `length`
    tokens keeping its start; None when the prompt leaves no response token."""
    prompt, chosen, rejected = (pair[k] for k in FIELDS)
    if isinstance(chosen, list):
        if chat_template is None:
            raise BadData("preference pairs of messages need the checkpoint's chat template "
                          "and the vocabulary has none: add 'chat_template' to its "
                          "tokenizer_config.json, or give the pairs as text")
        texts = [chat.render(chat_template, prompt, add_generation_prompt=True),
                 chat.render(chat_template, prompt + chosen),
                 chat.render(chat_template, prompt + rejected)]
        eos = []
    else:
        texts = [prompt, prompt + chosen, prompt + rejected]
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    prompt_ids, *sides = (list(ids) for ids in tokenizer.encode(texts))
    start = min(_common_prefix(prompt_ids, side) for side in sides)
    if start >= length:
        return None
    out = []
    for side in sides:
        ids = np.asarray(side + eos, np.int32)[:length]
        mask = (np.arange(len(ids)) >= start).astype(np.int32)
        out.append(np.stack([ids, mask]))
    return out[0], out[1]


def pack_pairs(pairs, placement, rows: tuple[int, int], length: int) -> dict[str, np.ndarray]:
    """Rows [start, stop) of a batch: each pair (chosen [2, n], rejected [2, m]) at its
    `first_fit` place (row, _, offset) as segments 2k + 1 and 2k + 2 of its row."""
    start, stop = rows
    batch = {k: np.zeros((stop - start, length), np.int32) for k in KEYS}
    pairs_in_row = {}
    for pair, place in zip(pairs, placement, strict=True):
        if pair is None or place is None or not start <= place[0] < stop:
            continue
        r, offset = place[0] - start, place[2]
        k = pairs_in_row[r] = pairs_in_row.get(r, 0) + 1
        for s, side in enumerate(pair):
            n = side.shape[1]
            where = slice(offset, offset + n)
            batch["targets"][r, where], batch["targets_loss_mask"][r, where] = side
            batch["targets_segmentation"][r, where] = 2 * k - 1 + s
            batch["targets_positions"][r, where] = np.arange(n)
            offset += n
    return batch


class PreferenceSource(language_model.LanguageModelSource):
    """Packed preference pairs (the `Source` contract): `LanguageModelSource`'s order and
    first-fit packing, each piece a pair."""

    document_class = PreferenceDocuments

    def __init__(self, dataset: str, *, objective: str = "dpo",
                 chat_template: dict | None = None, init_from: str | None = None,
                 eval_dataset: str | None = None, sources=None, **kwargs):
        if sources:
            raise BadData("data.sources (a mixture) is not read by data.objective='dpo': "
                          "give the pairs as data.dataset='preference:<glob>'")
        spec = file_spec(dataset)
        eval_spec = file_spec(eval_dataset, "data.eval_dataset") if eval_dataset else None
        self.chat = chat_template
        if self.chat is None:  # only pairs of messages need one (encode_pair)
            try:
                self.chat = chat.find_template(workdir=kwargs.get("workdir"),
                                               vocab_path=kwargs.get("vocab_path"),
                                               init_from=init_from)
            except BadData:
                self.chat = None
        # the causal packing of sft's decoder; each piece is a pair (`_cut`)
        super().__init__(spec, objective="sft", eval_dataset=eval_spec, **kwargs)
        self.objective = objective

    def _tokenizer(self, vocab_size: int, sample_documents: int):
        kept = self.workdir and tokenizer_lib.vocabulary_file(
            layout.path(self.workdir, layout.VOCAB))
        if not self._given and not (kept and epath.Path(kept).exists()):
            raise BadData("data.objective='dpo' fine-tunes a checkpoint with its own "
                          "vocabulary: set init_from (a run or an import) or data.vocab_path")
        return super()._tokenizer(vocab_size, sample_documents)

    def _cut(self, texts: list[str]) -> list[np.ndarray]:
        """Each pair as one [3, n] piece, its sides one after the other: (ids, response
        mask, side 0 chosen | 1 rejected). Pairs whose prompt fills a side are left out."""
        pieces = []
        for text in texts:
            pair = encode_pair(json.loads(text), self.tokenizer, self.chat,
                               self.max_length // 2)
            if pair is not None:
                sides = [np.concatenate([side, np.full((1, side.shape[1]), s, np.int32)])
                         for s, side in enumerate(pair)]
                pieces.append(np.concatenate(sides, axis=1))
        return pieces

    def _lengths(self, pieces) -> tuple[np.ndarray, np.ndarray]:
        n = np.array([p.shape[1] for p in pieces], np.int64)
        return np.zeros_like(n), n

    def _mean_lengths(self) -> list[float]:
        sample = self.documents["train"].sample(language_model.LENGTH_SAMPLE, (11,))
        pieces = self._cut(self.documents["train"].texts(sample))
        return [float(np.mean([p.shape[1] for p in pieces])) if pieces else 1.0]

    def _batch(self, pieces, placement, rows, stream, index, keys=None):
        del stream, index, keys  # no draws
        pairs = [(p[:2, p[2] == 0], p[:2, p[2] == 1]) for p in pieces]
        return pack_pairs(pairs, placement, rows, self.max_length)

    def fingerprint(self) -> str:
        return super().fingerprint().replace(" sft ", f" {self.objective} ", 1)


def from_config(cfg, workdir: str | None = None) -> PreferenceSource:
    """`PreferenceSource` from the config's `data` keys (those of
    `language_model.from_config`)."""
    if not cfg.data.get("eval_dataset"):
        raise BadData("data.objective='dpo' evaluates held-out pairs: set "
                      "data.eval_dataset='preference:<glob>'")
    if cfg.model.architecture != "decoder":
        raise ValueError(f"data.objective='dpo' trains a model.architecture='decoder', not "
                         f"{cfg.model.architecture!r}")
    return language_model.from_config(cfg, workdir, source_class=PreferenceSource,
                                      init_from=cfg.get("init_from") or None)
