"""Vocabularies: SentencePiece, one vocabulary shared by source and target, trained (seeded)
on first use. Or an imported checkpoint's own, or one given as `data.vocab_path` (a
SentencePiece model or a Hugging Face `tokenizer.json`, `read_given`).

Ids follow docs/architecture.md: pad 0, unk 1, bos 2 (the decoder's start), eos 3, then the
user-defined `[MASK]` (4): the ids are defined here, once, and imported everywhere (the model
and decoding included: this module imports SentencePiece only when a model is loaded or trained,
so it needs no data extra). An imported checkpoint's vocabulary keeps its own ids: each
tokenizer says its `bos_id`, `eos_id` and `pad_id` (0, or None where id 0 is an ordinary token),
and the run's `model.*` fields of the same names agree with them. Its `eos_ids` are every id
that ends a generated text (`eos_id` first, then the further ends a checkpoint's generation
config lists, as Qwen2-Instruct's and Llama 3.1's; `(eos_id,)` for runs trained here).
A run keeps its vocabulary in `<workdir>/vocab/` (`load` reads either kind; the workdir may
be remote, e.g. gs://: every path goes through etils.epath) and reuses it on resume. A model
whose size differs from `data.vocab_size`, or whose sha256 differs from the one the run recorded in
`config.json`, is an error rather than a silent retrain.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized

from etils import epath

from transformer.checkpoint import layout
from transformer.util import atomic, progress

log = logging.getLogger("transformer")

PAD_ID = 0  # BOS starts the decoder; PAD is never a target
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
MASK_ID = 4  # a user-defined piece: the first id after the four above
MASK_PIECE = "[MASK]"
FIRST_ORDINARY_ID = MASK_ID + 1  # ids below are special (sentinels, when reserved, follow)
SENTINEL_PIECE = "<extra_id_{}>"  # T5's span-corruption sentinels: user-defined, after [MASK]
MODEL_FILE = "sentencepiece.model"
JSON_FILE = "tokenizer.json"  # the `tokenizers` library's file, as save_pretrained writes it
SPECIAL_IDS_FILE = "special_ids.json"  # beside JSON_FILE: its bos, eos, pad ids (rows if padded)
# (beside a padded MODEL_FILE: its rows); both: eos_ids where there are more ends than eos_id
PIECES_FILE = "sentencepiece.vocab"  # beside MODEL_FILE: its pieces and scores, readable
INFO_FILE = "info.json"  # beside a MODEL_FILE trained here: how (`load_or_train`)
# The files of the vocabulary in a run's vocab/ (which also keeps records of its data).
FILES = (MODEL_FILE, PIECES_FILE, JSON_FILE, SPECIAL_IDS_FILE, INFO_FILE)
# A tokenizer.json given as data.vocab_path: its special tokens by their usual spellings.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
PAD_TOKENS = ("<pad>", "[PAD]")


class VocabularyMismatch(ValueError):
    """The vocabulary on disk does not fit the config or the checkpoints."""


def _end_ids(eos_id: int, eos_ids) -> tuple[int, ...]:
    """`eos_id` and then the other ids of `eos_ids` (None: only `eos_id`)."""
    return tuple(dict.fromkeys([int(eos_id), *map(int, eos_ids or ())]))


def _recorded_ends(special: dict, eos_ids: tuple[int, ...]) -> dict:
    """`special` (a special_ids.json) with `eos_ids` where there are more than one."""
    return special | ({"eos_ids": list(eos_ids)} if len(eos_ids) > 1 else {})


def _embedding_rows(pieces: int, vocab_size: int | None, what: str) -> int:
    """The model's embedding rows: `vocab_size` where a checkpoint pads them past the
    vocabulary's `pieces`, else the pieces. Fewer rows than pieces is an error."""
    rows = pieces if vocab_size is None else int(vocab_size)
    if rows < pieces:
        raise VocabularyMismatch(f"{what} has {pieces} pieces, more than the model's {rows} "
                                 f"embedding rows")
    return rows


class Tokenizer:
    """A SentencePiece model: text <-> ids (no EOS added by `encode`; `decode` stops at EOS).
    Ours (`train`) has pad 0, unk 1, bos 2, eos 3. An imported one (Llama's `tokenizer.model`:
    unk 0, bos 1, eos 2, no pad) keeps its own. `vocab_size` is the model's embedding rows
    where a checkpoint pads them past the pieces (as `HuggingFaceTokenizer`'s; `save` records
    them in special_ids.json, as its `eos_ids` beyond EOS): ids from `pieces` on are never
    encoded and `decode` drops them."""

    def __init__(self, model_proto: bytes, vocab_size: int | None = None,
                 eos_ids: Sequence[int] | None = None):
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.pieces = self._sp.get_piece_size()
        self.rows = _embedding_rows(self.pieces, vocab_size, "the SentencePiece model")
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        self.pad_id = None if self._sp.pad_id() < 0 else self._sp.pad_id()
        if self.pad_id not in (PAD_ID, None) or min(self.bos_id, self.eos_id) < 0:
            raise VocabularyMismatch(
                f"the SentencePiece model has pad {self._sp.pad_id()}, bos {self.bos_id}, eos "
                f"{self.eos_id}: it needs a bos and an eos piece, and pad {PAD_ID} or none")
        self.eos_ids = _end_ids(self.eos_id, eos_ids)

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None,
             eos_ids: Sequence[int] | None = None) -> Tokenizer:
        return cls(epath.Path(path).read_bytes(), vocab_size, eos_ids)

    @property
    def vocab_size(self) -> int:
        """The model's rows: the pieces, and the padding past them if any."""
        return self.rows

    @property
    def mask_id(self) -> int:
        return self._sp.piece_to_id(MASK_PIECE)

    @property
    def sentinel_ids(self) -> list[int]:
        """Ids of the reserved sentinels `<extra_id_0>`, `<extra_id_1>`, ... (none unless the
        vocabulary was trained with `num_sentinels`)."""
        ids = []
        while (i := self._sp.piece_to_id(SENTINEL_PIECE.format(len(ids)))) != self._sp.unk_id():
            ids.append(i)
        return ids

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()

    def fingerprint(self) -> str:
        return f"sentencepiece vocab_size={self.vocab_size} sha256={self.sha256}"

    def encode(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of each text, without BOS or EOS."""
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS. Padding (the pad id and rows past the pieces)
        and BOS are dropped."""
        return self._sp.decode([i for i in _content(ids, self) if i < self.pieces])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def save(self, directory: str) -> str:
        """Writes `<directory>/sentencepiece.model` atomically (and a readable `.vocab`; and
        the model's rows where they exceed the pieces and its further ends in
        special_ids.json)."""
        directory = epath.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        special = _recorded_ends({"vocab_size": self.rows} if self.rows != self.pieces else {},
                                 self.eos_ids)
        if special:
            atomic.write_atomically(directory / SPECIAL_IDS_FILE, json.dumps(special))
        atomic.write_atomically(directory / MODEL_FILE, self.model_proto)
        pieces = "".join(f"{self._sp.id_to_piece(i)}\t{self._sp.get_score(i)}\n"
                         for i in range(self.pieces))
        atomic.write_atomically(directory / PIECES_FILE, pieces)
        return os.fspath(directory / MODEL_FILE)


class HuggingFaceTokenizer:
    """An imported checkpoint's `tokenizer.json` (the `tokenizers` library: GPT-2's byte-level
    BPE, Llama 3's, ...) with the special ids of its model's config. The same methods as
    `Tokenizer` (no [MASK]; its sentinels are T5's `<extra_id_k>` special tokens, where it
    has them: span corruption on an imported T5 uses them).

    `vocab_size` is the model's embedding rows where the checkpoint pads them past the
    tokenizer's pieces (T5 and Flan-T5: 32128 rows, 32100 pieces): ids from `pieces` on are
    never encoded and `decode` drops them, as transformers' decode does."""

    def __init__(self, json_bytes: bytes, *, bos_id: int, eos_id: int, pad_id: int | None,
                 vocab_size: int | None = None, eos_ids: Sequence[int] | None = None):
        from tokenizers import Tokenizer as JsonModel

        self.json_bytes = bytes(json_bytes)
        self._model = JsonModel.from_str(self.json_bytes.decode("utf-8"))
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.eos_ids = _end_ids(eos_id, eos_ids)
        self.mask_id, self.sentinel_ids = None, []
        special = {token.content: i for i, token in
                   self._model.get_added_tokens_decoder().items() if token.special}
        while (i := special.get(SENTINEL_PIECE.format(len(self.sentinel_ids)))) is not None:
            self.sentinel_ids.append(i)
        self.pieces = self._model.get_vocab_size(with_added_tokens=True)
        self.rows = _embedding_rows(self.pieces, vocab_size, "the tokenizer.json")

    @classmethod
    def from_special_tokens(cls, json_bytes: bytes, where: str) -> HuggingFaceTokenizer:
        """A tokenizer.json used as is, its ids found among its special tokens: eos the first
        of `EOS_TOKENS` (required), bos the first of `BOS_TOKENS` (else the eos, as GPT-2's
        `<|endoftext|>` both starts and ends), pad a `PAD_TOKENS` token at id 0 (else none)."""
        from tokenizers import Tokenizer as JsonModel

        model = JsonModel.from_str(json_bytes.decode("utf-8"))
        special = {t.content: i for i, t in model.get_added_tokens_decoder().items()
                   if t.special}
        eos = next((special[t] for t in EOS_TOKENS if t in special), None)
        if eos is None:
            raise VocabularyMismatch(
                f"{where} has no end-of-sequence token: add one of {', '.join(EOS_TOKENS)} as "
                f"a special token (it has {sorted(special) or 'none'})")
        bos = next((special[t] for t in BOS_TOKENS if t in special), eos)
        pad = PAD_ID if any(special.get(t) == PAD_ID for t in PAD_TOKENS) else None
        return cls(json_bytes, bos_id=bos, eos_id=eos, pad_id=pad)

    @classmethod
    def load(cls, directory: str) -> HuggingFaceTokenizer:
        """From `<directory>/tokenizer.json` and `special_ids.json` (as `save` writes them)."""
        directory = epath.Path(directory)
        special = json.loads((directory / SPECIAL_IDS_FILE).read_text())
        return cls((directory / JSON_FILE).read_bytes(), **special)

    @property
    def vocab_size(self) -> int:
        """The model's rows: the pieces, and the padding past them if any."""
        return self.rows

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.json_bytes).hexdigest()

    def fingerprint(self) -> str:
        return f"tokenizer.json vocab_size={self.vocab_size} sha256={self.sha256}"

    def encode(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of each text, without the special tokens the tokenizer would add."""
        del num_threads  # the library picks its own
        return [e.ids for e in self._model.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS. Padding (the pad id and rows past the pieces) and
        BOS are dropped."""
        kept = [i for i in _content(ids, self) if i < self.pieces]
        return self._model.decode(kept, skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self._model.id_to_token(int(i))

    def save(self, directory: str) -> str:
        """Writes `<directory>/tokenizer.json` and its special ids (and the model's rows where
        they exceed the pieces, and its further ends), atomically."""
        directory = epath.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        special = {"bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id}
        if self.rows != self.pieces:
            special["vocab_size"] = self.rows
        atomic.write_atomically(directory / SPECIAL_IDS_FILE,
                                json.dumps(_recorded_ends(special, self.eos_ids)))
        atomic.write_atomically(directory / JSON_FILE, self.json_bytes)
        return os.fspath(directory / JSON_FILE)


def _content(ids: Iterable[int], tokenizer) -> list[int]:
    """`ids` up to the first EOS, without padding and BOS."""
    kept = []
    for i in map(int, ids):
        if i == tokenizer.eos_id:
            break
        if i not in (tokenizer.pad_id, tokenizer.bos_id):
            kept.append(i)
    return kept


def load(directory: str) -> Tokenizer | HuggingFaceTokenizer:
    """The vocabulary a run keeps in `directory` (`<workdir>/vocab/`): its SentencePiece model,
    or an imported `tokenizer.json`. Raises FileNotFoundError naming the SentencePiece file
    when there is neither, RuntimeError or ValueError when the file is damaged."""
    if (epath.Path(directory) / JSON_FILE).exists():
        return HuggingFaceTokenizer.load(directory)
    return Tokenizer.load(os.fspath(epath.Path(directory) / MODEL_FILE),
                          **_recorded(directory))


def _recorded(directory) -> dict:
    """The embedding rows and further ends a SentencePiece model's special_ids.json records
    (`Tokenizer.save`), as `Tokenizer.load`'s arguments."""
    special = epath.Path(directory) / SPECIAL_IDS_FILE
    return json.loads(special.read_text()) if special.exists() else {}


def read_given(path: str, setting: str = "data.vocab_path") -> Tokenizer | HuggingFaceTokenizer:
    """A vocabulary used as is: a Hugging Face `tokenizer.json` (a path ending in `.json`; the
    ids of a `special_ids.json` beside it, else `HuggingFaceTokenizer.from_special_tokens`), or
    a SentencePiece model. One line naming `setting` when it cannot be read."""
    kind = "tokenizer.json" if path.endswith(".json") else "SentencePiece model"
    try:
        if kind == "SentencePiece model":  # the rows of a run's padded one (`save`)
            return Tokenizer.load(path, **_recorded(epath.Path(path).parent))
        data = epath.Path(path).read_bytes()
        beside = epath.Path(path).parent / SPECIAL_IDS_FILE
        if beside.exists():  # a run's own vocab/ (HuggingFaceTokenizer.save)
            return HuggingFaceTokenizer(data, **json.loads(beside.read_text()))
        return HuggingFaceTokenizer.from_special_tokens(data, f"{setting}={path!r}")
    except VocabularyMismatch:
        raise
    except Exception as e:  # OSError; RuntimeError (sentencepiece); the tokenizers' parse error
        raise ValueError(f"{setting}={path!r} is not a readable {kind} ({type(e).__name__}); "
                         f"give a SentencePiece model or a Hugging Face tokenizer.json"
                         ) from None


def keep_given(given, path: str, directory: str | None, vocab_size: int, *,
               expected_sha256: str | None = None, num_sentinels: int = 0):
    """`given`, read from data.vocab_path=`path` (`read_given`), as a run's vocabulary: copied
    into `directory` (the run's vocab/, for resume and inference; None: no run) the first time,
    then checked as `load_or_train` checks it, and refused when vocab/ holds another."""
    if directory is None:
        return given
    if not epath.Path(vocabulary_file(directory)).exists():
        given.save(directory)
    tokenizer = load_or_train(directory, vocab_size, seed=0, sentences=tuple,
                              expected_sha256=expected_sha256, num_sentinels=num_sentinels)
    if given.sha256 != tokenizer.sha256:
        raise VocabularyMismatch(
            f"data.vocab_path={path!r} is not the vocabulary this run started with (its "
            f"vocab/): resume with the path it was started with or use a new --workdir")
    return tokenizer


def vocabulary_file(directory: str) -> str:
    """The file of the vocabulary in `directory`: tokenizer.json if there is one, else the
    SentencePiece model (which may not exist yet)."""
    json_path = epath.Path(directory) / JSON_FILE
    return os.fspath(json_path if json_path.exists() else epath.Path(directory) / MODEL_FILE)


def check_special_ids(tokenizer, model) -> None:
    """Raises `VocabularyMismatch` unless the `model` section's bos_id, eos_id and pad_id are
    the vocabulary's (they differ from ours for an imported checkpoint)."""
    for field, default in (("bos_id", BOS_ID), ("eos_id", EOS_ID), ("pad_id", PAD_ID)):
        ours = model.get(field, default)
        theirs = getattr(tokenizer, field)
        if ours != theirs:
            raise VocabularyMismatch(f"model.{field}={ours} but the vocabulary's {field} is "
                                     f"{theirs}: set --config.model.{field}={theirs}")


def _counted(sentences: Iterable[str]) -> Iterator[str]:
    """`sentences`, with progress on stderr while SentencePiece reads them (it then trains
    without a word: the log line before says so)."""
    total = len(sentences) if isinstance(sentences, Sized) else None
    with progress.bar(total, "reading sentences for SentencePiece", unit="sentence") as bar:
        for sentence in sentences:
            yield sentence
            bar.update()


def train(sentences: Iterable[str], vocab_size: int, *, seed: int, model_type: str = "bpe",
          character_coverage: float = 1.0, num_sentinels: int = 0) -> Tokenizer:
    """Trains a SentencePiece model on `sentences` (use both languages for a shared vocabulary).
    Seeded and single-threaded, so the same sentences give the same model. `num_sentinels`
    reserves T5's sentinels as the ids right after [MASK]."""
    import sentencepiece as spm

    spm.set_random_generator_seed(int(seed))
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_counted(sentences), model_writer=model, vocab_size=int(vocab_size),
            model_type=model_type, character_coverage=character_coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            user_defined_symbols=[MASK_PIECE] + [SENTINEL_PIECE.format(k)
                                                 for k in range(num_sentinels)],
            input_sentence_size=0,
            shuffle_input_sentence=False, num_threads=1, minloglevel=2)
    except RuntimeError as e:
        raise VocabularyMismatch(f"SentencePiece could not train data.vocab_size={vocab_size}: "
                                 f"{str(e).strip().splitlines()[-1]}") from None
    return Tokenizer(model.getvalue())


def load_or_train(directory: str, vocab_size: int, *, seed: int,
                  sentences: Callable[[], Iterable[str]], expected_sha256: str | None = None,
                  info: dict | None = None,
                  num_sentinels: int = 0) -> Tokenizer | HuggingFaceTokenizer:
    """The vocabulary in `directory` (`<workdir>/vocab`: `load`), a SentencePiece model trained
    from `sentences()` if there is none.

    `expected_sha256` is the vocabulary the run's checkpoints were trained with (from
    config.json). A model that differs raises `VocabularyMismatch`, as does one whose size is
    not `vocab_size`."""
    path = vocabulary_file(directory)
    if epath.Path(path).exists():
        tokenizer = load(directory)
        if tokenizer.vocab_size != vocab_size:
            raise VocabularyMismatch(
                f"{path} has {tokenizer.vocab_size} pieces but data.vocab_size={vocab_size}: "
                f"set --config.data.vocab_size={tokenizer.vocab_size} or use a new --workdir")
    else:
        log.info("training a %d-piece SentencePiece vocabulary into %s", vocab_size, directory)
        tokenizer = train(sentences(), vocab_size, seed=seed, num_sentinels=num_sentinels)
        if epath.Path(path).exists():  # another process of this run got there first
            tokenizer = Tokenizer.load(path)
        else:
            tokenizer.save(directory)
            record = dict(info or {}, vocab_size=vocab_size, seed=seed, model_type="bpe",
                          num_sentinels=num_sentinels, sha256=tokenizer.sha256)
            atomic.write_atomically(epath.Path(directory) / INFO_FILE,
                                    json.dumps(record, indent=1))
    if len(tokenizer.sentinel_ids) < num_sentinels:
        raise VocabularyMismatch(
            f"{path} reserves {len(tokenizer.sentinel_ids)} sentinels but "
            f"data.num_sentinels={num_sentinels}: use a new --workdir (or a vocabulary trained "
            f"with them)")
    if expected_sha256 and tokenizer.sha256 != expected_sha256:
        raise VocabularyMismatch(
            f"{path} (sha256 {tokenizer.sha256[:12]}…) is not the vocabulary this run was "
            f"trained with (sha256 {expected_sha256[:12]}… in config.json): restore the original "
            f"vocab/ directory or use a new --workdir")
    return tokenizer


def load_run(workdir: str, vocab_size: int,
             recorded_sha256: str | None) -> Tokenizer | HuggingFaceTokenizer:
    """A run's vocabulary from `<workdir>/vocab/`: its SentencePiece model, or an imported
    checkpoint's tokenizer.json. It is refused unless it is the vocabulary the run was trained
    with: `vocab_size` pieces, and the sha256 its config.json recorded (None: not recorded)."""
    directory = layout.path(workdir, layout.VOCAB)
    vocab = vocabulary_file(directory)
    if not epath.Path(vocab).exists():
        raise ValueError(f"{vocab} is missing: this run has no vocabulary (was it trained on "
                         f"text, not the synthetic task?)")
    if not epath.Path(vocab).is_file():
        raise ValueError(f"{vocab} is not a file: restore the run's vocab/ directory")
    kind = "a tokenizer.json" if vocab.endswith(JSON_FILE) else "a SentencePiece model"
    try:
        tokenizer = load(directory)
    except VocabularyMismatch:
        raise
    except (RuntimeError, ValueError, OSError):  # the bytes do not parse as a vocabulary
        raise ValueError(f"{vocab} is damaged (not {kind}): restore the run's vocab/ "
                         f"directory from a copy") from None
    if tokenizer.vocab_size != vocab_size or recorded_sha256 not in (None, tokenizer.sha256):
        recorded = f", sha256 {recorded_sha256[:12]}…" if recorded_sha256 else ""
        raise VocabularyMismatch(
            f"{vocab} ({tokenizer.vocab_size} pieces, sha256 {tokenizer.sha256[:12]}…) is not "
            f"the vocabulary this run was trained with ({vocab_size} pieces{recorded} in "
            f"config.json): restore the run's vocab/ directory")
    return tokenizer
